"""Sweeps: axes to points, the tidy table against direct runs, resume, failing points, capacity search,
and the sweep report."""

from __future__ import annotations

import json
import re
import textwrap

import numpy as np
import pandas as pd
import pytest
from sweeps import base_yaml
from typer.testing import CliRunner

from cli import app
from kvsim import sweep_to_dir
from sim import run
from sim.config import ScenarioError, parse_scenario
from sim.executors import SerialExecutor
from sim.schema import varying_axes
from sim.sweep.capacity import next_probe
from sim.sweep.output import run_sweep
from sim.sweep.spec import CapacityConfig, load_sweep
from sim.sweep.tasks import make_task, resolved_mapping

runner = CliRunner()

BASE = base_yaml("[orca-oracle, {preset: vllm, name: paged}]", seed=3)


def sweep_file(tmp_path, body: str, base: str = BASE, name: str = "s.yaml"):
    p = tmp_path / name
    p.write_text(base + textwrap.dedent(body))
    return p


# ------------------------------------------------------------------------------------------- axes and points


def test_axes_cross_and_zip_in_file_order(tmp_path):
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          workload.arrival.rate: [1, 2, 3]
          seed: [0, 1]
        zip:
          block_size: [8, 32]
          preemption: [swap, recompute]
        """))
    assert len(s.points) == 3 * 2 * 2
    assert s.points[0].values == {"workload.arrival.rate": 1, "seed": 0, "block_size": 8, "preemption": "swap"}
    assert s.points[-1].values == {"workload.arrival.rate": 3, "seed": 1, "block_size": 32, "preemption": "recompute"}
    last = s.points[-1].scenario
    assert last.workload.arrival.rate == 3 and last.workload.seed == 1
    assert [(p.block_size, p.preemption) for p in last.policies] == [(32, "recompute"), (32, "recompute")]


def test_policy_fields_reach_every_policy_or_the_named_one(tmp_path):
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          policies.*.max_num_seqs: [7]
          policies.paged.block_size: [64]
          policies.orca-max.allocator.placement: [first-fit]
          swap_space_gib: [2]
        """, base=base_yaml("[orca-oracle, orca-max, {preset: vllm, name: paged}]", seed=3)))
    pols = s.points[0].scenario.policies
    assert [p.max_num_seqs for p in pols] == [7, 7, 7] and [p.swap_space_gib for p in pols] == [2, 2, 2]
    assert [p.block_size for p in pols] == [16, 16, 64]
    assert [p.allocator.placement for p in pols[:2]] == ["buddy", "first-fit"]


def test_policies_axis_chooses_which_policies_run(tmp_path):
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          policies: [vllm, [orca-max, {preset: vllm, name: v32, block_size: 32}]]
        """))
    assert [[p.name for p in pt.scenario.policies] for pt in s.points] == [["vllm"], ["orca-max", "v32"]]
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          block_size: [8]
          policies: [[vllm, orca-max]]
        """))  # the policies are chosen first, then the policy field applies to them
    assert [(p.name, p.block_size) for p in s.points[0].scenario.policies] == [("vllm", 8), ("orca-max", 8)]
    t = run_sweep(s, tmp_path / "out", SerialExecutor()).table
    assert list(t["policies"]) == ['["vllm", "orca-max"]'] * 2
    assert varying_axes(t) == []  # one value: not an axis that varies


def test_a_policies_axis_is_a_column_that_tells_apart_policies_of_one_name(tmp_path):
    """The same preset under two values of a policies axis: both rows are policy `vllm`; the `policies`
    column says which is which (it had no column: the two rows read as one policy run twice), and the
    report's axes keep it only where `policy` alone does not tell the rows apart."""
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          policies: [vllm, {preset: vllm, block_size: 32}]
        """))
    t = run_sweep(s, tmp_path / "out", SerialExecutor()).table
    assert list(t["policy"]) == ["vllm", "vllm"]
    assert list(t["policies"]) == ["vllm", '{"block_size": 32, "preset": "vllm"}']
    assert t["mean_normalized_latency_s"].nunique() == 2
    assert varying_axes(t) == ["policies"]
    named = t.assign(policy=["vllm", "v32"])  # each policy under one value: `policy` says it all
    assert varying_axes(named) == []


def test_a_sweep_of_policies_alone_writes_its_report(tmp_path):
    """No axis varies but the policies: the latency-vs-rate figure has nothing to draw against (it raised
    KeyError 'workload.arrival.rate' in the report, after the tables were written)."""
    path = sweep_file(tmp_path, """\
        axes:
          policies: [vllm, [orca-max]]
        """)
    r = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"), "-j", "1"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "report.html").exists() and "Traceback" not in r.output


def test_a_sweep_too_large_to_run_is_refused_before_its_points_are_built(tmp_path):
    from sim.config import ScenarioError

    rates = ", ".join(str(r) for r in range(1, 101))
    path = sweep_file(tmp_path, f"""\
        axes:
          workload.arrival.rate: [{rates}]
          seed: [{rates}]
          block_size: [8, 16]
        """)
    with pytest.raises(ScenarioError, match="20,000 points .*: at most 10,000 in one sweep"):
        load_sweep(path)


def test_a_capacity_search_is_over_a_rate(tmp_path):
    from sim.config import ScenarioError

    path = sweep_file(tmp_path, """\
        axes: {seed: [0]}
        capacity: {axis: workload.seed, slo: {p99_ttft_ms: 5}, min: 1, max: 100, relative_tolerance: 0.1}
        """)
    with pytest.raises(ScenarioError, match="capacity.axis: workload.seed is not a request rate"):
        load_sweep(path)


def test_inline_base_or_a_scenario_file_give_the_same_points(tmp_path):
    (tmp_path / "base.yaml").write_text("".join(line[2:] + "\n" for line in BASE.splitlines()[1:]))
    a = load_sweep(sweep_file(tmp_path, "axes: {seed: [0, 1]}\n", name="a.yaml"))
    b = load_sweep(sweep_file(tmp_path, "axes: {seed: [0, 1]}\n", base="base: base.yaml\n", name="b.yaml"))
    assert [make_task(p.scenario, 0).key for p in a.points] == [make_task(p.scenario, 0).key for p in b.points]
    assert a.name == "a" and b.base_source == str(tmp_path / "base.yaml")


def test_an_inline_base_without_a_name_takes_the_sweeps(tmp_path):
    """As a plan's inline base does (the README shows both without one)."""
    body = "".join(line + "\n" for line in BASE.splitlines() if not line.strip().startswith("name:"))
    s = load_sweep(sweep_file(tmp_path, "axes: {seed: [0, 1]}\n", base=body, name="unnamed.yaml"))
    assert s.name == "unnamed" and s.base["name"] == "unnamed" and len(s.points) == 2


def test_task_key_is_the_resolved_scenario(make_scenario):
    s = make_scenario()
    key = make_task(s, 0).key
    assert make_task(make_scenario(name="other", description="words"), 0).key == key  # names change nothing
    assert make_task(s, 1).key != key
    faster = make_scenario(workload={"arrival": {"kind": "poisson", "rate": 4.5}, "lengths": "sharegpt",
                                     "num_requests": 200, "seed": 1})
    assert make_task(faster, 0).key != key


def test_resolved_mapping_parses_back_to_the_same_scenario(make_scenario, tmp_path):
    s = make_scenario(gpu={"name": "x", "memory_gib": 40, "hbm_gb_per_s": 1555, "tflops": 312},
                      step_time={"kind": "roofline", "gpu_overhead_s": 0.003})
    data, files = resolved_mapping(s)
    assert parse_scenario(data).model_dump() == s.model_copy(update={"record_steps": False}).model_dump()
    assert files == []
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n")
    t = parse_scenario({"name": "t", "model": "opt-13b", "gpu": "a100-40gb", "policies": ["vllm"],
                        "workload": {"kind": "trace", "path": "t.csv"}}, base_dir=str(tmp_path))
    data, files = resolved_mapping(t)
    assert data["workload"]["path"] == str(trace.resolve())
    assert files[0][:2] == [str(trace.resolve()), trace.stat().st_size]
    # a same-size rewrite that keeps the file's time is another file: its task gets another key (its stored
    # point was reused, the old trace's results for the new one)
    import os

    st, key = trace.stat(), make_task(t, 0).key
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,6\n")
    os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (trace.stat().st_size, trace.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert make_task(t, 0).key != key


# ------------------------------------------------------------------------------------------- the table


def test_table_rows_are_the_runs_of_each_point(tmp_path):
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          workload.arrival.rate: [1.0, 6.0]
          policies.*.block_size: [8, 32]
        """))
    res = run_sweep(s, tmp_path / "out", SerialExecutor())
    t = res.table
    assert len(t) == 4 * 2 and res.num_runs == 8 and not res.failures
    assert list(t.columns[:4]) == ["workload.arrival.rate", "policies.*.block_size", "seed", "policy"]
    assert {"mean_normalized_latency_s", "p99_scheduling_delay_ms", "memory.token_states", "error"} <= set(t.columns)
    assert t.error.isna().all() and (t.seed == 3).all()
    point = s.points[3]  # rate 6, block size 32
    direct = run(point.scenario)
    rows = t[(t["workload.arrival.rate"] == 6.0) & (t["policies.*.block_size"] == 32)].set_index("policy")
    for name, res_p in direct.policies.items():
        got = rows.loc[name, list(res_p.summary)].to_numpy(dtype=float)
        want = np.array([np.nan if v is None else v for v in res_p.summary.values()], dtype=float)
        np.testing.assert_array_equal(got, want)  # exactly the direct run's figures


def test_resume_skips_finished_runs_and_redoes_missing_ones(tmp_path):
    path = sweep_file(tmp_path, "axes: {workload.arrival.rate: [1.0, 3.0, 9.0]}\n")
    out = tmp_path / "out"
    first = run_sweep(load_sweep(path), out, SerialExecutor())
    assert first.num_runs == 6 and len(list((out / "points").glob("*.json"))) == 6
    again = run_sweep(load_sweep(path), out, SerialExecutor())
    assert again.num_runs == 0 and again.num_reused == 6
    pd.testing.assert_frame_equal(first.table, again.table)
    lost = first.table.point_key[2]
    (out / "points" / f"{lost}.json").unlink()  # as if interrupted before that run finished
    third = run_sweep(load_sweep(path), out, SerialExecutor())
    assert third.num_runs == 1 and third.num_reused == 5
    pd.testing.assert_frame_equal(first.table, third.table)
    fresh = run_sweep(load_sweep(path), out, SerialExecutor(), resume=False)
    assert fresh.num_runs == 6


@pytest.mark.parametrize("damage, why", [
    (lambda d: None, "not a stored run"), (lambda d: [1, 2], "not a stored run"),
    (lambda d: {k: v for k, v in d.items() if k != "policy"}, "no policy name"),
    (lambda d: {**d, "summary": [1]}, "no summary of metrics"),
    (lambda d: {**d, "summary": {}}, "its summary lacks num_requests"),  # (reused: read as a run failing its SLO)
    (lambda d: {**d, "summary": {**d["summary"], "num_finished": -7}}, "summary.num_finished is -7"),
    (lambda d: {**d, "summary": {**d["summary"], "request_throughput": "x"}}, "summary.request_throughput is 'x'"),
    (lambda d: {**d, "workload": 3}, "its workload is not an object"),
    (lambda d: {**d, "key": "other"}, "holds the run of another task"),
])
def test_a_damaged_stored_run_runs_again_and_says_so(tmp_path, damage, why):
    """A stored point that reads as JSON but not as a run wrote it: a traceback (null, a list, no policy), an
    Arrow error writing the table, or reused as it was (an empty summary moved a capacity and a plan's winner)."""
    import json

    from sim.sweep.drive import Progress

    class Notes(Progress):
        lines: list[str] = []

        def note(self, line):
            self.lines.append(line)

    path = sweep_file(tmp_path, "axes: {workload.arrival.rate: [1.0]}\n")
    out = tmp_path / "out"
    first = run_sweep(load_sweep(path), out, SerialExecutor())
    point = out / "points" / f"{first.table.point_key[0]}.json"
    point.write_text(json.dumps(damage(json.loads(point.read_text()))))
    notes = Notes()
    again = run_sweep(load_sweep(path), out, SerialExecutor(), progress=notes)
    assert again.num_runs == 1 and again.num_reused == 1
    pd.testing.assert_frame_equal(first.table, again.table)
    assert notes.lines == [f"{point}: {notes.lines[0].split(': ', 1)[1]}"] and why in notes.lines[0]
    assert notes.lines[0].endswith("; running it again")


def test_a_run_stored_by_other_code_is_not_reused(tmp_path, monkeypatch):
    """A stored run is keyed by the code that decides results too (sim/ and traces/): after an engine change
    (or a new summary metric) a rerun into the old folder runs again instead of reusing a stale result."""
    import sim.sweep.tasks as tasks

    path = sweep_file(tmp_path, "axes: {workload.arrival.rate: [1.0]}\n")
    out = tmp_path / "out"
    assert run_sweep(load_sweep(path), out, SerialExecutor()).num_runs == 2
    monkeypatch.setattr(tasks, "_kvsim_version", lambda: "0.1.0+another")
    assert run_sweep(load_sweep(path), out, SerialExecutor()).num_runs == 2
    # the digest reads every source file: one byte changed anywhere changes it
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    before = tasks.code_digest(pkg)
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert tasks.code_digest(pkg) != before and tasks.code_digest(pkg) == tasks.code_digest(pkg)


def test_a_sweep_reads_its_step_time_profile_and_model_folder_wherever_it_runs(tmp_path, monkeypatch):
    """A calibration profile and a model folder given relative to the sweep file: the runs failed (workers
    parse from "/", and neither path was made absolute), and a recalibrated profile reused the stale run (its
    file was not stamped in the run's key)."""
    import shutil
    from pathlib import Path

    from test_gpu_profile import write_profile

    write_profile(tmp_path / "p.json")
    (tmp_path / "m").mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "gpu" / "configs" / "tiny-llama.json", tmp_path / "m" / "config.json")
    (tmp_path / "s.yaml").write_text(
        "base:\n  name: tiny\n  model: opt-13b\n  gpu: a100-40gb\n"
        "  workload: {arrival: {kind: poisson, rate: 2.0}, lengths: alpaca, num_requests: 20, seed: 1}\n"
        "  policies: [vllm]\n  step_time: {kind: profile, path: p.json}\naxes: {workload.arrival.rate: [1.0]}\n")
    monkeypatch.chdir(tmp_path.parent)  # nowhere near the files
    first = run_sweep(load_sweep(tmp_path / "s.yaml"), tmp_path / "out", SerialExecutor())
    assert first.num_runs == 1 and first.table.error.isna().all(), first.table.error.tolist()
    write_profile(tmp_path / "p.json", paged_scale=3.0)  # recalibrated: another size or date
    again = run_sweep(load_sweep(tmp_path / "s.yaml"), tmp_path / "out", SerialExecutor())
    assert again.num_runs == 1 and again.table.mean_tpot_ms[0] > first.table.mean_tpot_ms[0]
    # a model folder (its config.json), relative to the sweep file
    (tmp_path / "t.yaml").write_text(
        "base:\n  name: tiny\n  model: ./m\n  gpu: {name: dev, memory_gib: 2, hbm_gb_per_s: 50, tflops: 1}\n"
        "  runtime_overhead_gib: 0\n"
        "  workload: {arrival: {kind: poisson, rate: 2.0}, lengths: alpaca, num_requests: 20, seed: 1}\n"
        "  policies: [vllm]\naxes: {workload.arrival.rate: [1.0]}\n")
    r = run_sweep(load_sweep(tmp_path / "t.yaml"), tmp_path / "out2", SerialExecutor())
    assert r.num_runs == 1 and r.table.error.isna().all(), r.table.error.tolist()


def test_a_failing_point_is_reported_and_the_others_kept(tmp_path):
    path = sweep_file(tmp_path, "axes: {gpu: [a100-40gb, l4, a100-80gb]}\n")  # OPT-13B's 26 GB do not fit an L4
    r = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"), "-j", "1", "--no-report"])
    assert r.exit_code == 1, r.output
    t = pd.read_parquet(tmp_path / "out" / "sweep.parquet")
    failed = t[t.gpu == "l4"]
    assert len(failed) == 2 and failed.error.str.contains("l4|does not fit|weights", regex=True).all(), failed.error
    assert failed.mean_normalized_latency_s.isna().all()
    ok = t[t.gpu != "l4"]
    assert ok.error.isna().all() and (ok.num_finished == 60).all()
    assert "failed: orca-oracle at gpu=l4" in r.output
    info = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert len(info["failures"]) == 2
    assert len(list((tmp_path / "out" / "points").glob("*.json"))) == 4  # failures are not stored: retried next time


# ------------------------------------------------------------------------------------------- capacity search


def cap(**over) -> CapacityConfig:
    return CapacityConfig(**{"slo": {"mean_normalized_latency_s": 0.2}, "min": 0.1, "max": 10, "tolerance": 0.1,
                             **over})


def search(true_capacity: float, c: CapacityConfig, tried: dict | None = None) -> dict[float, bool]:
    """Drive next_probe against a monotone oracle: values up to ``true_capacity`` pass."""
    tried = dict(tried or {})
    for _ in range(100):
        v = next_probe(tried, c)
        if v is None:
            return tried
        tried[v] = v <= true_capacity
    raise AssertionError("the search did not end")


@pytest.mark.parametrize("true_capacity", [0.137, 1.0, 2.71828, 9.95])
def test_bisection_brackets_the_capacity_to_the_tolerance(true_capacity):
    c = cap()
    tried = search(true_capacity, c)
    lo = max(v for v, ok in tried.items() if ok)
    hi = min(v for v, ok in tried.items() if not ok)
    assert lo <= true_capacity < hi and hi - lo <= c.tolerance
    climb = list(tried)[:list(tried.values()).index(False) + 1]
    assert climb == [min(0.1 * 2**k, 10) for k in range(len(climb))]  # from min, doubling


def test_relative_tolerance_stops_within_a_share_of_the_rate():
    c = cap(tolerance=None, relative_tolerance=0.02)
    for true_capacity in (0.3, 7.0):
        tried = search(true_capacity, c)
        lo = max(v for v, ok in tried.items() if ok)
        hi = min(v for v, ok in tried.items() if not ok)
        assert lo <= true_capacity < hi and hi - lo <= 0.02 * lo


def test_search_ends_at_the_range_ends():
    c = cap(start=2.0)
    assert search(0.01, c) == {2.0: False, 1.0: False, 0.5: False, 0.25: False, 0.125: False, 0.1: False}
    assert search(50, c) == {2.0: True, 4.0: True, 8.0: True, 10.0: True}
    grid = {0.5: True, 1.0: True, 1.5: False, 3.0: False}  # the sweep's own runs bracket it: bisect at once
    assert next_probe(grid, c) == 1.25


def test_a_search_whose_runs_pass_above_a_failure_is_flagged_not_monotone(tmp_path):
    """A throughput floor is met more easily at higher rates: the search (which assumes the opposite) said
    'none' while its own runs at 10 and 40 req/s passed."""
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          workload.arrival.rate: [1.0, 10.0, 40.0]
        capacity:
          slo: {request_throughput: {min: 5}}
          min: 1
          max: 40
          relative_tolerance: 0.1
        """, base=base_yaml("[vllm]", "alpaca", 60, seed=3)))
    res = run_sweep(s, tmp_path / "out", SerialExecutor())
    row = res.capacity.iloc[0]
    runs = res.capacity_runs
    assert not runs[runs.value == 1.0].met.any() and runs[runs.value == 40.0].met.all()
    assert row.status == "not monotone"


def test_capacity_search_on_real_runs_reuses_the_grid(tmp_path):
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          workload.arrival.rate: [1.0, 6.0]
        capacity:
          slo: {p99_scheduling_delay_ms: 2000}
          min: 0.5
          max: 16
          tolerance: 0.25
        """, base=base_yaml("[orca-oracle, {preset: vllm, name: paged}]", "sharegpt", 150, seed=3)))
    res = run_sweep(s, tmp_path / "out", SerialExecutor())
    c, runs = res.capacity.set_index("policy"), res.capacity_runs
    for policy, row in c.iterrows():
        assert row.status == "found" and row.met and row.slo == "p99_scheduling_delay_ms <= 2000"
        assert row.lowest_failing_rate - row.sustainable_request_rate <= 0.25
        mine = runs[runs.policy == policy].set_index("value")
        assert mine.loc[row.sustainable_request_rate, "p99_scheduling_delay_ms"] <= 2000
        assert mine.loc[row.lowest_failing_rate, "p99_scheduling_delay_ms"] > 2000
        assert {1.0, 6.0} <= set(mine.index) and row.num_runs == len(mine)
    grid_keys = set(res.table.point_key)
    assert grid_keys <= set(runs.point_key)  # the grid's runs were judged, not run again
    assert res.num_runs == len(set(runs.point_key))
    # every column the tables write is declared (sim.schema): a result column missing from the declared ones was
    # drawn as a swept axis (varying_axes), and one missing from the types written as whatever pandas guessed
    from sim.schema import RESULT_COLUMN_TYPES, is_result_column

    for table in (res.table, res.capacity, runs):
        undeclared = [c for c in table.columns if c not in ("workload.arrival.rate", "seed")
                      and not (is_result_column(c) and c in RESULT_COLUMN_TYPES)]
        assert not undeclared, undeclared


def test_an_slo_no_rate_meets_is_none_with_the_lowest_rate_tried(tmp_path):
    path = sweep_file(tmp_path, """\
        capacity:
          slo: {mean_tpot_ms: 1}
          min: 0.5
          max: 8
          start: 2
          tolerance: 0.1
        """)
    r = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"), "-j", "1", "--no-report"])
    assert r.exit_code == 0, r.output
    c = pd.read_parquet(tmp_path / "out" / "capacity.parquet")
    assert (c.status == "none").all() and c.sustainable_request_rate.isna().all() and not c.met.any()
    assert (c.lowest_rate_tried == 0.5).all() and (c.highest_rate_tried == 2).all() and (c.num_runs == 3).all()
    assert "none" in r.output


# ------------------------------------------------------------------------------------------- the report


def test_sweep_folder_report_has_rate_block_size_and_capacity(tmp_path):
    path = sweep_file(tmp_path, """\
        axes:
          workload.arrival.rate: [2.0, 8.0]
          block_size: [8, 64]
          preemption: [recompute, swap]
        capacity:
          slo: {mean_normalized_latency_s: 0.5}
          min: 1
          max: 64
          tolerance: 4
        """, base=base_yaml("[orca-oracle, {preset: vllm, name: paged}]", num_requests=40, seed=3))
    result, paths = sweep_to_dir(path, tmp_path / "out", workers=1)
    page = paths["report"].read_text()
    for title in ("Mean normalized latency vs request rate", "Mean normalized latency vs block size",
                  "Sustainable request rate per policy"):
        assert title in page
    assert "p99_" not in page.split("<h2>Sweep</h2>")[0]
    assert "mean_normalized_latency_s &lt;= 0.5" in page and "lowest failing" in page
    assert (tmp_path / "out" / "sweep.csv").read_text().startswith("workload.arrival.rate,block_size,preemption,seed,")
    # every column is a swept field, the seed, or a result declared in sim.schema (the report tells axes so)
    from sim.schema import is_result_column

    axes = {a.column for a in result.sweep.axes} | {"seed"}
    for table in (result.table, result.capacity, result.capacity_runs):
        assert [c for c in table.columns if c not in axes and not is_result_column(c)] == []


# ------------------------------------------------------------------------------------------- one metric schema


def test_every_declared_metric_is_an_slo_key_and_a_sweep_column(tmp_path):
    """Iterate the schema: each metric of ``sim.schema.METRICS`` bounds an SLO and is a column of
    sweep.parquet; a sharing sweep's sharing metrics arrive there with the summary's values."""
    from sim.schema import METRICS

    for name in METRICS:
        assert CapacityConfig(slo={name: 1.0}, min=0.5, max=2, tolerance=0.1).slo[name].max == 1.0
    shared = base_yaml("[orca-oracle, {preset: vllm, name: paged, prefix_caching: true}]", num_requests=24,
                       seed=1) + "  sampling: {kind: parallel, n: 2}\n"
    result = run_sweep(load_sweep(sweep_file(tmp_path, "axes:\n  workload.arrival.rate: [4]\n", base=shared)),
                       tmp_path / "out", SerialExecutor())
    table = result.table
    assert set(METRICS) <= set(table.columns)
    direct = run(load_sweep(sweep_file(tmp_path, "axes:\n  workload.arrival.rate: [4]\n", base=shared,
                                       name="t.yaml")).points[0].scenario)
    for policy, res in direct.policies.items():
        row = table[table.policy == policy].iloc[0]
        sharing = [m for m in ("memory_saved_by_sharing", "prefix_hit_rate_tokens", "num_cow_copies",
                               "num_slab_copies") if m in res.summary]
        assert sharing, policy
        for m in sharing:
            assert row[m] == pytest.approx(res.summary[m]), (policy, m)


def test_result_tables_have_one_schema_whatever_their_rows_hold(tmp_path):
    """sweep.parquet and capacity.parquet of two sweeps of different content (one with no sharing metric
    at all, one whose policy shares blocks; one whose point fails) have the same Arrow type in every
    column they share: a metric no row has is float64 (or int64 for a count) of nulls, never Arrow's
    ``null``; ``error`` is a string. So the two read as one dataset, and concatenate as floats."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    capacity = "capacity: {slo: {mean_normalized_latency_s: 1.0}, min: 1, max: 8, relative_tolerance: 0.5}\n"
    a = sweep_file(tmp_path, "axes: {seed: [0]}\n" + capacity, base=base_yaml("[orca-oracle]", num_requests=12),
                   name="a.yaml")
    b = sweep_file(tmp_path, "axes: {seed: [0], gpu: [a100-40gb, l4]}\n" + capacity,  # l4: does not fit
                   base=base_yaml("[{preset: vllm, name: paged, prefix_caching: true}]", num_requests=12),
                   name="b.yaml")
    for f in (a, b):
        sweep_to_dir(f, tmp_path / f.stem, workers=1)
    for table in ("sweep", "capacity"):
        sa, sb = (pq.read_schema(tmp_path / d / f"{table}.parquet") for d in "ab")
        differ = {n: (sa.field(n).type, sb.field(n).type) for n in set(sa.names) & set(sb.names)
                  if sa.field(n).type != sb.field(n).type}
        assert not differ, (table, differ)
        assert "null" not in {str(sa.field(n).type) for n in sa.names}, (table, sa)
        assert str(sa.field("error").type) == "string"
    sa = pq.read_schema(tmp_path / "a" / "sweep.parquet")
    assert (str(sa.field("prefix_hit_rate_tokens").type), str(sa.field("num_cow_copies").type)) == ("double", "int64")
    both = ds.dataset([str(tmp_path / d / "sweep.parquet") for d in "ab"], format="parquet").to_table()
    assert both.num_rows == 3
    joined = pd.concat([pd.read_parquet(tmp_path / d / "sweep.parquet") for d in "ab"])
    assert joined["prefix_hit_rate_tokens"].dtype == np.float64


def test_an_axis_mixing_a_count_and_replica_groups_is_written_as_text(tmp_path):
    """`cluster.replicas: [3, [{gpu: h100, count: 1}]]`: every run finished, then writing sweep.parquet
    failed (Arrow cannot hold an int and a string in one column); such a column is written as JSON text."""
    f = sweep_file(tmp_path, "axes: {cluster.replicas: [3, [{gpu: a100-40gb, count: 2}]]}\n",
                   base=base_yaml("[vllm]", num_requests=12), name="m.yaml")
    sweep_to_dir(f, tmp_path / "m", workers=1)
    table = pd.read_parquet(tmp_path / "m" / "sweep.parquet")
    assert table["cluster.replicas"].tolist() == ["3", '[{"count": 2, "gpu": "a100-40gb"}]']


@pytest.mark.parametrize("base, kind", [("self.yaml", "sweep"), ("other.yaml", "sweep"), ("plan.yaml", "plan")])
def test_a_base_naming_a_sweep_or_plan_file_says_so(tmp_path, base, kind):
    """It printed one "unknown key" line per key of the file (gpus: did you mean 'gpu'?, ...)."""
    (tmp_path / "self.yaml").write_text(f"name: s\nbase: {base}\naxes: {{seed: [1]}}\n")
    (tmp_path / "other.yaml").write_text("name: o\nbase: x.yaml\naxes: {seed: [1, 2]}\n")
    (tmp_path / "plan.yaml").write_text("name: p\nbase: x.yaml\nrates: [1]\nslo: {mean_tpot_ms: 50}\ngpus: [h100]\n")
    with pytest.raises(ScenarioError, match=re.escape(f"self.yaml:2: base: {tmp_path / base} is a {kind} file, "
                                                      "not a scenario")):
        load_sweep(tmp_path / "self.yaml")


def test_odd_entries_where_stored_runs_belong_are_named(tmp_path):
    """points/ as a file was "points: File exists"; a point's file as a folder failed naming a temporary file."""
    from sim.sweep.drive import PointStore

    path = sweep_file(tmp_path, "axes: {workload.arrival.rate: [1.0]}\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "points").write_text("x")
    with pytest.raises(ScenarioError, match="points: a file where the folder of stored runs belongs"):
        run_sweep(load_sweep(path), out, SerialExecutor())
    (out / "points").unlink()
    (out / "points" / "k.json").mkdir(parents=True)
    with pytest.raises(ScenarioError, match=re.escape(f"{out / 'points' / 'k.json'}: a folder where a stored run belongs")):
        PointStore(out).get("k")


def test_a_failed_capacity_search_names_its_point(tmp_path):
    """The console printed "capacity search for vllm: ..." once per point, the same line each time."""
    s = load_sweep(sweep_file(tmp_path, """\
        axes:
          tensor_parallel: [3]
          block_size: [16, 32]
        capacity:
          slo: {p99_ttft_ms: 5000}
          min: 1
          max: 4
          tolerance: 1
        """, base=base_yaml("[vllm]", "alpaca", 10, seed=3)))
    res = run_sweep(s, tmp_path / "out", SerialExecutor())
    searches = sorted(what for what, _ in res.failures if what.startswith("capacity search"))
    assert searches == ["capacity search for vllm at tensor_parallel=3, block_size=16",
                        "capacity search for vllm at tensor_parallel=3, block_size=32"], searches
