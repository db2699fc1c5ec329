"""The same sweep, and the same deployment plan, on a local process pool and on a local Ray instance (one for
the module: starting one costs seconds): identical tables."""

from __future__ import annotations

import textwrap

import pandas as pd
import pytest
from sweeps import base_yaml

from sim.executors import LocalExecutor, RayExecutor
from sim.sweep.output import run_sweep
from sim.sweep.spec import load_sweep

SWEEP = base_yaml("[orca-pow2, vllm]", lengths="sharegpt", num_requests=80, name="both") + """\
axes:
  workload.arrival.rate: [1.0, 4.0]
  seed: [0, 1]
capacity:
  slo: {mean_normalized_latency_s: 0.1}
  min: 0.5
  max: 16
  tolerance: 0.5
"""


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'kvsim[ray]'): the Ray executor "
                              "cannot be compared with the local one")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_local_and_ray_executors_give_identical_tables(tmp_path, local_ray):
    path = tmp_path / "both.yaml"
    path.write_text(textwrap.dedent(SWEEP))
    with LocalExecutor(workers=2) as ex:
        local = run_sweep(load_sweep(path), tmp_path / "local", ex)
    with RayExecutor() as ex:  # uses the Ray instance the fixture started (and leaves it running)
        assert ex.slots == 2
        on_ray = run_sweep(load_sweep(path), tmp_path / "ray", ex)
    assert local_ray.is_initialized()
    assert not local.failures and not on_ray.failures and on_ray.num_runs == local.num_runs > len(local.table)
    for a, b in ((local.table, on_ray.table), (local.capacity, on_ray.capacity),
                 (local.capacity_runs, on_ray.capacity_runs)):
        pd.testing.assert_frame_equal(a, b, check_exact=True)  # to the last bit, not to a tolerance
    assert set(local.capacity.status) == {"found", "above max"}  # orca-pow2 bisected; vllm meets it up to max


def test_a_plan_on_ray_gives_the_local_tables(tmp_path, local_ray):
    """``sim plan --executor ray``: the same configurations run, the same verdicts and the same winners."""
    from test_plan import plan_file

    from sim.plan import load_plan, run_plan

    plan = load_plan(plan_file(tmp_path))
    with LocalExecutor(workers=2) as ex:
        local = run_plan(plan, tmp_path / "local", ex)
    with RayExecutor() as ex:
        on_ray = run_plan(plan, tmp_path / "ray", ex)
    assert on_ray.num_runs == local.num_runs > 0
    pd.testing.assert_frame_equal(local.table, on_ray.table, check_exact=True)
    pd.testing.assert_frame_equal(local.best, on_ray.best, check_exact=True)
    assert local.best["met"].any()
