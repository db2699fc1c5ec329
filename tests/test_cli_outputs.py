"""Output paths a user names: each unusable one is one clear error (exit 2) before any work, never a
traceback after it; and model files that are not config.json files."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from cli import app

SCENARIO = ("name: out\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {arrival: {kind: poisson, rate: 2}, "
            "lengths: alpaca, num_requests: 5}\npolicies: [vllm]\n")


@pytest.fixture
def scenario(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    return p


def invoke(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output
    return r


def test_run_out_is_an_existing_file(tmp_path, scenario):
    (tmp_path / "f").write_text("x")
    r = invoke("run", scenario, "--out", tmp_path / "f", "--no-report")
    assert r.exit_code == 2 and "exists and is not a folder" in r.output and str(tmp_path / "f") in r.output


def test_run_out_cannot_be_created(tmp_path, scenario):
    (tmp_path / "f").write_text("x")
    r = invoke("run", scenario, "--out", tmp_path / "f" / "sub", "--no-report")
    assert r.exit_code == 2 and "cannot create the folder" in r.output


def test_run_out_nested_a_thousand_folders_deep(tmp_path, scenario):
    """pathlib's mkdir recursed once per folder: a RecursionError traceback after the run."""
    r = invoke("run", scenario, "--out", tmp_path / ("b/" * 1000), "--no-report")
    assert r.exit_code == 2 and "1,000 nested folders to create; expected at most 100" in r.output, r.output
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: a read-only folder is not read-only to root")
def test_run_out_not_writable(tmp_path, scenario):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    r = invoke("run", scenario, "--out", ro, "--no-report")
    assert r.exit_code == 2 and "not writable" in r.output


def test_report_out_is_a_folder(tmp_path, scenario):
    r = invoke("run", scenario, "--out", tmp_path / "run", "--no-report")
    assert r.exit_code == 0 and "report.html" not in r.output  # none written, none named
    assert "every metric: summary.json" in r.output
    r = invoke("report", tmp_path / "run", "--out", tmp_path)
    assert r.exit_code == 2 and "is a folder" in r.output


@pytest.mark.parametrize("name", ["summary.json", "requests.parquet", "report"])
def test_report_out_that_is_not_html(tmp_path, scenario, name):
    """--out RUN/summary.json wrote the page over the run's own summary (the folder was no run any more)."""
    r = invoke("run", scenario, "--out", tmp_path / "run", "--no-report")
    before = {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir()}
    r = invoke("report", tmp_path / "run", "--out", tmp_path / "run" / name)
    assert r.exit_code == 2 and "the report is written as HTML; name it *.html" in r.output, r.output
    assert {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir()} == before


def test_sweep_out_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    sweep = tmp_path / "w.yaml"
    sweep.write_text("name: w\nbase: {name: w, model: opt-13b, gpu: a100-40gb, workload: {arrival: {kind: poisson, "
                     "rate: 2}, lengths: alpaca, num_requests: 5}, policies: [vllm]}\naxes: {block_size: [8, 16]}\n")
    r = invoke("sweep", sweep, "--out", tmp_path / "f")
    assert r.exit_code == 2 and "exists and is not a folder" in r.output


def test_trace_convert_out_is_a_folder(tmp_path):
    t = tmp_path / "t.csv"
    t.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,5\n")
    r = invoke("trace", "convert", t, tmp_path)
    assert r.exit_code == 2 and "is a folder" in r.output


@pytest.mark.parametrize("content, message", [
    (b"\x00\xff\xfe binary", "m.json:1: not UTF-8 text (byte 0xff at column 2; expected a model config file)"),
    (b"[1, 2]", "expected a JSON object"),
    (b"{not json", "not valid JSON"),
])
def test_model_file_that_is_not_a_config(tmp_path, content, message):
    (tmp_path / "m.json").write_bytes(content)
    s = tmp_path / "s.yaml"
    s.write_text(SCENARIO.replace("model: opt-13b", "model: m.json"))
    r = invoke("check", s)
    assert r.exit_code == 2 and message in r.output and "m.json" in r.output


def test_model_folder_without_config(tmp_path):
    (tmp_path / "mdl").mkdir()
    s = tmp_path / "s.yaml"
    s.write_text(SCENARIO.replace("model: opt-13b", "model: ./mdl"))
    r = invoke("check", s)
    assert r.exit_code == 2 and "no such model config file" in r.output


@pytest.mark.parametrize("key, value, hint", [("model", "opt-13", "did you mean 'opt-13b'"),
                                              ("gpu", "h10", "did you mean 'h100'")])
def test_unknown_model_or_gpu_names_the_line(tmp_path, key, value, hint):
    s = tmp_path / "s.yaml"
    s.write_text(SCENARIO.replace("model: opt-13b", f"model: {value}") if key == "model"
                 else SCENARIO.replace("gpu: a100-40gb", f"gpu: {value}"))
    r = invoke("check", s)
    line = 2 if key == "model" else 3
    assert r.exit_code == 2 and f"s.yaml:{line}: {key}: unknown {key}" in r.output and hint in r.output


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    s = d / "s.yaml"
    s.write_text(SCENARIO)
    assert invoke("run", s, "--out", d / "run", "--no-report").exit_code == 0
    return d / "run"


def _crafted(run, tmp_path, edit):
    import shutil

    d = tmp_path / "crafted"
    shutil.copytree(run, d)
    edit(d)
    return d


def _drop_column(d, file, column):
    import pyarrow.parquet as pq

    t = pq.read_table(d / file)
    pq.write_table(t.drop_columns([column]), d / file)


def _edit_json(path, edit):
    import json

    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _keep_rows(d, file, column, value):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(d / file)
    pq.write_table(t.filter(pc.equal(pc.cast(t[column], "string"), value)), d / file)


def test_report_refuses_a_folder_twice_and_a_plan_among_runs(finished_run, tmp_path):
    """A folder compared with itself drew every chart twice; a plan folder among runs was "not a result folder"."""
    r = invoke("report", finished_run, tmp_path / ".." / tmp_path.name / ".." / finished_run.parent.name / "run")
    assert r.exit_code == 2 and "given twice" in r.output, r.output
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.json").write_text("{}")
    r = invoke("report", finished_run, plan)
    assert r.exit_code == 2 and "a `sim plan` folder: its report is a page of its own" in r.output.replace("\n", "")


def test_a_run_that_took_no_step_has_no_snapshot_and_reports(tmp_path):
    """Every request refused (longer than the model's context): no step, so no address space to keep."""
    s = tmp_path / "s.yaml"
    s.write_text(SCENARIO.replace("lengths: alpaca", "prompt: {kind: fixed, tokens: 9000}, output: {kind: fixed, tokens: 10}"))
    assert invoke("run", s, "--out", tmp_path / "run", "--no-report").exit_code == 0
    assert not (tmp_path / "run" / "kv_snapshots.parquet").exists()
    r = invoke("report", tmp_path / "run")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "summary.json").write_text('{"scenario": {}, "policies": {"vllm": 5}}'),
     "policies.vllm is not an object of metrics"),
    (lambda d: (d / "summary.json").write_text('{"scenario": {}, "policies": {"vllm": {"request_throughput": "x"}}}'),
     "policies.vllm.request_throughput = 'x', expected a number or null"),
    # (each drawn without a word: a page of no model on no GPU; a policy with no requests)
    (lambda d: _edit_json(d / "summary.json", lambda s: s.update(scenario={})),
     "'scenario' lacks name, model, gpu, policies"),
    (lambda d: _edit_json(d / "summary.json", lambda s: s["policies"].update(ghost=s["policies"]["vllm"])),
     "requests.parquet has no rows of ghost"),
    (lambda d: _edit_json(d / "summary.json", lambda s: s.update(decomposition="x")),  # (an AttributeError)
     "summary.json: 'decomposition' is 'x'; expected an object"),
    (lambda d: (d / "summary.json").write_text('{"scenario": 3, "policies": {}}'), "'scenario' is not an object"),
    (lambda d: (d / "summary.json").write_text('{"scen'), "cannot read"),
    (lambda d: (d / "summary.json").write_bytes(b"\xff\xfe\x00"), "cannot read"),
    (lambda d: (d / "requests.parquet").write_text("not parquet"), "requests.parquet: cannot read"),
    (lambda d: _drop_column(d, "timeline.parquet", "bin_s"), "not as sim run writes them"),
    (lambda d: (d / "timeline.parquet").unlink(), "incomplete run, missing timeline.parquet"),
    # (drawn without the address space, without a word)
    (lambda d: (d / "kv_snapshots.parquet").unlink(), "incomplete run, kv_snapshots.parquet is missing"),
    (lambda d: _keep_rows(d, "kv_snapshots.parquet", "policy", "other"), "kv_snapshots.parquet has no rows of vllm"),
])
def test_report_from_crafted_results(finished_run, tmp_path, edit, message):
    d = _crafted(finished_run, tmp_path, edit)
    r = invoke("report", d)
    assert r.exit_code == 2 and message in r.output.replace("\n", "")


def test_a_long_name_makes_a_folder_name_that_fits(tmp_path, monkeypatch):
    """runs/<name> from a name of 130 accented letters (260 bytes: more than a file name may hold) is cut to
    100 bytes ending in a hash of the whole name, so names alike at the start get folders of their own."""
    from sim.run import SLUG_BYTES, slug

    long_a, long_b = "é" * 130, "é" * 129 + "e"
    assert len(slug(long_a).encode()) <= SLUG_BYTES and slug(long_a) != slug(long_b)
    assert slug(long_a).startswith("é" * 40) and slug("quickstart") == "quickstart" and slug("[/x]") == "x"
    assert len(slug("漢" * 300, "sweep").encode()) <= SLUG_BYTES
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(SCENARIO.replace("name: out", f"name: {long_a}"))
    r = invoke("run", "s.yaml", "--no-report")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / slug(long_a) / "summary.json").is_file()


@pytest.mark.parametrize("command, mark, content, other", [
    ("run", "sweep.json", '{"name": "another"}', "sweep` of another name"),
    ("sweep", "summary.json", '{"scenario": {"name": "another"}}', "run` of another name"),
    ("sweep", "plan.json", "{}", "plan`"), ("run", "plan.json", "{}", "plan`"),
    ("run", "validation.json", "{}", "validate`")])
def test_a_folder_of_another_commands_results_is_refused(tmp_path, command, mark, content, other):
    """A plan written over a run's (or a sweep's) folder left those files beside it, and `sim report` drew the
    stale result as the new one; so did a run into another scenario's sweep folder. Refused before anything runs."""
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "w.yaml").write_text("name: w\nbase: s.yaml\naxes: {seed: [0]}\n")
    d = tmp_path / "d"
    d.mkdir()
    (d / mark).write_text(content)
    r = invoke(command, tmp_path / ("s.yaml" if command == "run" else "w.yaml"), "--out", d, "--no-report")
    assert r.exit_code == 2, r.output
    assert f"{d}: holds the results of a `sim {other} ({mark})" in r.output.replace("\n", "")
    assert sorted(p.name for p in d.iterdir()) == [mark]  # nothing run, nothing written


def test_a_run_and_a_sweep_of_one_name_share_a_folder(tmp_path, monkeypatch):
    """A paper setup's scenario and its sweep have one name, so one default folder, whose page draws both
    (reports: a run folder with a sweep table beside its results); any other kind there is refused, and the
    message says the folder was the default one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "w.yaml").write_text("name: out\nbase: s.yaml\naxes: {seed: [0]}\n")
    assert invoke("sweep", "w.yaml", "--no-report", "-j", "1").exit_code == 0
    assert invoke("run", "s.yaml", "--no-report").exit_code == 0
    assert {"sweep.json", "summary.json"} <= {p.name for p in (tmp_path / "runs" / "out").iterdir()}
    (tmp_path / "p.yaml").write_text("name: out\nbase: s.yaml\nrates: [1]\nslo: {mean_tpot_ms: 1000}\n"
                                     "gpus: [a100-40gb]\nreplicas: {min: 1, max: 1}\n")
    r = invoke("plan", "p.yaml", "--no-report")
    assert r.exit_code == 2 and "runs/out (the default folder of this name): holds the results of a `sim" in \
        r.output.replace("\n", ""), r.output


@pytest.mark.parametrize("kind", ["run", "sweep"])
def test_two_names_that_make_one_default_folder_do_not_replace_each_other(tmp_path, monkeypatch, kind):
    """"x/y" and "x y" both make runs/x-y: the second run replaced the first without a word (a fuzzing
    helper's find). The same name runs again there as before; another name, or any name with --out, is refused
    or written as asked."""
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(("x/y", "x y")):
        (tmp_path / f"s{i}.yaml").write_text(SCENARIO.replace("name: out", f"name: {name}"))
        (tmp_path / f"w{i}.yaml").write_text(f"name: {name}\nbase: s{i}.yaml\naxes: {{seed: [0]}}\n")
    args = ("--no-report",) if kind == "run" else ("--no-report", "-j", "1")
    first = "s0.yaml" if kind == "run" else "w0.yaml"
    assert invoke(kind, first, *args).exit_code == 0
    assert invoke(kind, first, *args).exit_code == 0  # the same name again: rewritten (a run) or resumed
    r = invoke(kind, first.replace("0", "1"), *args)
    assert r.exit_code == 2, r.output
    assert "runs/x-y (the default folder of this name): holds the results of 'x/y', another name that makes the " \
        "same folder name; writing 'x y''s there would replace them" in r.output.replace("\n", "")
    assert invoke(kind, first.replace("0", "1"), *args, "--out", tmp_path / "runs" / "x-y").exit_code == 0  # as asked


def test_a_validation_folder_names_its_scenario_too(tmp_path):
    """validation.json keeps the scenario's name as a string: the check read a "name" key and never fired."""
    from sim.config import ScenarioError
    from sim.outputs import claim

    (tmp_path / "validation.json").write_text('{"scenario": "x/y"}')
    assert claim(tmp_path, "validate", "x/y", default=True) == tmp_path
    with pytest.raises(ScenarioError, match="holds the results of 'x/y', another name"):
        claim(tmp_path, "validate", "x y", default=True)


def test_a_fleet_folder_without_its_replicas_table_is_incomplete(tmp_path):
    """A fleet's page was drawn without its per-replica rows, saying nothing."""
    s = tmp_path / "s.yaml"
    s.write_text(SCENARIO + "cluster: {replicas: 2, router: least-outstanding}\n")
    assert invoke("run", s, "--out", tmp_path / "run", "--no-report").exit_code == 0
    (tmp_path / "run" / "replicas.parquet").unlink()
    r = invoke("report", tmp_path / "run")
    assert r.exit_code == 2 and "incomplete run, replicas.parquet is missing" in r.output.replace("\n", ""), r.output


def test_a_sweep_folder_with_text_metrics_or_no_facts_is_refused(tmp_path):
    from tables import sweep_table

    from reports import ResultsError
    from reports.results import load_run

    d = tmp_path / "sweep"
    d.mkdir()
    sweep_table().assign(request_throughput="x").to_parquet(d / "sweep.parquet")
    with pytest.raises(ResultsError, match="column 'request_throughput' holds .* values; expected numbers"):
        load_run(d)
    sweep_table().to_parquet(d / "sweep.parquet")
    (d / "sweep.json").write_text("[]")
    with pytest.raises(ResultsError, match="sweep.json: not an object"):
        load_run(d)
    (d / "sweep.json").write_text('{"axes": "x"}')  # (an AttributeError, said to be "sim run"'s files)
    with pytest.raises(ResultsError, match="sweep.json: 'axes' is 'x'; expected a list of objects"):
        load_run(d)
    (d / "sweep.json").unlink()
    assert len(load_run(d).sweep) == len(sweep_table())
