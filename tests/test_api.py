"""The Python API (``kvsim``, README "Python API"): a wrong argument is a TypeError naming it and what it takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvsim

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny-cpu.yaml")


@pytest.mark.parametrize("call, message", [  # (each before anything is written: "x" is never made)
    (lambda: kvsim.run({"name": "x"}), "run: scenario is a dict; expected a Scenario"),
    (lambda: kvsim.run(None), "run: scenario is a NoneType"),
    (lambda: kvsim.run(TINY, requests=[1, 2]), "run: requests is a list; expected a sim.workload.RequestTable"),
    (lambda: kvsim.run(TINY, progress=5), "run: progress is a int; expected a function"),
    (lambda: kvsim.write_results(None, "x"), "write_results: result is a NoneType"),
    (lambda: kvsim.load_requests(123), "load_requests: scenario is a int"),
    (lambda: kvsim.sweep_to_dir(str(ROOT / "scenarios" / "vllm-paper" / "opt-13b-sharegpt.sweep.yaml"), "x", workers="a"),
     "workers is a str; expected a whole number"),
    # (each ran, or failed deep inside: exact="no" ran exact, an int executor was "'int' object is not callable")
    (lambda: kvsim.run_to_dir(TINY, "x", exact="no"), "run_to_dir: exact is str 'no'; expected true or false"),
    (lambda: kvsim.run_to_dir(None), "run_to_dir: scenario_path is NoneType"),
    (lambda: kvsim.run_to_dir(TINY, 42), "run_to_dir: out_dir is int 42; expected a folder's path or None"),
    (lambda: kvsim.write_results(None, "x", report="no"), "write_results: report is str 'no'"),
    (lambda: kvsim.run(TINY, decompose="yes"), "run: decompose is a str; expected true or false"),
    (lambda: kvsim.run(TINY, executor=5), "run: executor is a int; expected a function"),
    (lambda: kvsim.run(TINY, read_trace=5), "run: read_trace is a int; expected a function"),
    (lambda: kvsim.read_trace(None, "t.csv"), "read_trace: workload is NoneType None; expected a trace workload"),
    (lambda: kvsim.check_scenario(42), "check_scenario: scenario_path is int 42"),
    (lambda: kvsim.plan_to_dir(None), "plan_to_dir: plan_path is NoneType"),
    (lambda: kvsim.write_report(42), "write_report: folder is int 42")])
def test_a_wrong_argument_is_a_type_error_naming_it(call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=message):
        call()
    assert not list(tmp_path.iterdir())


def test_results_go_to_a_folder_and_requests_load_from_a_path(tmp_path):
    from sim.config import ScenarioError

    (tmp_path / "f").write_text("")
    with pytest.raises(ScenarioError, match="exists and is not a folder"):  # (was a raw FileExistsError)
        kvsim.write_results(kvsim.run(TINY), tmp_path / "f", report=False)
    assert len(kvsim.load_requests(TINY)) == 30


def test_a_path_like_is_a_path(tmp_path):
    """Any os.PathLike names a file (the type checks took only str and pathlib.Path at first)."""
    class Named:
        def __fspath__(self):
            return TINY

    assert kvsim.check_scenario(Named())[0].endswith(": ok")


@pytest.mark.parametrize("call", [lambda: kvsim.run_to_dir(TINY, ""), lambda: kvsim.sweep_to_dir(
    str(ROOT / "scenarios" / "vllm-paper" / "opt-13b-sharegpt.sweep.yaml"), "")])
def test_an_empty_out_dir_is_refused(call, tmp_path, monkeypatch):
    """run_to_dir(S, "") wrote the results into the current folder (Path("") is ".")."""
    from sim.config import ScenarioError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScenarioError, match="out_dir: an empty path"):
        call()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("call, what", [(lambda: kvsim.run(""), "scenario file"),
                                        (lambda: kvsim.check_scenario(" "), "scenario file"),
                                        (lambda: kvsim.sweep_to_dir(""), "sweep file"),
                                        (lambda: kvsim.plan_to_dir(""), "plan file")])
def test_an_empty_file_path_says_so(call, what):
    """It said ".: not a regular file" (Path("") is the current folder)."""
    from sim.config import ScenarioError

    with pytest.raises(ScenarioError, match="^" + re.escape(f"an empty path (expected a {what})") + "$"):
        call()
