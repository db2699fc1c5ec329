"""The prefix cache's CPU tier (``kv_offload``, sim/offload.py): the host LRU, loads instead of prefills,
their price, its metrics, and spans equal to stepping with it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import check_after_every_step
from sim import run
from sim.config import ScenarioError, parse_scenario
from sim.core import Sequence, StepPlan
from sim.offload import HostTier
from sim.sharing import SharedBlockPool, SharedPagedKv
from test_sharing import check_pool


def tiered(num_blocks: int, block_size: int, host_blocks: int) -> SharedPagedKv:
    tier = HostTier(host_blocks)
    return SharedPagedKv(SharedBlockPool(num_blocks, block_size), caching=True, tier=tier)


def check_tier(kv: SharedPagedKv, seqs) -> None:
    """The pool's own invariants, the host pool within its capacity, and no block in both tiers."""
    check_pool(kv, seqs)
    tier = kv.tier
    assert len(tier) <= tier.capacity
    assert not set(tier.entries) & set(kv.pool.cache), "a block is cached on the GPU and the host at once"


def prompt_seq(rid: int, ids, block_size: int = 4, hash_block: int = 8) -> Sequence:
    return Sequence(rid, 0.0, len(ids) * hash_block + 1, 3, prefix_ids=np.asarray(ids), hash_block=hash_block)


def serve(kv: SharedPagedKv, s: Sequence):
    """Admit ``s`` with its prefix hits, compute its prompt, register it; returns the hits."""
    hits = kv.match_prefix(s)
    todo = s.prompt_tokens - len(hits) * kv.block_size
    assert kv.can_admit(s, todo, hits)
    kv.admit(s, todo, hits)
    s.num_computed_tokens = s.prompt_tokens
    kv.register(s)
    s.prefix_hit_tokens = len(hits) * kv.block_size
    return hits


def test_an_evicted_block_comes_back_from_the_host_instead_of_a_prefill():
    kv = tiered(num_blocks=5, block_size=4, host_blocks=8)
    a = prompt_seq(0, [1, 2])  # 17 tokens in 5 blocks: 4 full ones cached
    serve(kv, a)
    kv.free(a)
    b = prompt_seq(1, [5, 6])  # needs the whole pool: evicts a's 4 cached blocks
    serve(kv, b)
    assert kv.pool.num_evicted == 4 and len(kv.tier) == 4 and kv.tier.num_stored == 4
    kv.free(b)
    kv.loads = []
    c = prompt_seq(2, [1, 2])  # a's prompt again: the GPU lost it, the host has it
    hits = serve(kv, c)
    assert len(hits) == 4 and all(type(h) is tuple for h in hits)
    assert len(kv.loads) == 4 and kv.loads == c.block_table[:4] and kv.tier.num_loaded == 4
    assert c.block_table[:4] == [kv.pool.cache[h] for h, _, _ in hits]  # cached on the GPU again
    assert not any(h in kv.tier for h, _, _ in hits)  # ... and no longer on the host
    assert kv.hit_tokens_cpu == 16 and kv.hit_tokens_gpu == 0 and kv.admitted_prompt_tokens == 3 * 17
    check_tier(kv, [c])


def test_gpu_hits_come_first_then_the_host_continues_the_chain():
    kv = tiered(num_blocks=8, block_size=4, host_blocks=8)
    a = prompt_seq(0, [1, 2, 3])  # 25 tokens: 6 full blocks
    serve(kv, a)
    kv.free(a)  # the tail's blocks are queued first: evicted first
    filler = prompt_seq(1, [9])  # 9 tokens: 3 blocks, two fresh, then a's last cached block
    serve(kv, filler)
    assert kv.pool.num_evicted == 1
    again = prompt_seq(2, [1, 2, 3])
    hits = kv.match_prefix(again)
    assert [type(h) for h in hits] == [int] * 5 + [tuple]
    kv.free(filler)
    check_tier(kv, [])


def test_the_host_pool_drops_its_least_recently_used_block():
    t = HostTier(2)
    t.store(1, "a", None)
    t.store(2, "b", 1)
    t.store(1, "a", None)  # touched: now the most recent
    t.store(3, "c", 2)
    assert list(t.entries) == [1, 3] and t.num_dropped == 1 and t.num_stored == 3
    assert t.find(3, "c", 2) and not t.find(3, "c", 5)  # another parent: a collision, a miss
    with pytest.raises(ValueError, match="too small"):
        HostTier(0)


ops = st.lists(st.tuples(st.sampled_from(["admit", "admit", "grow", "free"]), st.integers(0, 10_000),
                         st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 4, 16]), host_blocks=st.integers(1, 30),
       steps=ops)
def test_host_lru_never_exceeds_capacity_nor_double_holds_a_block(num_blocks, block_size, host_blocks, steps):
    """Random admissions of prompts drawn from a few shared prefixes, growth and frees under a small GPU
    pool: the host pool stays within capacity, a block is cached in one tier at a time, hits are a GPU
    chain then a host chain, loaded blocks are the admitted sequence's, and reference counts hold."""
    kv = tiered(num_blocks, block_size, host_blocks)
    live: list[Sequence] = []
    for rid, (op, pick, n) in enumerate(steps):
        if op == "admit":
            ids = np.arange(pick % 3, pick % 3 + 1 + n // 8)  # overlapping prefixes
            s = Sequence(rid, 0.0, n * 3, 1 + pick % 5, prefix_ids=ids, hash_block=8)
            hits = kv.match_prefix(s)
            kinds = [type(h) is tuple for h in hits]
            assert kinds == sorted(kinds), "GPU hits, then the host's"
            todo = s.prompt_tokens - len(hits) * block_size
            kv.loads = []
            if kv.can_admit(s, todo, hits):
                kv.admit(s, todo, hits)
                assert s.num_computed_tokens == len(hits) * block_size
                assert kv.loads == s.block_table[kinds.index(True):len(hits)] if any(kinds) else kv.loads == []
                s.num_computed_tokens = s.prompt_tokens
                kv.register(s)
                live.append(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            if s.num_computed_tokens < s.max_kv_tokens and kv.can_grow(s, 1):
                kv.grow(s, 1)
                s.num_computed_tokens += 1
        elif op == "free" and live:
            kv.free(live.pop(pick % len(live)))
        check_tier(kv, live)
    assert kv.tier.num_loaded <= kv.tier.num_stored


def test_a_load_is_priced_over_the_host_link():
    from sim.catalog import GPUS, MODELS
    from sim.config import RooflineConfig
    from sim.steptime import RooflineStepTime

    st_ = RooflineStepTime(MODELS["mistral-7b"], GPUS["h100"], 1, RooflineConfig(), paged=True)
    kw = dict(num_seqs=1, num_tokens=100, num_prefill_tokens=100, num_decode_tokens=0, num_sampled=1,
              decode_context_tokens=0, prefill_attention_pairs=100 * 101 // 2, block_size=16, paged=True)
    base = st_.step_time_s(StepPlan(**kw))
    loaded = st_.step_time_s(StepPlan(**kw, host_loads=tuple(range(50))))
    assert loaded - base == pytest.approx(st_.load_s(50, 16))
    # 50 blocks of 16 tokens x 128 KiB per token over 64 GB/s, plus one batched copy per layer for K and V
    assert st_.load_s(50, 16) == pytest.approx(50 * 16 * 131072 / 64e9 + 2 * 32 * RooflineConfig().swap_copy_overhead_s)
    assert st_.load_s(50, 16) < st_.swap_s(50, 16)  # a swap pays a copy per block and layer


def tier_scenario(**over):
    s = {"name": "tier", "model": "opt-13b", "gpu": "a100-40gb", "gpu_memory_utilization": 0.7,
         "workload": {"arrival": {"kind": "poisson", "rate": 20.0}, "lengths": "alpaca", "num_requests": 150,
                      "seed": 3, "shared_prefixes": {"lengths": [900, 1200, 1500, 600], "popularity": [1, 1, 1, 1]}},
         "policies": [{"preset": "vllm-v1", "name": "apc", "prefix_caching": True},
                      {"preset": "vllm-v1", "name": "tier", "prefix_caching": True, "kv_offload": {"cpu_gib": 4}},
                      {"preset": "vllm", "name": "tier-v0", "prefix_caching": True, "kv_offload": {"cpu_gib": 0.5}}]}
    s.update(over)
    return parse_scenario(s)


def test_the_tier_turns_prefills_into_loads(monkeypatch):
    calls = check_after_every_step(monkeypatch, lambda sched: check_tier(sched.kv, sched.running)
                                   if getattr(sched.kv, "tier", None) is not None else None)
    r = run(tier_scenario())
    apc, tier = r.policies["apc"].summary, r.policies["tier"].summary
    assert calls["n"] > 100
    assert "prefix_hit_rate_cpu" not in apc and apc["num_evicted_blocks"] > 0
    assert tier["prefix_hit_rate_cpu"] > 0 and tier["host_to_device_bytes"] > 0 and tier["device_to_host_bytes"] > 0
    assert tier["prefix_hit_rate_gpu"] + tier["prefix_hit_rate_cpu"] == pytest.approx(
        tier["prefix_hit_rate_tokens"], abs=0.05)  # all first admissions vs finished requests
    assert tier["prefill_tokens_saved"] > apc["prefill_tokens_saved"]
    assert tier["prefill_tokens_saved_cpu"] * 1 == tier["host_to_device_bytes"] / (
        r.policies["tier"].pool.kv_bytes_per_token)


def test_spans_match_stepping_with_the_tier():
    from test_engine import assert_same_requests

    s = tier_scenario()
    s = s.model_copy(update={"policies": s.policies[1:2]})  # chunked prefill, with a tier
    exact, fast = run(s.model_copy(update={"exact": True})), run(s)
    assert fast.policies["tier"].summary["prefix_hit_rate_cpu"] > 0
    for name in exact.policies:
        assert_same_requests(exact.policies[name].requests, fast.policies[name].requests)
        for key in ("prefix_hit_rate_gpu", "prefix_hit_rate_cpu", "host_to_device_bytes", "device_to_host_bytes",
                    "num_steps"):
            assert exact.policies[name].summary.get(key) == fast.policies[name].summary.get(key), (name, key)


def test_a_tier_smaller_than_a_block_is_a_clear_error():
    with pytest.raises(ScenarioError, match="kv_offload.cpu_gib .* holds no block"):
        run(tier_scenario(policies=[{"preset": "vllm", "prefix_caching": True, "kv_offload": {"cpu_gib": 1e-9}}]))
    # found when the policy is resolved: by `sim check`, and before a run simulates the policies before it
    from sim.policy import resolve_policy

    s = tier_scenario(policies=["vllm", {"preset": "vllm", "name": "t", "prefix_caching": True,
                                         "kv_offload": {"cpu_gib": 1e-9}}])
    with pytest.raises(ScenarioError, match="policy t: kv_offload.cpu_gib 1e-09 holds no block"):
        resolve_policy(s, s.model_spec(), s.gpu_spec(), s.policies[1])


def test_the_gpu_replay_refuses_the_tier():
    pytest.importorskip("torch")
    from gpu.executor import ReplayExecutors
    from sim.catalog import GPUS, MODELS
    from sim.policy import resolve_policy

    s = tier_scenario()
    policy = resolve_policy(s, MODELS["opt-13b"], GPUS["a100-40gb"], s.policies[1])
    with pytest.raises(ScenarioError, match="kv_offload .* is simulator-only"):
        ReplayExecutors("cpu", warmup=False)(s, MODELS["opt-13b"], GPUS["a100-40gb"], policy, None)
