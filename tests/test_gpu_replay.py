"""Replay through the simulator's scheduler and allocator on the CPU: tokens that do not depend on the
policy, memory that agrees exactly with the simulation, calibration (closed and open loop as `sim replay`
runs them: tests/test_gpu_cli.py)."""

import json
from pathlib import Path

import numpy as np

from gpu_helpers import require_backend

torch = require_backend()

from gpu.calibrate import Grid, calibrate, fit_nonnegative  # noqa: E402
from gpu.replay import memory_gib_for_pool, replay  # noqa: E402
from gpu.validate import validate  # noqa: E402
from sim.config import parse_scenario  # noqa: E402
from sim.steptime import PROFILE_FORMAT, PROFILE_TERMS, load_profile, profile_features, profile_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "gpu" / "configs" / "tiny-llama.json"


def tiny_scenario(kv_pool_tokens: int, policies: list, rate: float = 1e6, num_requests: int = 8, **over):
    """The tiny model on a device sized for a KV pool of ``kv_pool_tokens``; ``rate`` 1e6: a burst."""
    from gpu.calibrate import resolve_model

    data = {"name": "tiny", "model": str(TINY),
            "gpu": {"name": "tiny-device", "memory_gib": memory_gib_for_pool(resolve_model(str(TINY)), kv_pool_tokens),
                    "hbm_gb_per_s": 50, "tflops": 1},
            "runtime_overhead_gib": 0,
            "workload": {"arrival": {"kind": "poisson", "rate": rate}, "prompt": {"kind": "uniform", "low": 30, "high": 60},
                         "output": {"kind": "uniform", "low": 12, "high": 24}, "num_requests": num_requests, "seed": 2},
            "policies": policies}
    data.update(over)
    return parse_scenario(data)


def test_tokens_do_not_depend_on_policy_or_preemption():
    """Greedy tokens of every request are the same under a contiguous policy and under paged ones that
    preempt (recompute re-prefills prompt + generated tokens; swap copies blocks out and back)."""
    s = tiny_scenario(320, ["orca-oracle", "vllm", {"preset": "vllm", "name": "vllm-swap", "preemption": "swap"},
                            {"preset": "vllm-v1", "name": "vllm-chunked", "max_num_batched_tokens": 48}])
    result, ex = replay(s, "cpu")
    assert result.policies["vllm"].summary["num_preemptions"] > 0
    assert result.policies["vllm-swap"].summary["num_preemptions"] > 0
    assert (result.policies["vllm-swap"].steps.num_swap_blocks > 0).any()
    ref = ex.executors["orca-oracle"]
    for name in ("vllm", "vllm-swap", "vllm-chunked"):
        other = ex.executors[name]
        for i in range(8):
            assert other.generated(i) == ref.generated(i), (name, i)
    assert all(len(ref.generated(i)) == n for i, n in enumerate(result.requests.output_tokens))
    assert ref.tokens == {} and len(ref.outputs) == 8  # finished sequences keep only their outputs


def write_profile(path: Path, model_spec, scale: float = 1.0) -> Path:
    coef = dict(zip(PROFILE_TERMS, np.array([2e-3, 2e-5, 1e-8, 1e-3, 5e-5, 1e-7]) * scale))
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "model": profile_model(model_spec), "swap_block_s": 1e-5,
                                "provenance": {"device": "hand-written", "date": "-"},
                                "layouts": {k: {"coefficients": coef, "fit": {}} for k in ("paged", "contiguous")}}))
    return path


def test_memory_agrees_exactly_with_the_simulation(tmp_path):
    """When timing cannot change the schedule (every request arrives before the first step ends), the
    replay makes the same steps as the calibrated simulation and its per-step memory is identical:
    both come from the same allocator."""
    s = tiny_scenario(320, ["orca-oracle", "orca-pow2", "vllm", {"preset": "vllm", "name": "vllm-swap", "preemption": "swap"}])
    prof = write_profile(tmp_path / "p.json", s.model_spec())
    result, table, sim, rep = validate(s, "cpu", prof)
    for name, p in result["policies"].items():
        assert p["identical_schedule"], name
        assert p["memory_max_abs_difference_slots"] <= 1e-9 * rep.policies[name].summary["kv_capacity_tokens"]
        assert p["kv_capacity_tokens"]["simulated"] == p["kv_capacity_tokens"]["replayed"]
        assert sim.policies[name].summary["num_preemptions"] == rep.policies[name].summary["num_preemptions"]
    assert rep.policies["vllm"].summary["num_preemptions"] > 0
    assert all(r.summary["num_finished"] == 8 for r in rep.policies.values())
    assert set(table.metric) >= {"request_throughput", "median_ttft_ms", "p99_tpot_ms", "step_time"}
    assert np.isfinite(table.relative_error.astype(float)).all()


def test_memory_check_can_fail(tmp_path):
    """With arrivals spread out, measured and predicted times interleave arrivals differently: the
    schedules differ and validation says so instead of comparing memory step by step."""
    # predicted steps of ~20 s (the simulation batches every arrival) against measured CPU steps of
    # milliseconds, even the first and on a busy machine (arrivals ~2 s apart each find an idle server)
    s = tiny_scenario(320, ["vllm"], rate=0.5, num_requests=6)
    result, *_ = validate(s, "cpu", write_profile(tmp_path / "p.json", s.model_spec(), scale=10_000.0))
    assert not result["policies"]["vllm"]["identical_schedule"]
    assert result["policies"]["vllm"]["memory_max_abs_difference_slots"] is None


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    n = 60
    pre = rng.integers(0, 2000, n) * (rng.random(n) < 0.5)
    pairs = pre * rng.integers(1, 500, n)
    dec = rng.integers(0, 64, n) * ((pre == 0) | (rng.random(n) < 0.5))
    ctx = dec * rng.integers(1, 4000, n)
    x = profile_features(pre, pairs, dec, ctx)
    true = np.array([3e-3, 4e-5, 2e-9, 1e-3, 6e-5, 3e-8])
    y = x @ true + 1e-4  # every step takes some time
    y = np.where(y > 1e-4, y, 1e-4)
    got = fit_nonnegative(x, y)
    assert (got >= 0).all()
    np.testing.assert_allclose(x @ got, y, rtol=0.05)


def test_calibration_writes_a_profile_the_simulator_reads(tmp_path):
    from gpu.calibrate import resolve_model

    spec = resolve_model(str(TINY))
    grid = Grid(decode=((1, 15), (4, 60), (8, 200), (2, 400)), prefill=((1, 32, 0), (2, 16, 16), (1, 64, 0)),
                mixed=((2, 16, 16),), swap_blocks=(1, 4), repeats=1, max_context=spec.max_model_len)
    prof = calibrate(spec, "cpu", grid=grid, out=tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json", spec)
    assert loaded["provenance"]["device_type"] == "cpu" and loaded["provenance"]["torch"] == torch.__version__
    assert len(prof["points"]) == 2 * 8
    for layout in ("paged", "contiguous"):
        fit = prof["layouts"][layout]["fit"]
        assert fit["held_back"]["num_points"] == 2 and np.isfinite(fit["held_back"]["mape"])
        assert all(v >= 0 for v in prof["layouts"][layout]["coefficients"].values())
    assert prof["swap_block_s"] > 0
