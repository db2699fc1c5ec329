"""Bad sweep files: each mistake is one line naming the file, the line and the key, exit code 2, before
anything runs."""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from cli import app

runner = CliRunner()

BASE = """\
name: bad
base:
  name: tiny
  model: opt-13b
  gpu: a100-40gb
  workload: {arrival: {kind: poisson, rate: 2.0}, lengths: alpaca, num_requests: 20}
  policies: [orca-oracle, vllm]
"""


def sweep_error(tmp_path, body: str, *args: str, base: str = BASE) -> str:
    """Run `sim sweep` on a file with ``body`` after the base; assert it stops as a user error; its message."""
    p = tmp_path / "s.yaml"
    p.write_text(base + textwrap.dedent(body))
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out"), "-j", "1", *args])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()  # nothing ran
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert lines and all(line.startswith(f"error: {p}") for line in lines), r.output
    return "\n".join(lines)


def test_an_axis_naming_no_field(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  workload.arival.rate: [1, 2]\n")
    assert ":9: axes.workload.arival.rate: no field 'arival' in workload (did you mean 'arrival'?)" in msg


def test_a_policy_axis_naming_no_field(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  policies.*.blok_size: [16]\n")
    assert ":9: axes.policies.*.blok_size: no field 'blok_size' in policy (did you mean 'block_size'?)" in msg


def test_an_axis_past_a_value(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  workload.lengths.mean: [1]\n")
    assert "axes.workload.lengths.mean: workload.lengths is a value, not a mapping" in msg


def test_an_empty_axis(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  seed: [0]\n  block_size: []\n")
    assert ":10: axes.block_size: empty axis: give at least one value" in msg


def test_an_axis_that_is_not_a_list(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  block_size: 16\n")
    assert "axes.block_size: expected a list of values (got 16)" in msg


def test_zipped_axes_of_different_lengths(tmp_path):
    msg = sweep_error(tmp_path, "zip:\n  - {block_size: [8, 16, 32], preemption: [swap, recompute]}\n")
    assert ":9: zip[0]: zipped axes differ in length (block_size: 3, preemption: 2)" in msg


def test_one_field_swept_twice(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  block_size: [8]\n  policies.*.block_size: [16]\n")
    assert "axes.policies.*.block_size: sets the same field as axes.block_size" in msg


def test_a_mapping_and_a_field_inside_it(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  workload.arrival: [{kind: poisson, rate: 1}]\n  workload.arrival.rate: [2]\n")
    assert "axes.workload.arrival.rate: sets the same field as axes.workload.arrival" in msg


def test_a_value_the_field_does_not_take(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  block_size: [16, 0]\n")
    assert msg.splitlines() == [f"error: {tmp_path / 's.yaml'}: point block_size=0: policies[{i}].block_size: Input "
                                "should be greater than 0 (got 0)" for i in (0, 1)]  # one line per problem


def test_a_policy_field_a_policy_does_not_have(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  allocator.reserve: [pow2]\n")  # vllm's allocator is paged
    assert "point allocator.reserve=pow2: policies[1].allocator.reserve: unknown key" in msg


def test_a_policy_named_that_does_not_exist(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  policies.orca.block_size: [8]\n")
    assert "axes.policies.orca.block_size: no policy named 'orca' in the base scenario (it has orca-oracle, vllm)" \
        in msg


def test_an_unknown_slo_metric(tmp_path):
    msg = sweep_error(tmp_path, "capacity: {slo: {p99_ttft: 500}, min: 1, max: 8, tolerance: 0.5}\n")
    assert ":8: capacity.slo: unknown metric 'p99_ttft' (did you mean 'p99_ttft_ms'?)" in msg


def test_a_capacity_range_upside_down(tmp_path):
    msg = sweep_error(tmp_path, "capacity: {slo: {p99_ttft_ms: 500}, min: 8, max: 1, tolerance: 0.5}\n")
    assert "capacity: max (1) must be above min (8)" in msg


def test_a_capacity_search_with_two_tolerances(tmp_path):
    msg = sweep_error(tmp_path, "capacity: {slo: {p99_ttft_ms: 500}, min: 1, max: 8, tolerance: 0.5, "
                                "relative_tolerance: 0.1}\n")
    assert "capacity: give one of 'tolerance' (in the axis's units) and 'relative_tolerance' (a fraction)" in msg


def test_a_capacity_axis_zipped_with_another(tmp_path):
    msg = sweep_error(tmp_path, "zip: {workload.arrival.rate: [1, 2], seed: [0, 1]}\n"
                                "capacity: {slo: {p99_ttft_ms: 500}, min: 1, max: 8, tolerance: 0.5}\n")
    assert "capacity.axis: workload.arrival.rate is zipped with other axes" in msg


def test_an_unknown_sweep_key(tmp_path):
    msg = sweep_error(tmp_path, "axis:\n  seed: [0, 1]\n")
    assert ":8: axis: unknown key" in msg


def test_a_missing_base_file(tmp_path):
    msg = sweep_error(tmp_path, "", base="base: nowhere.yaml\n")
    assert f":1: base: {tmp_path / 'nowhere.yaml'}: no such scenario file" in msg


def test_a_bad_base_scenario_names_its_line(tmp_path):
    msg = sweep_error(tmp_path, "axes: {seed: [0]}\n", base=BASE.replace("gpu: a100-40gb", "gpu: a100"))
    assert ":2: base: unknown gpu 'a100'; expected one of a100-40gb" in msg
    bad_key = sweep_error(tmp_path, "axes: {seed: [0]}\n", base=BASE.replace("lengths: alpaca", "lenghts: alpaca"))
    assert ":6: base.workload.lenghts: unknown key" in bad_key


def test_a_bad_base_scenario_file_names_its_own_line(tmp_path):
    (tmp_path / "b.yaml").write_text("\n".join(line[2:] for line in BASE.splitlines()[2:]).replace("a100-40gb", "a100"))
    p = tmp_path / "s.yaml"
    p.write_text("base: b.yaml\naxes: {seed: [0]}\n")
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and f"error: {tmp_path / 'b.yaml'}: (top level): unknown gpu 'a100'" in r.output, r.output


@pytest.mark.parametrize("args, expect", [(["--executor", "slurm"], "--executor 'slurm': expected one of local, ray"),
                                          (["--workers", "0"], "--workers must be at least 1")])
def test_bad_options(tmp_path, args, expect):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "axes: {seed: [0]}\n")
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and expect in r.output, r.output
