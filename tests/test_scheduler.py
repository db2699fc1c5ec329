"""Scheduler behaviour on tiny pools, driven step by step."""

import dataclasses

import pytest

from sim.catalog import GPUS, MODELS
from sim.config import RooflineConfig, parse_scenario
from sim.core import Sequence
from sim.kv import KvPool
from sim.metrics import Recorder
from sim.policy import make_kv, resolved
from sim.workload import RequestTable
from sim.scheduler import Scheduler
from sim.steptime import RooflineStepTime

OPT = MODELS["opt-13b"]


def policy(entry):
    return parse_scenario({"name": "x", "model": "opt-13b", "gpu": "a100-40gb",
                           "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 1},
                           "policies": [entry]}).policies[0]


def make(entry, num_blocks, block_size=4, swap_blocks=None, budget=4096):
    entry = {"preset": entry} if isinstance(entry, str) else entry
    p = policy({**entry, "block_size": block_size})
    pool = KvPool(num_blocks, block_size, OPT.kv_bytes_per_token(), 0, 0, 0)
    r = dataclasses.replace(resolved(p, pool, OPT), max_num_batched_tokens=budget, swap_blocks=swap_blocks)
    kv = make_kv(r)
    return Scheduler(r, kv, Recorder(RequestTable([], [], []), kv.capacity))


def drive(s: Scheduler, steps: int, on_plan=None):
    t = 0.0
    for _ in range(steps):
        plan = s.schedule()
        if plan is None:
            break
        if on_plan:
            on_plan(plan)
        t += 1.0
        s.complete(t)
    return t


def test_fastertransformer_new_requests_wait_for_the_whole_batch():
    s = make("fastertransformer", num_blocks=1024, block_size=4)  # 4096 slots: two 2048-token slabs
    a, b, c = Sequence(0, 0, 10, 2), Sequence(1, 0, 10, 5), Sequence(2, 0, 10, 1)
    for q in (a, b, c):
        s.add(q)
    plans = []
    drive(s, 5, plans.append)
    assert plans[0].seq_ids == (0, 1) and plans[0].num_new_tokens == (10, 10)  # memory fits two slabs
    assert all(2 not in p.seq_ids for p in plans[:5])  # c waits while b still runs, though a is done
    assert s.kv.held == 0 and not s.batch  # batch over after b's 5th token
    done = dict((q.seq_id, t) for q, t in s.done)
    assert done[0] == done[1] == 5.0  # results of a static batch return together
    plan = s.schedule()
    assert plan.seq_ids == (2,)


def test_vllm_preempts_the_newest_and_recompute_reprefills():
    s = make({"preset": "vllm", "allocator": {"watermark": 0.0}}, num_blocks=4, block_size=4)
    old, new = Sequence(0, 0, 6, 8), Sequence(1, 0.5, 6, 8)
    s.add(old)
    s.add(new)
    plans = []
    drive(s, 4, plans.append)
    assert plans[0].seq_ids == (0, 1)  # both prompts in one prefill step: 2 blocks each, pool full
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    pre = next(p for p in plans if p.num_preempted)
    assert pre.seq_ids == (0,)
    # the preempted request lost its blocks and waits at the front, to re-prefill prompt + generated
    assert new.block_table == [] and new.num_computed_tokens == 0 and s.waiting[0] is new
    generated = new.num_output_tokens
    assert generated >= 1
    while s.running:
        drive(s, 1)
    plan = s.schedule()
    assert plan.seq_ids == (1,) and plan.num_new_tokens == (6 + generated,)


@pytest.mark.parametrize("num_blocks, found", [(7, 3), (6, 2)])
def test_with_prefix_caching_a_recomputed_request_finds_the_blocks_it_computed(num_blocks, found):
    """vLLM caches every full block, generated tokens included: a request preempted by recompute finds
    again what the pool has not evicted meanwhile (no content ids here: only it can find them). With 6
    blocks the survivor's growth evicts the victim's last block (freed first), so 2 of its 3 come back."""
    plans = {}
    for caching in (False, True):
        s = make({"preset": "vllm", "allocator": {"watermark": 0.0}, "prefix_caching": caching},
                 num_blocks=num_blocks, block_size=4)
        old, new = Sequence(0, 0, 6, 10 if num_blocks == 6 else 8), Sequence(1, 0.5, 6, 8)
        s.add(old)
        s.add(new)
        seen, registered = [], []

        def on_plan(plan):
            seen.append(plan)
            if plan.num_preempted:  # just preempted: it registers what it computes again from its first block
                registered.append(new.num_registered)

        drive(s, 40, on_plan)
        assert new.num_preemptions == 1 and old.num_preemptions == 0 and registered == [0]
        after = seen[next(i for i, p in enumerate(seen) if p.num_preempted) + 1:]
        back = next(p for p in after if p.seq_ids == (1,))  # its first step after the preemption
        plans[caching] = back.num_new_tokens[0]
        saved = s.rec.prefill_tokens_saved
    assert plans[False] == 6 + 7  # prompt + generated, all recomputed without the cache
    assert saved == found * 4 and plans[True] == plans[False] - saved


@pytest.mark.parametrize("preset, hit", [("vllm-v1", 8), ("vllm", 0)])
def test_v1_caches_blocks_as_it_schedules_them(preset, hit):
    """Two requests with the same 10-token prompt, admitted in one step. vLLM v1 caches a step's full blocks
    when it schedules them, so the second finds the first's two blocks at once (it computes 2 of its 10
    tokens); v0 marks them computed after the step, so both prefill everything."""
    import numpy as np

    s = make({"preset": preset, "allocator": {"watermark": 0.0}, "prefix_caching": True}, num_blocks=16,
             block_size=4)
    a, b = (Sequence(i, 0.0, 10, 3, prefix_ids=np.array([7, 8, 9]), hash_block=4) for i in range(2))
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.seq_ids == (0, 1) and plan.num_new_tokens == (10, 10 - hit)
    assert b.prefix_hit_tokens == hit and s.rec.prefill_tokens_saved == hit


def test_swap_moves_blocks_out_and_back_and_costs_transfer_time():
    s = make({"preset": "vllm", "preemption": "swap", "allocator": {"watermark": 0.0}}, num_blocks=4, block_size=4,
             swap_blocks=8)
    old, new = Sequence(0, 0, 6, 8), Sequence(1, 0.5, 6, 8)
    s.add(old)
    s.add(new)
    plans = []
    drive(s, 4, plans.append)
    pre = next(p for p in plans if p.num_preempted)
    assert len(pre.swap_out) == 2 and s.swapped == [new] and new.num_computed_tokens > 0
    assert s.preemption.swap_pool.num_free == 6
    while s.running:
        drive(s, 1, plans.append)
    plan = s.schedule()
    assert plan.seq_ids == (1,) and len(plan.swap_in) == 2 and plan.num_new_tokens == (1,)  # no recompute
    assert s.preemption.swap_pool.num_free == 8
    model = RooflineStepTime(OPT, GPUS["a100-40gb"], 1, RooflineConfig(), paged=True)
    from dataclasses import replace
    bare = replace(plan, swap_in=())
    extra = model.step_time_s(plan) - model.step_time_s(bare)
    per_block = 4 * OPT.kv_bytes_per_token() / GPUS["a100-40gb"].host_bytes_per_s + 2 * 40 * 5e-6
    assert extra == pytest.approx(2 * per_block)


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    s = make({"preset": "vllm", "preemption": "swap", "allocator": {"watermark": 0.0}}, num_blocks=4, block_size=4,
             swap_blocks=1)
    old, new = Sequence(0, 0, 6, 8), Sequence(1, 0.5, 6, 8)
    s.add(old)
    s.add(new)
    drive(s, 4)
    assert new.num_preemptions == 1 and not s.swapped and s.waiting[0] is new and new.num_computed_tokens == 0


def test_chunked_prefill_splits_prompts_under_the_token_budget():
    s = make("vllm-v1", num_blocks=100, block_size=4, budget=8)
    a, b = Sequence(0, 0, 20, 3), Sequence(1, 0, 5, 3)
    s.add(a)
    s.add(b)
    plans = []
    drive(s, 3, plans.append)
    assert plans[0].num_new_tokens == (8,) and plans[0].num_sampled == 0
    assert plans[1].num_new_tokens == (8,)
    assert plans[2].num_new_tokens == (4, 4) and plans[2].seq_ids == (0, 1)  # a finishes its prompt, b starts


def test_vllm_v1_preempts_a_chunk_that_cannot_grow_when_it_is_the_newest():
    """A prefill chunk that finds no free block, with no newer unscheduled request to preempt, is itself
    preempted (vLLM v1: ``running.pop()`` returns it; its blocks freed, back to waiting), as a decode is.
    It used to be parked, keeping its blocks: 12 preemptions where vLLM v1 makes 55. The counts are those
    of an independent re-implementation of v1's schedule() loop on the same requests (10 blocks of 16,
    a budget of 32 tokens, every request at t = 0)."""
    s = make("vllm-v1", num_blocks=10, block_size=16, budget=32)
    seqs = [Sequence(i, 0.0, p, o) for i, (p, o) in enumerate(
        [(54, 6), (34, 66), (63, 52), (39, 62), (46, 75), (28, 65), (18, 37), (18, 13)])]
    for q in seqs:
        s.add(q)
    plans = []
    drive(s, 1000, plans.append)
    assert [(p.num_tokens, p.num_seqs) for p in plans[:7]] == [(32, 1), (32, 2), (32, 3), (32, 3), (2, 2), (32, 3), (2, 2)]
    assert len(plans) == 237 and sum(q.num_preemptions for q in seqs) == 55
    assert all(q.num_output_tokens == q.output_tokens for q in seqs)


def test_orca_mixes_whole_prompts_with_decodes():
    s = make("orca-oracle-mixed", num_blocks=1000, block_size=4)  # Orca as its own paper runs it
    a = Sequence(0, 0, 10, 5)
    s.add(a)
    drive(s, 1)
    b = Sequence(1, 1, 7, 5)
    s.add(b)
    plan = s.schedule()
    assert plan.seq_ids == (0, 1) and plan.num_new_tokens == (1, 7)


@pytest.mark.parametrize("preset", ["vllm", "orca-oracle"])  # the paper's Orca shares vLLM's scheduler
def test_vllm_v0_prefill_step_pauses_decodes(preset):
    s = make(preset, num_blocks=1000, block_size=4)
    a = Sequence(0, 0, 10, 5)
    s.add(a)
    drive(s, 1)
    s.add(Sequence(1, 1, 7, 5))
    plan = s.schedule()
    assert plan.seq_ids == (1,) and plan.num_new_tokens == (7,)


def test_queue_membership_is_asserted_where_a_sequence_moves():
    """A sequence is in exactly one queue: adding one twice, or finishing one twice, fails at once
    (a plain assert on its state), not as a corrupted count later."""
    from sim.core import DONE, RUNNING, WAITING

    s = make("vllm", num_blocks=64)
    a = Sequence(0, 0, 10, 3)
    s.add(a)
    assert a.state == WAITING
    with pytest.raises(AssertionError, match="added twice"):
        s.add(a)
    drive(s, 1)  # its prefill
    assert a.state == RUNNING and a.clock is s.clock  # decoding: on the clock
    drive(s, 10)
    assert a.state == DONE and s.done
    with pytest.raises(AssertionError, match="finishes from state"):
        s._finish([a], 99.0)


def test_the_schedulers_plans_are_the_plans_their_fields_make():
    # the scheduler builds each plan positionally: a field out of order would show here
    from sim.core import StepPlan
    s = make("vllm", num_blocks=100, block_size=4)
    s.add(Sequence(0, 0, 6, 3))
    plans = []
    drive(s, 3, plans.append)
    names = [f.name for f in dataclasses.fields(StepPlan)]
    values = [1, 2, 3, 4, 5, 6, 7, 8, True, ((9, 9),), ((10, 10),), ((11, 11),), ((12, 12, 12),), ((13, 13),), 14,
              (15,), [16], {"note": 17}, (18,), 19]
    assert [getattr(StepPlan(*values), n) for n in names] == values  # positional order = field order
    assert len(plans) == 3
    for p in plans:
        assert p == StepPlan(**{n: getattr(p, n) for n in names})  # the same plan keywords would make
    prefill, decode = plans[0], plans[1]
    assert (prefill.num_seqs, prefill.num_tokens, prefill.num_prefill_tokens, prefill.num_decode_tokens,
            prefill.num_sampled, prefill.decode_context_tokens, prefill.prefill_attention_pairs,
            prefill.block_size, prefill.paged, prefill.num_preempted) == (1, 6, 6, 0, 1, 0, 21, 4, True, 0)
    assert [(x.seq_id, n) for x, n in prefill._entries] == [(0, 6)] and prefill._decoding == ()
    assert prefill._contexts is None and prefill.extra == {}
    assert (decode.num_seqs, decode.num_tokens, decode.num_decode_tokens, decode.decode_context_tokens,
            decode.num_sampled) == (1, 1, 1, 7, 1)
    assert decode._decoding is s.clock.members and decode._entries == []  # the live decode group, not a copy
    assert decode._contexts is not None
    for p in plans:
        assert p.swap_out == p.swap_in == p.copy_blocks == p.copy_slots == p.forks == p.host_loads == ()


def test_a_swap_out_of_a_block_a_copy_fills_this_step_takes_the_copys_source():
    from sim.scheduler import before_copies

    copies = [(5, 9), (7, 8)]  # 9 <- 5 and 8 <- 7 this step
    assert before_copies([(9, 100), (3, 101)], copies) == [(5, 100), (3, 101)]
    assert copies == [(7, 8)]  # the copy into the freed block is dropped, the other kept
    copies = [(7, 8)]
    assert before_copies([(1, 100)], copies) == [(1, 100)] and copies == [(7, 8)]
