"""Allocator properties (hypothesis): allocated + free = capacity, slabs never overlap, buddy merges
restore the pool, every block is free at the end."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.core import Sequence
from sim.kv import BlockPool, BuddyAllocator, ContiguousKv, FirstFitAllocator, PagedKv, Reservation

ops = st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 10_000)), min_size=1, max_size=120)


def check_slabs(alloc, live: dict[int, int]):
    """live: start -> rounded size. No overlap, inside the pool, and used + free = capacity."""
    spans = sorted((s, s + n) for s, n in live.items())
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, f"slabs overlap: {a0, a1} and {b0, b1}"
    assert all(0 <= s and e <= alloc.capacity for s, e in spans)
    free = alloc.free_runs()
    everything = sorted(spans + [(s, s + n) for s, n in free])
    pos = 0
    for s, e in everything:  # used and free runs tile [0, capacity) exactly
        assert s == pos
        pos = e
    assert pos == alloc.capacity


@pytest.mark.parametrize("cls", [BuddyAllocator, FirstFitAllocator])
@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 20_000), steps=ops)
def test_slab_allocator_invariants(cls, capacity, steps):
    alloc = cls(capacity)
    live: dict[int, int] = {}
    for do_alloc, size, pick in steps:
        if do_alloc or not live:
            can = alloc.can_allocate(size)
            start = alloc.allocate(size)
            assert (start is not None) == can
            if start is not None:
                live[start] = alloc.rounded(size)
                assert alloc.rounded(size) >= size
        else:
            start = sorted(live)[pick % len(live)]
            alloc.free(start)
            del live[start]
        check_slabs(alloc, live)
        assert alloc.used == sum(live.values())  # the allocator's own count, which ContiguousKv asserts on
    for start in list(live):
        alloc.free(start)
        del live[start]
    # everything merged back: the initial free runs
    assert alloc.free_runs() == cls(capacity).free_runs()


def test_buddy_roots_for_non_power_of_two_pool():
    b = BuddyAllocator(14400)
    assert b.roots == [(0, 13), (8192, 12), (12288, 11), (14336, 6)]
    assert b.rounded(1500) == 2048
    assert b.allocate(2048) == 12288  # smallest sufficient order first: the 2048 root
    assert b.allocate(2048) == 8192  # then the 4096 root splits
    assert b.allocate(8192) == 0
    assert b.allocate(4096) is None


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 200), block_size=st.sampled_from([1, 2, 16, 32]),
       steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(0, 1000)), max_size=80))
def test_paged_manager_accounting(num_blocks, block_size, steps):
    kv = PagedKv(BlockPool(num_blocks, block_size))
    seqs: list[Sequence] = []
    next_id = 0
    for op, n, pick in steps:
        if op == 0:  # admit a new sequence with an n-token prompt
            s = Sequence(next_id, 0.0, n, 1 + pick % 50)
            next_id += 1
            if kv.can_admit(s, n):
                kv.admit(s, n)
                s.num_computed_tokens = n
                seqs.append(s)
        elif op == 1 and seqs:  # grow one sequence by a token
            s = seqs[pick % len(seqs)]
            if s.num_computed_tokens < s.max_kv_tokens and kv.can_grow(s, 1):
                kv.grow(s, 1)
                s.num_computed_tokens += 1
        elif seqs:  # free one
            s = seqs.pop(pick % len(seqs))
            kv.free(s)
        held = [b for s in seqs for b in s.block_table]
        assert len(held) == len(set(held)), "a block has two owners"
        assert len(held) + kv.pool.num_free == num_blocks
        assert set(held).isdisjoint(kv.pool.free_blocks)
        assert kv.alloc == len(held) * block_size
        assert kv.capped == sum(min(len(s.block_table) * block_size, s.max_kv_tokens) for s in seqs)
        for s in seqs:
            assert len(s.block_table) * block_size >= s.num_computed_tokens
    for s in seqs:
        kv.free(s)
    assert sorted(kv.pool.free_blocks) == list(range(num_blocks))
    assert kv.alloc == 0 and kv.capped == 0


def test_slab_sizes():
    assert Reservation("max", 2048).tokens(100, 25) == 2048
    assert Reservation("pow2", 2048).tokens(100, 25) == 100 + 32  # the paper: true output 25 -> 32 reserved
    assert Reservation("pow2", 2048).tokens(1500, 600) == 2048  # capped at the max length
    assert Reservation("oracle", 2048).tokens(100, 25) == 125


@pytest.mark.parametrize("kind", ["max", "pow2", "oracle"])
def test_reservation_column_is_the_rule_per_request(kind):
    rng = np.random.default_rng(0)
    p, o = rng.integers(1, 4000, 500), rng.integers(1, 4000, 500)
    rule = Reservation(kind, 4096)
    assert rule.column(p, o).tolist() == [rule.tokens(a, b) for a, b in zip(p.tolist(), o.tolist())]


def test_contiguous_manager_buddy_rounding_is_counted():
    kv = ContiguousKv(BuddyAllocator(4096), Reservation("oracle", 2048))
    s = Sequence(0, 0.0, 100, 200)  # 300 slots -> a 512-slot buddy block
    assert kv.can_admit(s, 100)
    kv.admit(s, 100)
    assert (kv.alloc, kv.rounding, kv.capped) == (300, 212, 299)
    kv.free(s)
    assert (kv.alloc, kv.rounding, kv.capped) == (0, 0, 0)
    assert kv.allocator.free_runs() == [(0, 4096)]


@pytest.mark.parametrize("kind", ["stack", "fifo", "shared"])
def test_block_pool_is_compact_and_hands_out_blocks_in_its_order(kind):
    """A pool of 10^8 blocks costs nothing until used, and hands out ids exactly as one list that starts
    as range(num_blocks): the plain pool puts a freed table back at the front (a stack: the blocks just
    used are reused first), the FIFO and shared pools at the tail (the shared one a table tail first).
    Results' address maps depend on this order."""
    import random
    import tracemalloc

    from sim.kv import FifoBlockPool
    from sim.sharing import SharedBlockPool

    make = {"stack": BlockPool, "fifo": FifoBlockPool, "shared": SharedBlockPool}[kind]
    tracemalloc.start()
    big = make(10**8, 16)
    held = big.allocate(1000)
    big.free(held[:500])
    assert tracemalloc.get_traced_memory()[1] < 2_000_000 and big.num_free == 10**8 - 500
    tracemalloc.stop()
    rng = random.Random(5)
    pool, ref, held = make(64, 16), list(range(64)), []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            out = held.pop(rng.randrange(len(held)))
            pool.free(out)
            if kind == "stack":
                ref[:0] = out
            else:
                ref.extend(reversed(out) if kind == "shared" else out)
        else:
            n = rng.randint(0, len(ref))
            assert pool.allocate(n) == ref[:n]
            held.append(ref[:n])
            del ref[:n]
        assert pool.free_blocks == ref and pool.num_free == len(ref)
        assert pool.can_allocate(len(ref)) and not pool.can_allocate(len(ref) + 1)


def test_block_ids_are_the_ids_shared_below_the_cap():
    """Never-used blocks' ids come from one table of int objects shared by every pool (a fleet's replicas
    hold the same objects); above the table's cap they are made as handed out. Either way, the values."""
    from sim import kv

    cap = kv._IDS_MAX
    for lo, hi in [(0, 0), (0, 5), (3, 2000), (cap - 3, cap + 4), (cap + 10, cap + 12), (7, 7)]:
        assert kv.block_ids(lo, hi) == list(range(lo, hi))
    a, b = BlockPool(4000, 16), BlockPool(4000, 16)
    assert all(x is y for x, y in zip(a.allocate(3000), b.allocate(3000)))


@pytest.mark.parametrize("kind", ["stack", "fifo", "shared"])
def test_a_block_freed_twice_fails_where_it_is_freed(kind):
    """The runtime invariants (plain asserts, as vLLM's): a double free is caught at the free, not
    steps later as a block with two owners. The shared pool counts holders per block; the plain pool
    only knows how many it lent (PagedKv's check below catches the rest)."""
    from sim.kv import FifoBlockPool
    from sim.sharing import SharedBlockPool

    pool = {"stack": BlockPool, "fifo": FifoBlockPool, "shared": SharedBlockPool}[kind](8, 16)
    blocks = pool.allocate(3 if kind == "shared" else 1)
    pool.free(blocks[:1])
    with pytest.raises(AssertionError):
        pool.free(blocks[:1])


def test_paged_manager_catches_a_block_lost_or_freed_behind_its_back():
    pool = BlockPool(8, 4)
    kv = PagedKv(pool)
    seq = Sequence(0, 0.0, 10, 5)
    kv.admit(seq, 10)
    pool.allocate(1)  # a block lent that no table holds
    with pytest.raises(AssertionError, match="KV accounting"):
        kv.free(seq)
    kv, seq = PagedKv(BlockPool(8, 4)), Sequence(1, 0.0, 10, 5)
    kv.admit(seq, 10)
    kv.pool.free(seq.block_table[:1])  # the pool got back a block that a table still holds
    with pytest.raises(AssertionError, match="freed twice"):
        kv.free(seq)


def test_slab_freed_twice_fails():
    alloc = BuddyAllocator(1024)
    start = alloc.allocate(100)
    alloc.free(start)
    with pytest.raises(KeyError):
        alloc.free(start)
