"""The Python API (``kvsim``, README "Python API"): a wrong argument is a TypeError naming it and what it takes."""

from __future__ import annotations

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
     "workers is a str; expected a whole number")])
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
