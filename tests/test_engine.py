"""Whole simulations: determinism, accounting, invariants after every step, exact vs span equivalence,
and the paper's direction."""

import sys

import numpy as np
import pandas as pd
import pytest

from conftest import check_after_every_step, needs_plain_python
from kvsim import run  # with the trace readers: some runs here read a table
from sim.clock import DecodeClock
from sim.schema import MEMORY_CLASSES
from sim.scheduler import Scheduler

SIX = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm", "vllm-v1"]
# paths the fast decode path hands over to the per-sequence one
RARE_PATHS = [
    {"preset": "vllm-v1", "name": "budget<batch", "max_num_batched_tokens": 24},  # decodes skipped for budget
    {"preset": "vllm", "name": "mixed-paged", "prefill": "mixed"},  # whole prompts may preempt newer ones
    {"preset": "vllm-v1", "name": "chunked-swap", "preemption": "swap", "swap_space_gib": 0.1},
    {"preset": "fastertransformer", "name": "ft-8", "max_num_seqs": 8},
]


def small(make_scenario, rate=4.0, n=200, policies=SIX, **over):
    over.setdefault("workload", {"arrival": {"kind": "poisson", "rate": rate}, "lengths": "sharegpt",
                                 "num_requests": n, "seed": 1})
    return make_scenario(policies=policies, **over)


def test_same_seed_same_results(make_scenario):
    a = run(small(make_scenario))
    b = run(small(make_scenario))
    for name in a.policies:
        pd.testing.assert_frame_equal(a.policies[name].requests, b.policies[name].requests)
        assert a.policies[name].summary == b.policies[name].summary


def test_every_request_is_accounted_for(make_scenario):
    s = small(make_scenario, n=300, horizon_s=40.0,
              workload={"arrival": {"kind": "poisson", "rate": 6.0}, "num_requests": 300, "seed": 2,
                        "prompt": {"kind": "uniform", "low": 1, "high": 1500},
                        "output": {"kind": "uniform", "low": 1, "high": 1200}})
    r = run(s)
    for name, res in r.policies.items():
        m = res.summary
        assert m["num_finished"] + m["num_rejected"] + m["num_unfinished"] == m["num_requests"] == 300
        df = res.requests
        rej = df[df.status == "rejected"]
        assert (rej.reason == "exceeds_max_model_len").sum() == ((df.prompt_tokens + df.output_tokens) > 2048).sum()
        assert m["num_unfinished"] > 0 and set(df[df.status == "unfinished"].reason) == {"horizon"}
        fin = df[df.status == "finished"]
        assert (fin.generated_tokens == fin.output_tokens).all()
        assert (fin.finish_s >= fin.first_token_s).all() and (fin.first_token_s > fin.arrival_s).all()


def test_scheduling_delay_is_queueing_before_the_first_step(make_scenario):
    """Arrival <= first scheduled < first token for every finished request; the summary's percentiles are
    over those delays; an idle server schedules a request the moment it arrives."""
    r = run(small(make_scenario))
    for name, res in r.policies.items():
        fin = res.requests[res.requests.status == "finished"]
        assert (fin.first_scheduled_s >= fin.arrival_s).all() and (fin.first_scheduled_s < fin.first_token_s).all()
        assert res.summary["p99_scheduling_delay_ms"] == pytest.approx(np.percentile(fin.scheduling_delay_ms, 99))
        assert res.summary["p99_scheduling_delay_ms"] < res.summary["p99_ttft_ms"], name
        assert fin.scheduling_delay_ms.iloc[0] == 0.0  # the first request finds the server idle
    rej = r.policies["vllm"].requests
    assert rej[rej.status == "rejected"].first_scheduled_s.isna().all()


def test_memory_classes_add_up(make_scenario):
    r = run(small(make_scenario))
    for res in r.policies.values():
        assert sum(res.summary[f"memory.{c}"] for c in MEMORY_CLASSES) == pytest.approx(1.0)
        st = res.steps
        total = st[[f"mem_{c}" for c in MEMORY_CLASSES]].sum(axis=1)
        assert np.allclose(total, res.summary["kv_capacity_tokens"])
        assert (st[[f"mem_{c}" for c in MEMORY_CLASSES]] >= -1e-9).all().all()


def _check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    live = sched.running + [s for s in sched.batch if s not in sched.running]
    assert sched.filled == sum(s.num_computed_tokens for s in sched.running)
    if kv.kind == "paged":
        held = [b for s in sched.running for b in s.block_table]
        assert len(held) == len(set(held)), "a block has two owners"
        assert len(held) + kv.pool.num_free == kv.pool.num_blocks
        for s in sched.running:
            assert len(s.block_table) * kv.block_size >= s.num_computed_tokens
        for s in list(sched.waiting) + sched.swapped:
            assert s.block_table == []
        if not kv.shared_blocks:  # the slots requests will fill, as the decode clock's final-block slack keeps it
            assert kv.capped == sum(min(len(s.block_table) * kv.block_size, s.max_kv_tokens) for s in sched.running)
    else:
        spans = sorted((s.slab_start, s.slab_start + s.slab_rounded) for s in live)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "slabs overlap"
        used = sum(e - b for b, e in spans)
        assert used + sum(n for _, n in kv.allocator.free_runs()) == kv.capacity
    assert sum(sched.memory()) == kv.capacity


@pytest.mark.parametrize("exact", [True, False])
def test_invariants_hold_after_every_step(make_scenario, monkeypatch, exact):
    calls = check_after_every_step(monkeypatch, _check_invariants)
    pols = SIX + RARE_PATHS + [{"preset": "vllm", "name": "swap", "preemption": "swap", "swap_space_gib": 0.05},
                               {"preset": "orca-oracle", "name": "ff", "allocator": {"placement": "first-fit"}}]
    r = run(small(make_scenario, rate=20.0, n=120, policies=pols, exact=exact))
    assert calls["n"] > 100
    assert r.policies["vllm"].summary["num_preemptions"] > 0
    assert r.policies["swap"].requests.num_preemptions.sum() > 0
    for res in r.policies.values():  # every block free at the end
        assert res.summary["num_finished"] == 120


def assert_same_requests(a: pd.DataFrame, b: pd.DataFrame) -> None:
    for col in ("status", "reason", "generated_tokens", "num_preemptions"):
        assert (a[col].to_numpy() == b[col].to_numpy()).all(), col
    fa, fb = a.finish_s.to_numpy(), b.finish_s.to_numpy()
    assert np.array_equal(np.isnan(fa), np.isnan(fb))
    ok = ~np.isnan(fa)
    assert np.array_equal(np.argsort(fa[ok], kind="stable"), np.argsort(fb[ok], kind="stable")), "finish order"
    for col in ("first_scheduled_s", "first_token_s", "finish_s"):
        x, y = a[col].to_numpy(), b[col].to_numpy()
        m = ~np.isnan(x)
        np.testing.assert_allclose(x[m], y[m], rtol=1e-9, atol=0)


@pytest.mark.parametrize("rate", [3.0, 30.0])
def test_spans_give_the_exact_answers(make_scenario, rate):
    pols = SIX + RARE_PATHS + [{"preset": "vllm", "name": "swap", "preemption": "swap", "swap_space_gib": 0.2},
                               {"preset": "vllm", "name": "bs1", "block_size": 1},
                               {"preset": "orca-pow2", "name": "ff", "allocator": {"placement": "first-fit"}}]
    s = small(make_scenario, rate=rate, n=250, policies=pols)
    exact = run(s.model_copy(update={"exact": True}))
    fast = run(s)
    for name in exact.policies:
        assert_same_requests(exact.policies[name].requests, fast.policies[name].requests)
        e, f = exact.policies[name].summary, fast.policies[name].summary
        for k in ("num_preemptions", "num_steps", "mean_batch_size"):
            assert e[k] == pytest.approx(f[k], rel=1e-9), k
        for c in MEMORY_CLASSES:
            assert e[f"memory.{c}"] == pytest.approx(f[f"memory.{c}"], rel=1e-6, abs=1e-12), c
        assert len(fast.policies[name].steps) <= len(exact.policies[name].steps)
        te, tf = exact.policies[name].timeline, fast.policies[name].timeline
        for col in ("busy_s", "seq_s", "waiting_s", "num_steps", "num_sampled", "num_finished", "num_preempted",
                    "mem_token_states_slot_s", "mem_free_slot_s"):
            assert te[col].sum() == pytest.approx(tf[col].sum(), rel=1e-9, abs=1e-9), col


def test_a_short_span_priced_whole_is_the_span_priced_up_to_the_next_arrival(make_scenario, monkeypatch):
    """A lone server prices a decode span of at most ``engine.PRICE_WHOLE`` steps whole and cuts it at its
    next arrival, instead of pricing one step first to bound it: the same steps, to the bit (every table),
    with fewer one-step pricing calls. With the bound always taken (PRICE_WHOLE 0), the old way."""
    needs_plain_python("counting the executor's pricing calls")
    import sim.engine
    from sim.steptime import RooflineStepTime

    calls: list[int] = []
    orig = RooflineStepTime.decode_span_s

    def counted(self, plan, k):
        calls.append(k)
        return orig(self, plan, k)

    monkeypatch.setattr(RooflineStepTime, "decode_span_s", counted)
    s = small(make_scenario, rate=8.0, n=300, policies=["vllm", "orca-oracle", "vllm-v1"])
    whole = run(s)
    ones_whole = calls.count(1)
    calls.clear()
    monkeypatch.setattr(sim.engine, "PRICE_WHOLE", 0)
    bounded = run(s)
    ones_bounded = calls.count(1)
    for name in whole.policies:
        a, b = whole.policies[name], bounded.policies[name]
        assert a.summary == b.summary, name
        for t in ("requests", "steps", "timeline"):
            pd.testing.assert_frame_equal(getattr(a, t), getattr(b, t), check_exact=True)
    assert ones_whole < 0.8 * ones_bounded, (ones_whole, ones_bounded)  # (69 against 111 when written)


def test_paged_keeps_kv_in_token_states_at_saturation(make_scenario):
    r = run(small(make_scenario, rate=20.0, n=600, policies=["orca-max", "orca-oracle", "vllm"]))
    m = {n: res.summary for n, res in r.policies.items()}
    assert m["vllm"]["memory.token_states"] > 0.9
    assert m["orca-max"]["memory.token_states"] < 0.35
    assert m["orca-max"]["memory.internal_fragmentation"] > 0.4
    assert m["orca-oracle"]["memory.external_fragmentation"] > 0.2  # buddy rounding
    assert m["vllm"]["request_throughput"] > 1.5 * m["orca-oracle"]["request_throughput"]
    assert m["orca-oracle"]["request_throughput"] > m["orca-max"]["request_throughput"]


def test_requests_that_can_never_fit_are_rejected_not_hung(make_scenario, tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,10\n0.1,3000,10\n0.2,2000,48\n0.3,50,50\n")
    s = make_scenario(workload={"kind": "table", "path": str(p)},
                      gpu={"name": "tiny", "memory_gib": 28.6, "hbm_gb_per_s": 1000, "tflops": 100},
                      policies=SIX)
    r = run(s)
    for name, res in r.policies.items():
        assert res.summary["kv_capacity_tokens"] < 2048
        df = res.requests.set_index("request_id")
        assert df.loc[1, "reason"] == "exceeds_max_model_len"
        assert df.loc[2, "reason"] == "exceeds_kv_pool", name  # 2048 tokens: more than the whole pool
        if name in ("fastertransformer", "orca-max"):  # a max-length slab never fits this pool
            assert list(df.loc[[0, 3], "reason"]) == ["exceeds_kv_pool"] * 2
        else:
            assert list(df.loc[[0, 3], "status"]) == ["finished"] * 2, name


def test_all_rejected_run_reports_the_whole_pool_free(make_scenario, tmp_path):
    """Every request rejected: no memory was ever held, and the memory shares are still fractions that
    sum to 1 (the whole pool free), not nulls."""
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens\n0,3000,10\n0.5,3000,10\n")
    r = run(make_scenario(workload={"kind": "table", "path": str(p)}, policies=["vllm", "fastertransformer"]))
    for name, res in r.policies.items():
        m = res.summary
        assert m["num_rejected"] == m["num_requests"] == 2, name
        assert [m[f"memory.{c}"] for c in MEMORY_CLASSES] == [0.0, 0.0, 0.0, 0.0, 1.0], name


def test_model_that_does_not_fit_the_gpu_is_a_scenario_error(make_scenario):
    from sim.config import ScenarioError

    with pytest.raises(ScenarioError, match="does not fit on a100-40gb x1"):
        run(make_scenario(model="llama-2-70b"))


def _with_policy(path, policy: dict):
    """The scenario file with this one policy instead of its own."""
    import yaml

    from sim.config import parse_scenario

    d = yaml.safe_load(path.read_text())
    d["policies"] = [policy]
    return parse_scenario(d, base_dir=str(path.parent))


def _admitted(r) -> int:
    """Max-length requests the policy's KV manager admits before it refuses one."""
    from sim.core import Sequence
    from sim.policy import make_kv

    kv, n = make_kv(r), 0
    while kv.can_admit(seq := Sequence(n, 0.0, r.max_model_len - 1, 1), 1):
        kv.admit(seq, 1)
        n += 1
    return n


@pytest.mark.parametrize("scenario, placement, max_len", [
    ("quickstart.yaml", "buddy", 2048), ("quickstart.yaml", "first-fit", 2048), ("quickstart.yaml", "buddy", 1500),
    ("quickstart.yaml", "first-fit", 1500), ("tiny-hybrid-cpu.yaml", "buddy", None),
    ("tiny-hybrid-cpu.yaml", "first-fit", None)])
def test_check_says_how_many_max_length_slabs_a_pool_holds_and_how_near_the_next(scenario, placement, max_len):
    """The quickstart's pool is 384 tokens above 7 slabs: a reserve 0.35 GiB larger takes a seventh of the
    contiguous policies' concurrency (README, KV memory model). The count is the manager's own: requests of
    the maximum length admitted until one is refused (a hybrid model's slab spans its KV groups)."""
    from pathlib import Path

    from sim.policy import resolve_policy
    from sim.run import _slabs, check_scenario

    root = Path(__file__).parents[1] / "scenarios"
    lines = check_scenario(root / "quickstart.yaml")
    i = lines.index("  orca-max: continuous batching, contiguous allocator")
    assert lines[i + 1] == "    holds 7 requests at once (7 slabs of 2,048 tokens): 384 tokens (0.29 GiB) above 7 slabs, " \
        "1,664 (1.27 GiB) short of 8"
    assert sum(x.startswith("    holds") for x in lines) == 2  # fastertransformer's and orca-max's: reserving the max
    s = _with_policy(root / scenario, {"name": "m", "preset": "orca-max", "hybrid_allocator": True,
                                        "allocator": {"kind": "contiguous", "reserve": "max", "placement": placement}})
    policy = s.policies[0]
    model = s.model_spec()
    if max_len is not None:
        model = model.__class__(**{**model.__dict__, "max_model_len": max_len})
    r = resolve_policy(s, model, s.gpu_spec(), policy)
    assert _slabs(r).startswith(f"    holds {_admitted(r)} request")


def test_check_counts_a_sampled_requests_slabs_per_sequence():
    """Four samples reserve four slabs: seven slabs hold one request, not seven."""
    from pathlib import Path

    from sim.policy import resolve_policy
    from sim.run import _slabs

    s = _with_policy(Path(__file__).parents[1] / "scenarios" / "sharing" / "alpaca-parallel.yaml",
                     {"name": "m", "preset": "orca-max"})
    r = resolve_policy(s, s.model_spec(), s.gpu_spec(), s.policies[0])
    assert r.width == 4 and _slabs(r).startswith("    holds 1 request at once (7 slabs of 2,048 tokens, 4 per request)")


def test_quickstart_scenario_is_valid_and_small():
    from pathlib import Path

    from sim.config import load_scenario
    from sim.run import check_scenario
    from sim.workload import load_requests

    path = Path(__file__).parents[1] / "scenarios" / "quickstart.yaml"
    lines = check_scenario(path)  # valid: every key, the model's fit and the workload, as `sim check` says
    assert lines[0].endswith(": ok") and sum("KV pool: 14,720 tokens" in x for x in lines) == 1  # as the README says
    s = load_scenario(path)
    assert [p.name for p in s.policies] == ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]
    assert s.model == "opt-13b" and s.gpu == "a100-40gb" and s.tensor_parallel == 1
    # small: the README's 1,000 requests, under a million tokens in all, arriving within a quarter of an
    # hour of simulated time (a run takes seconds)
    t = load_requests(s)
    assert len(t) == 1000
    assert int(t.prompt_tokens.sum() + t.output_tokens.sum()) < 1_000_000
    assert t.arrival_s[-1] < 900


def test_kv_snapshot_tiles_the_pool_at_the_busiest_moment(make_scenario):
    r = run(small(make_scenario, rate=20.0, n=150, policies=SIX))
    for name, res in r.policies.items():
        snap = res.snapshot
        seg = snap["segments"]
        assert seg[0, 0] == 0 and (seg[1:, 0] == seg[:-1, 0] + seg[:-1, 1]).all(), name  # contiguous cover
        assert seg[-1, 0] + seg[-1, 1] == res.summary["kv_capacity_tokens"]
        assert snap["num_waiting"] > 0  # saturated: the kept moment has a queue
        by_class = np.bincount(seg[:, 2], weights=seg[:, 1], minlength=5)
        if name.startswith("orca-max") or name == "fastertransformer":
            assert by_class[2] > by_class[0]  # max reservation: more internal fragmentation than token states
        if name.startswith("vllm"):
            assert by_class[0] > 0.8 * by_class.sum()


@pytest.mark.parametrize("case", ["budget_below_batch", "chunks_under_memory_pressure"])
def test_rare_scheduler_paths_match_stepping(make_scenario, monkeypatch, case):
    """Scenarios built to leave the fast decode path: a token budget smaller than the running batch
    (decodes skipped a step), and chunked prefills that need blocks while memory is full."""
    if case == "budget_below_batch":
        wl = {"arrival": {"kind": "poisson", "rate": 200.0}, "num_requests": 400, "seed": 3,
              "prompt": {"kind": "fixed", "tokens": 8}, "output": {"kind": "uniform", "low": 5, "high": 20}}
        pols = [{"preset": "vllm", "name": "v0", "max_num_batched_tokens": 32},
                {"preset": "vllm-v1", "name": "v1", "max_num_batched_tokens": 32},
                {"preset": "orca-oracle", "name": "orca", "max_num_batched_tokens": 32}]
        gpu = "a100-40gb"
    else:
        wl = {"arrival": {"kind": "poisson", "rate": 50.0}, "num_requests": 150, "seed": 4,
              "prompt": {"kind": "uniform", "low": 200, "high": 700}, "output": {"kind": "uniform", "low": 20, "high": 300}}
        pols = [{"preset": "vllm-v1", "name": "v1", "max_num_batched_tokens": 64},
                {"preset": "vllm-v1", "name": "v1-swap", "max_num_batched_tokens": 96, "preemption": "swap",
                 "swap_space_gib": 1.0}]
        gpu = {"name": "small", "memory_gib": 29.5, "hbm_gb_per_s": 1555, "tflops": 312}
    needs_plain_python("counting the rare paths taken")
    s = make_scenario(workload=wl, policies=pols, gpu=gpu)
    counts = {"skip": 0, "chunk_short": 0}
    orig_out, orig_newest = DecodeClock.leave, Scheduler._newest_unscheduled

    # The caller's name, one frame up: inspect.stack() would read every frame's source lines (seconds
    # per thousand calls), and these hooks run thousands of times.
    def clock_out(self, seq):  # DecodeClock.leave
        if sys._getframe(1).f_code.co_name == "_schedule_decodes":
            counts["skip"] += 1
        return orig_out(self, seq)

    def newest(self, scheduled):  # asked only when a step runs out of blocks
        if sys._getframe(1).f_code.co_name == "_schedule_chunks":
            counts["chunk_short"] += 1
        return orig_newest(self, scheduled)

    monkeypatch.setattr(DecodeClock, "leave", clock_out)
    monkeypatch.setattr(Scheduler, "_newest_unscheduled", newest)
    exact = run(s.model_copy(update={"exact": True}))
    fast = run(s)
    for name in exact.policies:
        assert_same_requests(exact.policies[name].requests, fast.policies[name].requests)
        assert exact.policies[name].summary["num_rejected"] == 0
        assert exact.policies[name].summary["num_finished"] == wl["num_requests"]
    key = "skip" if case == "budget_below_batch" else "chunk_short"
    assert counts[key] > 0, counts


def test_a_run_paces_the_garbage_collector_and_gives_it_back_as_it_was():
    import gc
    from sim.engine import paced_gc
    before = gc.get_threshold()
    with pytest.raises(ZeroDivisionError):
        with paced_gc():
            assert gc.get_threshold()[0] == 50_000 and gc.get_freeze_count() > 0
            1 / 0  # a run that fails still restores the collector
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_run_starts_at_its_first_arrival_and_never_lasts_less_than_nothing(make_scenario, tmp_path):
    """The same requests later by 100 s: every metric the same (time before the first arrival was
    recorded as idle, which diluted the memory shares); and a run that serves nothing (every request too
    long, or arriving past the horizon) lasts 0 s, not (end - first arrival) < 0."""
    table = tmp_path / "r.csv"

    def result(offset, prompt=200, **over):
        table.write_text("arrival_s,prompt_tokens,output_tokens\n"
                         + "".join(f"{offset + 0.3 * i},{prompt + 37 * i},{20 + 11 * i}\n" for i in range(8)))
        s = make_scenario(workload={"kind": "trace", "path": str(table), "format": "canonical"},
                          policies=["vllm", "orca-max"], decompose=False, **over)
        return run(s).policies

    base, later = result(0.0), result(100.0)
    for name in base:
        a, b = base[name].summary, later[name].summary
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-9, abs=1e-12) if isinstance(v, float) else b[k] == v, (name, k)
    tl = later["vllm"].timeline  # the timeline starts at the bin holding the first arrival, covered from it
    assert tl.bin_start_s.iloc[0] <= 100.0 < tl.bin_start_s.iloc[0] + 1.0
    assert tl.bin_s.sum() == pytest.approx(later["vllm"].summary["duration_s"])
    # (a step counts in the bin where it ends: a bin's shares sum to about 1, the first's too, not diluted)
    assert np.allclose(sum(tl[f"memory.{c}"] for c in MEMORY_CLASSES), 1.0, atol=0.1)
    gone = result(100.0, horizon_s=50.0)["vllm"].summary
    assert gone["num_unfinished"] == 8 and gone["duration_s"] == 0.0 and gone["request_throughput"] is None
    too_long = result(5.0, prompt=3000)["vllm"].summary  # past OPT-13B's 2,048 positions
    assert too_long["num_rejected"] == 8 and too_long["duration_s"] == 0.0


def test_the_warm_up_is_idle_time_with_the_arrivals_waiting(make_scenario):
    """startup_s: no step runs, requests queue. It counted in the duration but was never recorded, so the
    memory shares ignored it (the same for a 1 s and a 1,000 s warm-up) and no one waited in the timeline."""
    def result(startup):
        s = make_scenario(workload={"arrival": {"kind": "poisson", "rate": 100}, "num_requests": 5, "seed": 0,
                                    "prompt": {"kind": "fixed", "tokens": 100}, "output": {"kind": "fixed", "tokens": 20}},
                          policies=["vllm"], startup_s=startup, decompose=False)
        return run(s).policies["vllm"]

    short, long = result(1.0), result(1000.0)
    assert long.summary["memory.free"] > 0.9999 > short.summary["memory.free"]
    arrivals = short.requests.arrival_s.to_numpy()
    t0 = arrivals.min()
    tl = short.timeline
    assert tl.waiting_s.sum() >= (1.0 - arrivals).sum() - 1e-9  # each waits out the warm-up, at least
    warm = short.steps[(short.steps.num_steps == 0) & (short.steps.start_s < 1.0)]
    assert warm.start_s.min() == pytest.approx(t0) and (warm.start_s + warm.duration_s).max() == pytest.approx(1.0)
    assert warm.num_waiting.tolist() == list(range(1, len(warm) + 1))  # one more from each arrival on
