"""Bad sweep files: each mistake is one line naming the file, the line and the key, exit code 2, before
anything runs."""

from __future__ import annotations

import textwrap

import pytest
from sweeps import base_yaml
from typer.testing import CliRunner

from cli import app

runner = CliRunner()

BASE = base_yaml("[orca-oracle, vllm]", num_requests=20, name="bad")


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


CAP = "capacity: {slo: {p99_ttft_ms: 500}, min: 1, max: 8, tolerance: 0.5"  # + "}" or more keys

# One case per bad input: (the sweep file after the base, a part of the one-line message).
BAD_INPUT = {
    "axis naming no field": ("axes:\n  workload.arival.rate: [1, 2]\n",
                             ":9: axes.workload.arival.rate: no field 'arival' in workload (did you mean 'arrival'?)"),
    "policy axis naming no field": ("axes:\n  policies.*.blok_size: [16]\n",
                                    ":9: axes.policies.*.blok_size: no field 'blok_size' in policy "
                                    "(did you mean 'block_size'?)"),
    "axis past a value": ("axes:\n  workload.lengths.mean: [1]\n",
                          "axes.workload.lengths.mean: workload.lengths is a value, not a mapping"),
    "empty axis": ("axes:\n  seed: [0]\n  block_size: []\n",
                   ":10: axes.block_size: empty axis: give at least one value"),
    "axis not a list": ("axes:\n  block_size: 16\n", "axes.block_size: expected a list of values (got 16)"),
    "zipped axes of different lengths": ("zip:\n  - {block_size: [8, 16, 32], preemption: [swap, recompute]}\n",
                                         ":9: zip[0]: zipped axes differ in length (block_size: 3, preemption: 2)"),
    "one field swept twice": ("axes:\n  block_size: [8]\n  policies.*.block_size: [16]\n",
                              "axes.policies.*.block_size: sets the same field as axes.block_size"),
    "a mapping and a field inside it": ("axes:\n  workload.arrival: [{kind: poisson, rate: 1}]\n"
                                        "  workload.arrival.rate: [2]\n",
                                        "axes.workload.arrival.rate: sets the same field as axes.workload.arrival"),
    "a policy field a policy does not have": ("axes:\n  allocator.reserve: [pow2]\n",  # vllm's allocator is paged
                                              "point allocator.reserve=pow2: policies[1].allocator.reserve: "
                                              "unknown key"),
    "a policy named that does not exist": ("axes:\n  policies.orca.block_size: [8]\n",
                                           "axes.policies.orca.block_size: no policy named 'orca' in the base "
                                           "scenario (it has orca-oracle, vllm)"),
    "unknown SLO metric": ("capacity: {slo: {p99_ttft: 500}, min: 1, max: 8, tolerance: 0.5}\n",
                           ":8: capacity.slo: unknown metric 'p99_ttft' (did you mean 'p99_ttft_ms'?)"),
    "capacity range upside down": ("capacity: {slo: {p99_ttft_ms: 500}, min: 8, max: 1, tolerance: 0.5}\n",
                                   "capacity: max (1) must be above min (8)"),
    "two tolerances": (CAP + ", relative_tolerance: 0.1}\n",
                       "capacity: give one of 'tolerance' (in the axis's units) and 'relative_tolerance' (a fraction)"),
    "capacity axis zipped with another": ("zip: {workload.arrival.rate: [1, 2], seed: [0, 1]}\n" + CAP + "}\n",
                                          "capacity.axis: workload.arrival.rate is zipped with other axes"),
    # YAML's true read as 1.0 (the README: numbers are never booleans)
    "capacity min a boolean": ("capacity: {slo: {p99_ttft_ms: 500}, min: true, max: 8, tolerance: 0.5}\n",
                               ":8: capacity.min: expected a number, not true"),
    "capacity tolerance a boolean": ("capacity: {slo: {p99_ttft_ms: 500}, min: 1, max: 8, tolerance: true}\n",
                                     ":8: capacity.tolerance: expected a number, not true"),
    "capacity start a boolean": (CAP + ", start: true}\n", ":8: capacity.start: expected a number, not true"),
    "an SLO bound a boolean": ("capacity: {slo: {p99_ttft_ms: {max: true}}, min: 1, max: 8, tolerance: 0.5}\n",
                               ":8: capacity.slo.p99_ttft_ms.max: expected a number, not true"),
    # each ran twice (a plan refuses a value listed twice)
    "a value listed twice": ("axes:\n  seed: [1, 2, 1]\n", ":9: axes.seed: 1 is listed twice (values 1 and 3); "
                             "give each value once"),
    "a zipped combination listed twice": ("zip:\n  - {seed: [1, 1], block_size: [16, 16]}\n",
                                          ":9: zip[0]: seed=1, block_size=16 is listed twice (values 1 and 2)"),
    "unknown sweep key": ("axis:\n  seed: [0, 1]\n", ":8: axis: unknown key"),
    "a field of every policy and of a named one": (
        "axes:\n  policies.vllm.block_size: [8, 16]\n  block_size: [32]\n",
        "axes.block_size: sets the same field as axes.policies.vllm.block_size"),
    "several routers in one point": ("axes:\n  cluster.router: [round-robin, [least-kv, random]]\n",
                                     "cluster.router: a sweep point runs one router, not least-kv, random; sweep them "
                                     "as an axis"),
}


def test_a_sweep_name_with_a_newline(tmp_path):
    """Printed as it was: a newline split the console's lines (an escape sequence reached the terminal)."""
    msg = sweep_error(tmp_path, "axes:\n  seed: [0]\n", base=BASE.replace("name: bad", 'name: "a\\nb"', 1))
    assert ":1: name: a name holds control characters ('\\n'); expected printable text" in msg, msg


@pytest.mark.parametrize("body, expect", list(BAD_INPUT.values()), ids=list(BAD_INPUT))
def test_bad_input_is_one_line_naming_file_line_and_key(tmp_path, body, expect):
    assert expect in sweep_error(tmp_path, body)


def test_a_value_the_field_does_not_take_is_one_line_per_policy(tmp_path):
    msg = sweep_error(tmp_path, "axes:\n  block_size: [16, 0]\n")
    assert msg.splitlines() == [f"error: {tmp_path / 's.yaml'}: point block_size=0: policies[{i}].block_size: Input "
                                "should be greater than 0 (got 0)" for i in (0, 1)]


def test_a_capacity_search_on_a_trace_without_an_axis_names_the_trace_axis(tmp_path):
    """It said "workload.arrival: Unable to extract tag using discriminator 'kind'" (the default axis is a
    generated workload's rate)."""
    base = BASE.replace("{arrival: {kind: poisson, rate: 2.0}, lengths: alpaca, num_requests: 20}",
                        "{kind: trace, path: t.csv}")
    assert base != BASE
    msg = sweep_error(tmp_path, "axes: {seed: [0]}\n" + CAP + "}\n", base=base)
    assert msg == (f"error: {tmp_path / 's.yaml'}:9: capacity.axis: the base workload is a trace, with its own arrival "
                   "times: set capacity.axis: workload.rate_scale (or give the trace an arrival process)"), msg


def test_a_missing_base_file(tmp_path):
    msg = sweep_error(tmp_path, "", base="base: nowhere.yaml\n")
    assert f":1: base: {tmp_path / 'nowhere.yaml'}: no such scenario file" in msg


def test_a_bad_base_scenario_names_its_line(tmp_path):
    msg = sweep_error(tmp_path, "axes: {seed: [0]}\n", base=BASE.replace("gpu: a100-40gb", "gpu: a100"))
    assert ":5: base.gpu: unknown gpu 'a100'" in msg and "expected one of a100-40gb" in msg  # the gpu key's line
    bad_key = sweep_error(tmp_path, "axes: {seed: [0]}\n", base=BASE.replace("lengths: alpaca", "lenghts: alpaca"))
    assert ":6: base.workload.lenghts: unknown key" in bad_key


def test_a_bad_base_scenario_file_names_its_own_line(tmp_path):
    (tmp_path / "b.yaml").write_text("\n".join(line[2:] for line in BASE.splitlines()[2:]).replace("a100-40gb", "a100"))
    p = tmp_path / "s.yaml"
    p.write_text("base: b.yaml\naxes: {seed: [0]}\n")
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2 and f"error: {tmp_path / 'b.yaml'}:3: gpu: unknown gpu 'a100'" in r.output, r.output


@pytest.mark.parametrize("args, expect", [(["--executor", "slurm"], "--executor 'slurm': expected one of local, ray"),
                                          (["--workers", "0"], "--workers must be between 1 and 1,024 (got 0)"),
                                          # an OverflowError traceback from the process pool's semaphore
                                          (["-j", "99999999999999999999"], "--workers must be between 1 and 1,024"),
                                          # ray.init retried an unreachable address for minutes
                                          (["-e", "ray", "--address", "127.0.0.1:1"],
                                           "--address 127.0.0.1:1: cannot connect to a Ray cluster there"),
                                          # a ValueError traceback from ray.init
                                          (["-e", "ray", "--address", "bogus"],
                                           "--address bogus: not a Ray address (Invalid address format: bogus)"),
                                          # started a Ray instance here, as if --address were not given
                                          (["-e", "ray", "--address", ""], "--address: an empty address")])
def test_bad_options(tmp_path, args, expect):
    p = tmp_path / "s.yaml"
    p.write_text(BASE + "axes: {seed: [0]}\n")
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and expect in r.output, r.output


def test_a_step_time_axis_on_a_base_without_step_time(tmp_path):
    """step_time.<field> as an axis: the roofline's field, though the base never wrote a step_time block."""
    p = tmp_path / "s.yaml"
    p.write_text(BASE.replace("  policies: [vllm]", "  policies: [vllm]") +
                 "axes: {step_time.paged_block_cost_tokens: [0, 3.68]}\n")
    r = runner.invoke(app, ["sweep", str(p), "--out", str(tmp_path / "out"), "-j", "1", "--no-report"])
    assert r.exit_code == 0, r.output
    import pandas as pd

    t = pd.read_parquet(tmp_path / "out" / "sweep.parquet")
    assert sorted(set(t["step_time.paged_block_cost_tokens"])) == [0, 3.68]  # two policies per value
