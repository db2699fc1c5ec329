"""Replay through the simulator's scheduler and allocator on the CPU: tokens that do not depend on the
policy, memory that agrees exactly with the simulation, calibration (closed and open loop as `sim replay`
runs them: tests/test_gpu_cli.py)."""

import json
from pathlib import Path

import numpy as np
import pytest

from gpu_helpers import require_backend

torch = require_backend()

from gpu.calibrate import Grid, calibrate, fit_nonnegative  # noqa: E402
from gpu.replay import memory_gib_for_pool, replay  # noqa: E402
from gpu.validate import validate  # noqa: E402
from sim.config import ScenarioError, parse_scenario  # noqa: E402
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
    prof = write_profile(tmp_path / "p.json", s.model_spec(), scale=10_000.0)
    bare = json.loads(prof.read_text())  # a profile without provenance or fits prices a run as well (it was a
    del bare["provenance"]  # KeyError after the whole replay)
    for layout in bare["layouts"].values():
        del layout["fit"]
    prof.write_text(json.dumps(bare))
    result, *_ = validate(s, "cpu", prof)
    assert not result["policies"]["vllm"]["identical_schedule"]
    assert result["policies"]["vllm"]["memory_max_abs_difference_slots"] is None
    assert result["profile"]["device"] is None and result["profile"]["fit"] == {"paged": None, "contiguous": None}


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


# ------------------------------------------------------------------------------------------ several KV groups

HYBRID = ROOT / "gpu" / "configs" / "tiny-hybrid.json"  # 5 layers: sliding W = 8 (3) and full (2), 128 hidden


def hybrid_scenario(kv_pool_tokens: int, policies: list, num_requests: int, prompt: tuple, output: tuple,
                    shared_prefixes: dict | None = None):
    """The tiny hybrid model (KV groups: sliding 2 + 1 layers, full 2 layers; pages of 2 layers) on blocks of
    4 tokens (the window is 2 blocks); ``kv_pool_tokens`` as tokens of all 5 layers."""
    from gpu.calibrate import resolve_model

    extra = {} if shared_prefixes is None else {"shared_prefixes": shared_prefixes}
    return parse_scenario({
        "name": "tiny-hybrid", "model": str(HYBRID),
        "gpu": {"name": "tiny-device", "memory_gib": memory_gib_for_pool(resolve_model(str(HYBRID)), kv_pool_tokens),
                "hbm_gb_per_s": 50, "tflops": 1},
        "runtime_overhead_gib": 0,
        "workload": {"arrival": {"kind": "poisson", "rate": 1e6},
                     "prompt": {"kind": "uniform", "low": prompt[0], "high": prompt[1]},
                     "output": {"kind": "uniform", "low": output[0], "high": output[1]},
                     "num_requests": num_requests, "seed": 2, **extra},
        "policies": [{"preset": "vllm", "block_size": 4, **p} for p in policies]})


def record_group_tables(monkeypatch) -> list:
    """Every step's per-group tables as the executor takes them from the hybrid allocator."""
    from gpu.executor import TorchExecutor

    log, take = [], TorchExecutor.group_tables

    def group_tables(self, plan):
        tables = take(self, plan)
        if hasattr(self.kv, "group_tables"):
            log.append((self, plan.seq_ids, plan.num_new_tokens, plan.num_computed_tokens, tables))
        return tables

    monkeypatch.setattr(TorchExecutor, "group_tables", group_tables)
    return log


def check_group_tables(log: list, layout) -> dict:
    """Per step: each group's pages belong to one (sequence, block); a window group still holds every block
    its step reads, and in a decode step past its prefill's blocks holds at most ceil(W / B) + 1 pages (vLLM's
    hybrid manager frees the rest). Returns counts: decode steps checked, the bound reached, pages reused by
    another sequence after a window group freed them."""
    B = layout.block_size
    owner: dict[int, int] = {}  # page -> the sequence that last held it
    freed_by_window: set[int] = set()  # pages a window group held and then let go
    prefill_end: dict[int, int] = {}
    out = {"decode_checked": 0, "at_bound": 0, "reused": 0}
    before: dict[tuple[int, int], list[int]] = {}  # (group, sequence) -> its row at its previous step
    for _, seq_ids, news, cached, tables in log:
        seen = set()
        for seq_id, n, c in zip(seq_ids, news, cached):
            if n > 1:
                prefill_end[seq_id] = c + n
        for g, (group, rows) in enumerate(zip(layout.groups, tables)):
            for seq_id, n, c, row in zip(seq_ids, news, cached, rows):
                kept = [b for b in row if b >= 0]
                assert not seen & set(kept), "a page holds two groups' or sequences' tokens"
                seen |= set(kept)
                for b in kept:
                    if owner.get(b, seq_id) != seq_id and b in freed_by_window:
                        out["reused"] += 1
                    owner[b] = seq_id
                if group.window:
                    first_read = max(c + 1 - group.window, 0) // B
                    assert len(row) == -(-(c + n) // B) and min(row[first_read:]) >= 0, (seq_id, c, n, row)
                    prev = before.get((g, seq_id), [])
                    freed_by_window |= {b for b, now in zip(prev, row) if b >= 0 and now < 0}  # slid out
                    before[(g, seq_id)] = row
                    if n == 1 and c >= -(-prefill_end[seq_id] // B) * B:
                        out["decode_checked"] += 1
                        bound = -(-group.window // B) + 1
                        assert len(kept) <= bound, (seq_id, c, row)
                        out["at_bound"] += len(kept) == bound
    return out


def reference_generation(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of a plain recomputation (no cache; window layers masked), token by token."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(model.full_logits(toks).argmax()))
    return toks[len(prompt):]


def test_hybrid_allocator_replay_runs_each_layer_on_its_groups_pages(monkeypatch):
    """Paged with the hybrid allocator: each layer reads and writes only its KV group's pages as the
    simulator placed them, the window groups' freed pages go to other sequences, preempted sequences are
    recomputed on new pages, and every request's tokens equal those of the same replay with one full table
    per sequence (hybrid_allocator: false) and of a plain recomputation. The pool is what the simulator
    sized: pages of 2 layers, no more."""
    log = record_group_tables(monkeypatch)
    s = hybrid_scenario(44, [{"name": "full", "hybrid_allocator": False}, {"name": "hybrid"}], 6, (10, 20), (16, 32))
    result, ex = replay(s, "cpu")
    assert result.policies["hybrid"].summary["num_preemptions"] > 0  # recomputed: re-prefilled on new pages
    assert all(p.summary["num_finished"] == 6 for p in result.policies.values())
    layout = result.policies["hybrid"].layout
    assert [(g.kind, g.layers) for g in layout.groups] == [("sliding", 2), ("sliding", 1), ("full", 2)]
    counts = check_group_tables(log, layout)
    assert counts["decode_checked"] > 20 and counts["at_bound"] > 0 and counts["reused"] > 0, counts
    hybrid = ex.executors["hybrid"]
    slots = result.policies["hybrid"].summary["kv_capacity_tokens"]
    # the device pool: pages of 2 layers' K and V, as many as the simulator's (its bytes at the model's bf16)
    assert hybrid.cache.kv.shape[:4] == (2, 2, slots // 4, 4)
    assert hybrid.cache.kv.numel() * 2 == slots * layout.slot_bytes
    for i in range(6):
        want = reference_generation(hybrid.model, hybrid.prompt_ids(i), len(hybrid.generated(i)))
        assert hybrid.generated(i) == ex.executors["full"].generated(i) == want, i


def test_hybrid_allocator_replay_on_the_triton_kernels(monkeypatch):
    """The same through the Triton kernels (the interpreter): store_kv through each group's slot row,
    decode and prefill attention through each group's tables, a window group's freed pages reused."""
    from gpu.executor import ReplayExecutors
    from sim.run import run

    log = record_group_tables(monkeypatch)
    s = hybrid_scenario(20, [{"name": "hybrid"}], 3, (10, 16), (6, 10))
    executors = ReplayExecutors("cpu", attention="triton", warmup=False)
    result = run(s, executor=executors)
    counts = check_group_tables(log, result.policies["hybrid"].layout)
    assert counts["at_bound"] > 0 and counts["reused"] > 0, counts
    ex = executors.executors["hybrid"]
    for i in range(len(result.requests)):
        assert ex.generated(i) == reference_generation(ex.model, ex.prompt_ids(i), len(ex.generated(i))), i


def test_the_group_tables_are_what_keeps_layers_apart(monkeypatch):
    """The check above can fail: give the one-layer sliding group the other sliding group's tables (its
    layer then shares page places with layer 0) and the tokens are no longer the recomputation's."""
    from gpu.executor import TorchExecutor

    take = TorchExecutor.group_tables

    def swapped(self, plan):
        t = take(self, plan)
        return [t[0], t[0], t[2]]

    monkeypatch.setattr(TorchExecutor, "group_tables", swapped)
    s = hybrid_scenario(20, [{"name": "hybrid"}], 3, (10, 16), (6, 10))
    _, executors = replay(s, "cpu")
    ex = executors.executors["hybrid"]
    assert any(ex.generated(i) != reference_generation(ex.model, ex.prompt_ids(i), len(ex.generated(i)))
               for i in range(3))


def test_replay_refuses_what_it_cannot_run_with_several_groups():
    """Several KV groups replay paged with recompute only: a contiguous slab's window groups are ring
    buffers, and a swapped window group comes back re-placed from its current window."""
    for policy, key in (({"preset": "orca-oracle", "name": "slab"}, "on a paged allocator only"),
                        ({"name": "swap", "preemption": "swap"}, "preemption: swap with several KV groups")):
        s = hybrid_scenario(20, [policy], 2, (10, 16), (6, 10))
        with pytest.raises(ScenarioError, match=key):
            replay(s, "cpu")


def test_hybrid_prefix_cache_hits_compute_the_same_tokens():
    """Prefix caching with several KV groups on the device: a hit takes the full group's pages of the whole
    prefix but only the window group's last blocks (the ones before were freed as they left the window and
    may be gone); the request prefills only its suffix over those pages and still generates the tokens of a
    plain recomputation."""
    s = hybrid_scenario(120, [{"name": "apc", "prefix_caching": True},
                              {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True,
                               "max_num_batched_tokens": 16}], 8, (4, 12), (4, 8),
                        shared_prefixes={"lengths": [20, 33], "popularity": [2, 1], "hash_block": 4})
    result, executors = replay(s, "cpu")
    for name in ("apc", "apc-v1"):
        assert result.policies[name].summary["prefix_hit_rate_tokens"] > 0.3, name
        ex = executors.executors[name]
        for i in range(8):
            assert ex.generated(i) == reference_generation(ex.model, ex.prompt_ids(i), len(ex.generated(i))), (name, i)


def test_hybrid_open_loop_replays_the_recorded_group_tables():
    """Open loop: the simulation records each plan with the allocator's per-group tables of that moment,
    and the device replays them (no allocator beside it) to the recomputation's tokens."""
    from gpu.replay import open_loop

    s = hybrid_scenario(20, [{"name": "hybrid"}], 3, (10, 16), (6, 10))
    _, steps, executors = open_loop(s, "cpu")
    ex = executors.executors["hybrid"]
    assert ex.kv is None and len(steps) > 5
    for i in range(3):
        assert ex.generated(i) == reference_generation(ex.model, ex.prompt_ids(i), len(ex.generated(i))), i


def test_the_shipped_hybrid_scenario_replays():
    """``sim replay scenarios/tiny-hybrid-cpu.yaml`` (README), on its first 10 requests: both policies
    generate the same tokens, and the hybrid one's memory splits by layer group."""
    from sim.config import load_scenario
    from sim.workload import load_requests

    s = load_scenario(ROOT / "scenarios" / "tiny-hybrid-cpu.yaml")
    result, ex = replay(s, "cpu", requests=load_requests(s).head(10))
    hybrid, full = result.policies["paged-hybrid"], result.policies["paged-full"]
    assert hybrid.groups is not None and set(hybrid.groups.kind) == {"sliding", "full"} and full.groups is None
    # a slot is a token of 2 layers, not 5: the same memory holds 2.5x as many
    assert hybrid.summary["kv_capacity_tokens"] == 2.5 * full.summary["kv_capacity_tokens"]
    for i in range(10):
        assert ex.executors["paged-hybrid"].generated(i) == ex.executors["paged-full"].generated(i), i


def test_the_replay_refuses_an_fp8_kv_cache():
    """The kernels read K and V in the model's dtype: an fp8 policy's pool would hold twice the bytes the
    simulator sized, and nothing said so."""
    from gpu.executor import ReplayExecutors
    from sim.config import ScenarioError
    from sim.policy import resolve_policy

    s = parse_scenario({"name": "t", "model": "llama-3-8b", "gpu": "h100", "decompose": False,
                        "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "sharegpt", "num_requests": 5},
                        "policies": [{"preset": "vllm", "kv_cache_dtype": "fp8"}]})
    policy = resolve_policy(s, s.model_spec(), s.gpu_spec(), s.policies[0])
    with pytest.raises(ScenarioError, match="kv_cache_dtype: fp8 is simulator-only"):
        ReplayExecutors("cpu", warmup=False)(s, s.model_spec(), s.gpu_spec(), policy, None)
