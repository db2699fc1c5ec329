"""Block sharing: reference counts, the prefix cache, forks and copy-on-write, beams."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import needs_plain_python
import sim.sharing as sharing
from sim import run
from sim.core import Sequence
from sim.policy import Preemption
from sim.scheduler import Scheduler
from sim.sharing import SharedBlockPool, SharedPagedKv, block_identities


def holders(seqs) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in seqs:
        for b in s.block_table:
            out[b] = out.get(b, 0) + 1
    return out


def check_pool(kv: SharedPagedKv, seqs) -> None:
    """Reference counts equal holders; the free queue holds exactly the unheld blocks; a cached block
    is findable only under its own key; memory accounting is physical."""
    pool, h = kv.pool, holders(seqs)
    free = pool.free_blocks
    assert len(free) == len(set(free)) == pool.num_free
    free = set(free)
    # every block: its count is its holders (0 for none), and it is free exactly when no one holds it;
    # as whole-dict and whole-set comparisons (this runs after every step), per block only to say which
    if dict(pool.ref_cnt) != h or free != set(range(pool.num_blocks)) - h.keys():
        for b in range(pool.num_blocks):
            assert pool.ref_cnt[b] == h.get(b, 0), f"block {b}: ref {pool.ref_cnt[b]} vs {h.get(b, 0)} holders"
            assert (b in free) == (h.get(b, 0) == 0), f"block {b}: free {b in free}, {h.get(b, 0)} holders"
        assert set(pool.ref_cnt) == set(h), "the counts hold exactly the held blocks"
        assert free <= set(range(pool.num_blocks)), f"free ids outside the pool: {free - set(range(pool.num_blocks))}"
    for hsh, b in pool.cache.items():
        assert pool.key[b] is not None and pool.key[b][0] == hsh
    assert kv.alloc == len(h) * kv.block_size
    assert kv.shared_blocks == sum(n - 1 for n in h.values())


def test_block_identities_map_512_token_ids_to_sub_blocks():
    ids = np.array([7, 8])
    idents = block_identities(ids, 512, 16, 1000)  # 62 full blocks, 32 per id; the partial tail is not
    assert len(idents) == 62 and idents[0] == (7, 0) and idents[31] == (7, 496) and idents[32] == (8, 0)
    # a block size that does not divide 512 names both segments it straddles
    odd = block_identities(ids, 512, 48, 1000)
    assert odd[10] == ((7, 8), 480) and odd[11] == (8, 16)


def test_a_hash_collision_is_a_miss_not_a_wrong_block():
    pool = SharedBlockPool(8, 16)
    pool.register(3, 42, ("a", 0), None)
    assert pool.lookup(42, ("a", 0), None) == 3
    assert pool.lookup(42, ("b", 0), None) is None  # same hash, other tokens
    assert pool.lookup(42, ("a", 0), 5) is None  # same block tokens after another prefix


ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "fork", "free", "beam", "swap", "recompute"]),
                         st.integers(0, 10_000), st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(8, 80), block_size=st.sampled_from([1, 4, 16]), steps=ops,
       shared_ids=st.booleans())
def test_reference_counts_equal_holders(num_blocks, block_size, steps, shared_ids):
    kv = SharedPagedKv(SharedBlockPool(num_blocks, block_size), caching=True)
    swap = Preemption("swap", 200, block_size)  # owns the swap space
    live: list[Sequence] = []
    swapped: list[list[Sequence]] = []
    rid = 0
    for op, pick, n in steps:
        if op == "admit":
            prompt = n * 3
            ids = np.arange(prompt // 8 + 1) if shared_ids else np.arange(prompt // 8 + 1) + 1000 * rid
            s = Sequence(rid, 0.0, prompt, 1 + pick % 20, prefix_ids=ids, hash_block=8)
            rid += 1
            hits = kv.match_prefix(s)
            for a, b in zip(hits, hits[1:]):
                assert kv.pool.key[b][2] == a  # a hit is a chain of its own prefix
            todo = prompt - len(hits) * block_size
            if kv.can_admit(s, todo, hits):
                kv.admit(s, todo, hits)
                assert s.num_computed_tokens == len(hits) * block_size
                s.num_computed_tokens = prompt
                kv.register(s)
                live.append(s)
        elif op == "grow" and live:
            s = live[pick % len(live)]
            if s.num_computed_tokens < s.max_kv_tokens and kv.can_grow(s, 1):
                kv.grow(s, 1)
                s.num_computed_tokens += 1
        elif op == "fork" and live:
            p = live[pick % len(live)]
            c = Sequence(p.request_id, 0.0, p.prompt_tokens, p.output_tokens, seq_id=10_000 + rid)
            rid += 1
            c.num_computed_tokens = p.num_computed_tokens
            kv.fork(p, c)
            live.append(c)
        elif op == "free" and live:
            kv.free(live.pop(pick % len(live)))
        elif op == "recompute" and live and live[pick % len(live)].seq_id < 10_000:  # (not a fork)
            s = live.pop(pick % len(live))
            grow = min(n, s.max_kv_tokens - s.num_computed_tokens)  # it decodes a while first
            if grow > 0 and kv.can_grow(s, grow):
                kv.grow(s, grow)
                s.num_computed_tokens += grow
            done = s.num_computed_tokens
            s.num_output_tokens = max(0, done - s.prompt_tokens + 1)  # what computing ``done`` tokens sampled
            kv.keep(s)  # preempted by recompute: every full block it computed stays findable once freed
            kv.free(s)
            s.num_computed_tokens = s.num_registered = 0
            check_pool(kv, live)
            hits = kv.match_prefix(s)
            chain = sharing.extend_block_hashes(s, block_size, 0)
            assert len(hits) <= min(done // block_size, (s.num_tokens - 1) // block_size)
            for i, b in enumerate(hits):  # its own blocks, in its own order
                assert kv.pool.key[b][:3] == (chain[i][0], chain[i][1], hits[i - 1] if i else None)
            todo = s.num_tokens - len(hits) * block_size
            if kv.can_admit(s, todo, hits):
                kv.admit(s, todo, hits)
                s.num_computed_tokens = s.num_tokens
                kv.register(s)
                live.append(s)
        elif op == "beam" and len(live) >= 2:
            a, b = live[pick % len(live)], live[(pick + 1) % len(live)]
            if len(a.block_table) == len(b.block_table) and a is not b:
                a.num_computed_tokens = b.num_computed_tokens
                kv.reassign([(a, b)])
        elif op == "swap" and live:
            group = [live.pop(pick % len(live))]
            if swap.swap_out(kv, group, group=True) is not None:
                swapped.append(group)
            elif swapped and swap.can_swap_in_group(kv, swapped[0]):
                back = swapped.pop(0)
                swap.swap_in_group(kv, back)
                live.extend(back)
            else:
                kv.free(group[0])
        check_pool(kv, live)
    for s in live:
        kv.free(s)
    check_pool(kv, [])
    assert kv.shared_filled == 0 and kv.capped == 0


@pytest.mark.parametrize("shared", [1, 2])
def test_a_chain_continuing_from_a_duplicate_block_stays_findable(shared):
    """A and B compute the same named blocks at once (neither finds the other's): only A's copies are
    cached. B's own later blocks chained to B's uncached copies could never be reached by a lookup (it
    walks A's); they now chain to the copies a lookup reaches, so B, recomputed, finds all four (A's first
    block is block 0, which a truth test once took for "none")."""
    kv = SharedPagedKv(SharedBlockPool(64, 4), caching=True)
    a, b = (Sequence(i, 0.0, 10, 20, prefix_ids=np.arange(shared), hash_block=4) for i in range(2))
    for s in (a, b):
        assert kv.match_prefix(s) == []
        kv.admit(s, 10)
    for s in (a, b):
        s.num_computed_tokens, s.num_output_tokens = 10, 1
        kv.register(s)
    for _ in range(9):  # b decodes to 19 computed tokens: 4 full blocks
        kv.grow(b, 1)
        b.num_computed_tokens += 1
        b.num_output_tokens += 1
    mine = list(b.block_table)
    kv.keep(b)
    kv.free(b)
    b.num_computed_tokens = b.num_registered = 0
    assert a.block_table[0] == 0 and kv.match_prefix(b) == a.block_table[:shared] + mine[shared:4]


def test_a_recomputed_request_caches_again_what_it_computes_again():
    """A is preempted (its blocks kept), then its tail is evicted while it waits. Coming back it computes
    those blocks again, and they must be cached again: its count of registered blocks had stayed at the
    old number, so a request with the same prompt found 2 of A's 4 blocks."""
    kv = SharedPagedKv(SharedBlockPool(8, 4), caching=True)
    a = Sequence(0, 0.0, 17, 5, prefix_ids=np.arange(4), hash_block=4)
    kv.admit(a, 17)
    a.num_computed_tokens = 17
    kv.register(a)
    a.num_registered = 0
    kv.keep(a)
    kv.free(a)
    a.num_computed_tokens = a.num_registered = 0  # as Scheduler._preempt leaves it (test_scheduler.py checks)
    z = Sequence(9, 0.0, 24, 5)
    kv.admit(z, 24)  # takes 6 blocks: A's last two are evicted
    hits = kv.match_prefix(a)
    assert len(hits) == 2
    kv.free(z)
    kv.admit(a, 17 - 8, hits)
    a.num_computed_tokens = 17
    kv.register(a)
    c = Sequence(1, 0.0, 17, 5, prefix_ids=np.arange(4), hash_block=4)
    assert kv.match_prefix(c) == a.block_table[:4]


def test_a_cached_block_is_never_evicted_while_held():
    kv = SharedPagedKv(SharedBlockPool(6, 4), caching=True)
    a = Sequence(0, 0.0, 9, 5, prefix_ids=np.array([1, 2]), hash_block=8)
    kv.admit(a, 9)
    a.num_computed_tokens = 9
    kv.register(a)  # two full blocks cached, held by a
    b = Sequence(1, 0.0, 9, 5, prefix_ids=np.array([1, 2]), hash_block=8)
    hits = kv.match_prefix(b)
    assert hits == a.block_table[:2]
    kv.admit(b, 1, hits)  # shares both blocks, one more of its own
    assert kv.pool.ref_cnt[hits[0]] == 2
    kv.pool.allocate(kv.pool.num_free)  # take every free block: held cached blocks survive
    assert kv.pool.lookup(*kv.pool.key[hits[0]][:3]) == hits[0]  # (hash, identity, parent block)


def scenario(make_scenario, policies, sampling=None, **wl):
    w = {"arrival": {"kind": "poisson", "rate": 25.0}, "lengths": "alpaca", "num_requests": 200, "seed": 2,
         "shared_prefixes": {"lengths": [64, 200], "popularity": [3, 1]}}
    w.update(wl)
    return make_scenario(workload=w, policies=policies, sampling=sampling)


CACHING = [{"preset": "vllm", "name": "apc", "prefix_caching": True},
           {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True},
           {"preset": "vllm", "name": "apc-swap", "prefix_caching": True, "preemption": "swap"}]


@pytest.mark.parametrize("sampling", [None, {"kind": "parallel", "n": 3}, {"kind": "beam", "width": 3}])
def test_sharing_keeps_every_requests_tokens_and_accounting(make_scenario, sampling):
    s = scenario(make_scenario, ["vllm", "orca-oracle", "fastertransformer"] + CACHING, sampling)
    r = run(s)
    width = 1 if sampling is None else sampling.get("n", sampling.get("width"))
    for name, res in r.policies.items():
        df, m = res.requests, res.summary
        assert m["num_finished"] + m["num_rejected"] + m["num_unfinished"] == 200
        assert m["num_finished"] == 200, name
        assert (df.generated_tokens == df.output_tokens * width).all(), name
    if sampling is None:  # shared system prompts: the cache hits, prefill shrinks
        assert r.policies["apc"].summary["prefix_hit_rate_tokens"] > 0.2
        assert r.policies["apc"].summary["prefill_tokens_saved"] > 0
    else:
        assert r.policies["vllm"].summary["memory_saved_by_sharing"] > 0.02
        assert r.policies["orca-oracle"].summary["memory_saved_by_sharing"] == 0.0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_group_preempting_all_that_ran_admits_in_the_same_step(make_scenario, preemption):
    # two requests of 48 samples each: the first group's decodes outgrow the pool, and preempting it (a
    # group goes as a unit) leaves nothing running. That step used to plan nothing, which the engine
    # took for a stalled scheduler (a RuntimeError); now it admits what the next step would.
    s = make_scenario(model="llama-2-7b", gpu="a100-40gb", sampling={"kind": "parallel", "n": 48},
                      workload={"arrival": {"kind": "poisson", "rate": 5.0}, "prompt": {"kind": "fixed", "tokens": 1000},
                                "output": {"kind": "fixed", "tokens": 500}, "num_requests": 2, "seed": 0},
                      policies=[{"preset": "vllm", "preemption": preemption}])
    m = run(s).policies["vllm"].summary
    assert m["num_finished"] == 2 and m["num_preemptions"] > 0


@pytest.mark.parametrize("sampling", [None, {"kind": "parallel", "n": 4}, {"kind": "beam", "width": 4}])
def test_spans_match_stepping_with_sharing(make_scenario, sampling):
    from test_engine import assert_same_requests

    s = scenario(make_scenario, ["vllm", "orca-pow2"] + CACHING, sampling, num_requests=150)
    exact, fast = run(s.model_copy(update={"exact": True})), run(s)
    for name in exact.policies:
        assert_same_requests(exact.policies[name].requests, fast.policies[name].requests)
        for key in ("memory_saved_by_sharing", "num_cow_copies", "prefix_hit_rate_tokens"):
            assert exact.policies[name].summary.get(key) == pytest.approx(fast.policies[name].summary.get(key))


def test_invariants_after_every_step_with_sharing(make_scenario, monkeypatch):
    needs_plain_python("checking after every step")
    orig_c, orig_s = Scheduler.complete, Scheduler.complete_span
    seen = {"steps": 0}

    def check(self):
        if isinstance(self.kv, SharedPagedKv):
            check_pool(self.kv, self.running)
        assert sum(self.memory()) == self.kv.capacity
        seen["steps"] += 1

    monkeypatch.setattr(Scheduler, "complete", lambda self, t: (orig_c(self, t), check(self))[0])
    monkeypatch.setattr(Scheduler, "complete_span", lambda self, e: (orig_s(self, e), check(self))[0])
    for sampling in ({"kind": "parallel", "n": 3}, {"kind": "beam", "width": 3}, None):
        r = run(scenario(make_scenario, CACHING + [{"preset": "vllm", "name": "tiny-swap", "swap_space_gib": 0.02}],
                         sampling, num_requests=120, arrival={"kind": "poisson", "rate": 60.0}))
        assert any(res.summary["num_preemptions"] for res in r.policies.values())
    assert seen["steps"] > 500


def test_identity_checks_make_hash_collisions_harmless(make_scenario, monkeypatch):
    """With every block hashing alike, a hit still needs the same tokens after the same prefix: every
    block a request reuses carries exactly the identity chain it asked for."""
    orig = SharedPagedKv.match_prefix
    checked = {"blocks": 0}

    def verified(self, seq):
        hits = orig(self, seq)
        wanted = sharing.prompt_block_hashes(seq, self.block_size)
        for i, b in enumerate(hits):
            assert self.pool.key[b][1] == wanted[i][1]  # its own tokens...
            assert self.pool.key[b][2] == (hits[i - 1] if i else None)  # ...after its own prefix
            checked["blocks"] += 1
        return hits

    monkeypatch.setattr(SharedPagedKv, "match_prefix", verified)
    s = scenario(make_scenario, CACHING[:1], num_requests=120)
    normal = run(s)
    monkeypatch.setattr(sharing, "hash", lambda x: 0, raising=False)
    colliding = run(s)
    assert checked["blocks"] > 100
    a, b = normal.policies["apc"].summary, colliding.policies["apc"].summary
    assert b["num_finished"] == 120
    assert b["prefix_hit_rate_tokens"] <= a["prefix_hit_rate_tokens"]  # one bucket: only its first chain hits


def _one_shape(make_scenario, n, output, policies, sampling, **extra):
    return make_scenario(sampling=sampling, policies=policies, workload={
        "arrival": {"kind": "poisson", "rate": extra.pop("rate", 1.0)}, "prompt": {"kind": "fixed", "tokens": 32},
        "output": {"kind": "fixed", "tokens": output}, "num_requests": n, "seed": 0}, **extra)


@pytest.mark.parametrize("sampling", [{"kind": "parallel", "n": 2}, {"kind": "beam", "width": 2}])
def test_samples_running_at_the_horizon_leave_their_request_unfinished(make_scenario, sampling):
    # forked members have ids past the requests': closing the run indexed the request log by them (IndexError)
    s = _one_shape(make_scenario, 1, 100, ["vllm", "orca-max"], sampling, horizon_s=1)
    for name, res in run(s).policies.items():
        assert res.summary["num_unfinished"] == 1 and res.summary["num_finished"] == 0, name
        assert res.requests.generated_tokens[0] > 2, name  # every member's tokens, counted on the request
    fleet = _one_shape(make_scenario, 1, 100, ["vllm"], sampling, horizon_s=1,
                       cluster={"replicas": 2, "router": "least-outstanding"})
    assert run(fleet).policies["vllm"].summary["num_unfinished"] == 1


def test_a_group_wider_than_max_num_seqs_is_a_clear_error(make_scenario):
    from sim.config import ScenarioError

    with pytest.raises(ScenarioError, match="max_num_seqs=1 is below the 2 sequences a request runs as"):
        run(_one_shape(make_scenario, 1, 8, [{"preset": "vllm", "max_num_seqs": 1}], {"kind": "parallel", "n": 2}))
    # a budget of 2 decoded a beam group of 4 two at a time, out of lockstep, without a word
    with pytest.raises(ScenarioError, match="max_num_batched_tokens=2 is below max_num_seqs=256: a step could not"):
        run(_one_shape(make_scenario, 1, 8, [{"preset": "vllm-v1", "max_num_batched_tokens": 2}],
                       {"kind": "beam", "width": 4}))


def test_a_contiguous_group_done_at_its_first_token_frees_its_samples_slabs(make_scenario):
    # the slabs reserved for samples that never forked leaked: a quarter of the pool after 4 tiny requests, and
    # a stalled scheduler after 8
    s = _one_shape(make_scenario, 8, 1, ["orca-max", "fastertransformer", "orca-oracle", "vllm"],
                   {"kind": "parallel", "n": 2})
    for name, res in run(s).policies.items():
        assert res.summary["num_finished"] == 8, name
        assert res.summary["memory.free"] > 0.95, name
        # each sample sampled its one token (the group never forked: it counted 1 token, not 2)
        assert (res.requests.generated_tokens == 2).all(), name


def test_a_readmitted_sample_does_not_move_its_requests_first_scheduling(make_scenario):
    # a forked sample preempted and recomputed was taken for its request's first admission: request 9 read
    # first scheduled at 4.9 s, after its first token at 0.07 s
    s = _one_shape(make_scenario, 10, 200, [{"preset": "vllm", "swap_space_gib": 0}], {"kind": "parallel", "n": 2},
                   rate=1000.0, gpu_memory_utilization=0.7)
    res = run(s).policies["vllm"]
    assert res.summary["num_preemptions"] > 0
    req = res.requests
    assert (req.first_scheduled_s <= req.first_token_s).all()
    assert res.summary["mean_scheduling_delay_ms"] < res.summary["mean_ttft_ms"]


@pytest.mark.parametrize("sampling", [{"kind": "beam", "width": 4, "keep_probability": 0.8, "seed": 1},
                                      {"kind": "parallel", "n": 4}])
def test_a_group_that_fills_the_pool_comes_back_after_a_swap(tmp_path, sampling):
    """Five blocks of 32 and two requests of 45 + 3 tokens in groups of 4: each alone needs all five (one
    shared prompt block, a block per member), so up-front admission takes them. The second is swapped out;
    swapping it back asked for a new block per member on top of its blocks, six, which never came: the
    scheduler stalled. Now it asks for what its next step needs."""
    import json

    from sim.config import parse_scenario

    cfg = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = parse_scenario({
        "name": "t", "model": str(tmp_path / "config.json"), "runtime_overhead_gib": 0,
        "activation_reserve_tokens": 64, "decompose": False,
        # (the activation reserve samples one logits row per token at most: 64, not 256, so 384 KiB less memory)
        "gpu": {"name": "tiny", "memory_gib": 0.0019993, "hbm_gb_per_s": 100, "tflops": 10},
        "workload": {"arrival": {"kind": "poisson", "rate": 1000}, "num_requests": 2, "seed": 2,
                     "prompt": {"kind": "fixed", "tokens": 45}, "output": {"kind": "fixed", "tokens": 3}},
        "policies": [{"preset": "vllm", "name": "p", "block_size": 32}], "sampling": sampling})
    res = run(s).policies["p"]
    assert res.summary["kv_capacity_tokens"] == 5 * 32
    assert res.summary["num_finished"] == 2 and res.summary["num_preemptions"] > 0
