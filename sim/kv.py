"""KV-cache memory: the pool size, a paged block pool, and contiguous slab allocators (buddy, first-fit).

Everything is placed for real. Block ``b`` of a pool of ``num_blocks`` blocks of ``block_size`` token
slots is slice ``b`` of the GPU KV tensor; a contiguous slab is a run of consecutive token slots::

    slot:   0        B        2B       3B            num_blocks*B
            |block 0 |block 1 |block 2 |  ...  |block N-1|
    slab:        [start ............ start+size)          (contiguous policies ignore block edges)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import numpy as np

try:  # a compiled build (sim/native.py): the managers below have subclasses in plain Python (sim/sharing.py, ...)
    from mypy_extensions import mypyc_attr
except ImportError:  # plain Python: nothing to allow
    def mypyc_attr(**_):  # type: ignore[misc]
        return lambda cls: cls

from sim.catalog import GIB, GpuSpec, ModelSpec
from sim.core import Sequence


# ------------------------------------------------------------------------------------------ pool size


class CapacityError(ValueError):
    """The model does not fit in the GPU memory the scenario allows."""


@dataclass(frozen=True)
class KvPool:
    """How one GPU's memory is split, and the resulting KV pool (per tensor-parallel rank)."""

    num_blocks: int
    block_size: int
    kv_bytes_per_token: int  # K and V, all layers, one rank
    budget_bytes: int  # gpu_memory_utilization x memory - runtime overhead
    weights_bytes: int
    activation_bytes: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_slots * self.kv_bytes_per_token


def weights_bytes(model: ModelSpec, tp: int) -> int:
    """One rank's share of the weights: a modern model's as stored (quantised experts at their own size),
    else its parameters in its dtype."""
    return int(model.weights_bytes_total) // tp if model.modern else model.num_params * model.dtype_bytes // tp


def activation_bytes(model: ModelSpec, tp: int, num_tokens: int, max_num_seqs: int) -> int:
    """Peak activation memory of one forward pass over ``num_tokens`` (what vLLM's profiling run measures):
    one layer's live tensors (hidden, residual, QKV, attention output, MLP intermediates) plus fp32 logits
    for the rows its dummy run samples: ``max_num_seqs`` (the policy's), at most one per token (vLLM V1's
    ``min(num_tokens, max_num_reqs)``). An estimate; the GPU backend measures the real figure."""
    h = model.hidden_size
    qkv = (model.num_heads + 2 * model.kv_heads_per_gpu(tp) * tp) * model.head_dim // tp
    mlp = (3 if model.gated_mlp else 2) * model.ffn_size // tp
    per_token = (3 * h + qkv + mlp) * model.dtype_bytes
    logits = min(max_num_seqs, num_tokens) * (model.vocab_size // tp) * 4
    return num_tokens * per_token + logits


def check_tensor_parallel(model: ModelSpec, tp: int) -> None:
    """Raise :class:`CapacityError` when ``model``'s attention heads do not split over ``tp`` GPUs."""
    if model.num_heads % tp:
        raise CapacityError(f"{model.name}: {model.num_heads} attention heads do not split over tensor_parallel={tp}")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise CapacityError(f"{model.name}: {model.num_kv_heads} KV heads do not split over tensor_parallel={tp}")


def kv_pool(model: ModelSpec, gpu: GpuSpec, *, tp: int, gpu_memory_utilization: float, block_size: int,
            max_num_seqs: int, runtime_overhead_gib: float = 0.5, activation_tokens: int = 2048,
            slot_bytes: int | None = None) -> KvPool:
    """Size the KV pool as vLLM does: budget - weights - peak activations, in whole blocks. ``slot_bytes``:
    the bytes of one token slot when the layout is not the classic one (``sim/layouts.py``)."""
    check_tensor_parallel(model, tp)
    budget = int(gpu.memory_bytes * gpu_memory_utilization - runtime_overhead_gib * GIB)
    weights = weights_bytes(model, tp)
    act = activation_bytes(model, tp, activation_tokens, max_num_seqs)
    per_token = model.kv_bytes_per_token(tp) if slot_bytes is None else slot_bytes
    num_blocks = (budget - weights - act) // (block_size * per_token)
    if num_blocks <= 0:
        need = weights + act + block_size * per_token
        left = budget - weights - act
        if left > 0:  # room for KV, but not for one block of this size
            raise CapacityError(
                f"{model.name} on {gpu.name} x{tp}: one KV block of block_size={block_size} tokens takes "
                f"{_size(block_size * per_token)}, more than the {_size(left)} left for KV cache after weights and "
                f"activations: lower block_size")
        raise CapacityError(
            f"{model.name} does not fit on {gpu.name} x{tp}: weights {_size(weights)} + activations "
            f"{_size(act)} per GPU leave no room for KV cache in {_size(budget)} "
            f"(gpu_memory_utilization={gpu_memory_utilization}); needs at least {_size(need)}: "
            f"raise tensor_parallel or pick a larger GPU"
        )
    return KvPool(int(num_blocks), block_size, per_token, budget, weights, act)


# ------------------------------------------------------------------------------------------ paged


_IDS: list[int] = []  # block ids 0..len-1, one int object each, shared by every pool of the process
_IDS_MAX = 1 << 18  # (8 MiB of them at most) ids above are made as handed out, each kept only while in use


def block_ids(lo: int, hi: int) -> list[int]:
    """The ids ``lo..hi-1``, as the pools hand out blocks never used before: below ``_IDS_MAX`` the
    process's shared int objects, made once in id order (adjacent in memory).

    NOTE: a block id is an int object, touched (its reference count) whenever a table holding it is copied
    or freed. Made per pool as handed out, each replica of a fleet had its own ids, scattered among its
    other objects; shared, the sixteen replicas of ``bench_fleet.py`` hold the same few thousand low ids
    (the stack packs blocks at the pool's start). cachegrind (first 4 minutes of that fleet,
    least-outstanding): second-level data misses 14.8 -> 12.6 M, the reads of freed tables' ids
    (``listreviter_next``) 1.1 M -> 0.1 M."""
    if hi > len(_IDS) and len(_IDS) < _IDS_MAX:
        _IDS.extend(range(len(_IDS), min(max(hi, 2 * len(_IDS), 1024), _IDS_MAX)))
    if hi <= len(_IDS):
        return _IDS[lo:hi]
    return _IDS[lo:] + list(range(max(lo, len(_IDS)), hi))


class BlockPool:
    """``num_blocks`` physical blocks; free ones wait on a stack (last freed, first reused).

    Guarantees: a block id is either free or held by exactly one owner's block table (the caller keeps
    the tables); allocation takes the most recently freed blocks first, a freed table coming back in its
    own order, then blocks never handed out, in id order; so the allocation order is deterministic.
    ``watermark_blocks`` stay free on admission. This is vLLM's uncached block allocator (its free ids a
    stack, V0's ``NaiveBlockAllocator``). The prefix-caching pool (``sharing.SharedBlockPool``) keeps V1's
    FIFO queue, since its order there is the eviction order; the hybrid manager a FIFO (``FifoBlockPool``).

    Why a stack: the blocks reused first are the ones just touched, so the bookkeeping stays in the CPU's
    cache; a queue hands out the block freed longest ago (in a fleet of replicas advanced together, each
    one cold). Freed ids are ``_stack[:_top]`` (the next to go last, a table pushed tail first), then
    ``[_fresh, num_blocks)``: memory follows the blocks ever used, not the pool's size (an H200 holds tens
    of millions of blocks of a small model). Above ``_top`` the list keeps ids already handed out again,
    overwritten as blocks are freed: so it never shrinks and regrows (a copy of it, each time it cannot
    grow in place), and a freed table is one slice assignment."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = watermark_blocks
        self._fresh = 0  # blocks [_fresh, num_blocks) were never allocated: the bottom of the stack
        self._stack: list[int] = []
        self._top = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + self._top

    @property
    def free_blocks(self) -> list[int]:
        """The free block ids, next to be allocated first (materialises them: tests and small pools)."""
        return self._stack[:self._top][::-1] + list(range(self._fresh, self.num_blocks))

    def free_state(self) -> tuple[list[int], int]:
        """The free blocks compactly: (freed ids, first never-allocated id); ids from the latter to
        ``num_blocks`` are free too."""
        return self._stack[:self._top], self._fresh

    def can_allocate(self, n: int, admission: bool = False) -> bool:
        return n <= self.num_blocks - self._fresh + self._top - (
            self.watermark_blocks if admission else 0)

    def allocate(self, n: int) -> list[int]:
        f, top = self._fresh, self._top
        rest = n - top  # blocks the stack cannot give: never-allocated ones
        if rest > self.num_blocks - f:
            raise RuntimeError(f"allocate({n}) with {top + self.num_blocks - f} free blocks")
        lo = top - n if rest <= 0 else 0
        out = self._stack[lo:top]
        out.reverse()
        self._top = lo
        if rest > 0:
            self._fresh = f + rest
            out.extend(block_ids(f, f + rest))
        return out

    def free(self, block_ids: list[int]) -> None:
        top = self._top
        self._top = top + len(block_ids)
        self._stack[top:self._top] = block_ids[::-1]
        assert self._top <= self._fresh, "more blocks free than ever lent: one freed twice"


class FifoBlockPool(BlockPool):
    """A ``BlockPool`` whose free ids wait in a FIFO queue: freeing appends to the tail, allocation takes
    from the head. The hybrid manager's (``sim/hybrid.py``): its decode fast path takes a span's pages in
    one call, which equals taking them a tick at a time only when pages freed meanwhile (those leaving a
    sliding window) join the tail, never reached first.

    The queue is ``[_fresh, num_blocks)`` (blocks never handed out yet, in id order) followed by the
    freed ids ``_queue[_head:]``, a list with a moving head (taking n blocks is one slice rather than n
    pops); the consumed prefix is dropped once it outgrows the rest."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, watermark_blocks)
        self._queue: list[int] = []
        self._head = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._queue) - self._head

    @property
    def free_blocks(self) -> list[int]:
        return list(range(self._fresh, self.num_blocks)) + self._queue[self._head:]

    def free_state(self) -> tuple[list[int], int]:
        return self._queue[self._head:], self._fresh

    def can_allocate(self, n: int, admission: bool = False) -> bool:
        return n <= self.num_blocks - self._fresh + len(self._queue) - self._head - (
            self.watermark_blocks if admission else 0)

    def allocate(self, n: int) -> list[int]:
        f = self._fresh
        fresh = self.num_blocks - f
        if n <= fresh:
            self._fresh = f + n
            return block_ids(f, f + n)
        h = self._head
        if n > fresh + len(self._queue) - h:
            raise RuntimeError(f"allocate({n}) with {fresh + len(self._queue) - h} free blocks")
        k = n - fresh
        self._fresh = self.num_blocks
        self._head = h + k
        return block_ids(f, f + fresh) + self._queue[h:h + k] if fresh else self._queue[h:h + k]

    def free(self, block_ids: list[int]) -> None:
        if self._head > len(self._queue) // 2:
            del self._queue[:self._head]
            self._head = 0
        self._queue.extend(block_ids)
        assert len(self._queue) - self._head <= self._fresh, "more blocks free than ever lent: one freed twice"


def _size(num_bytes: float) -> str:
    """Bytes for a message: GiB with two decimals, MiB below a tenth of a GiB (a tiny test device)."""
    return f"{num_bytes / GIB:.2f} GiB" if abs(num_bytes) >= GIB / 10 else f"{num_bytes / 2**20:.1f} MiB"


def blocks_for(num_tokens, block_size):
    """Blocks that hold ``num_tokens`` tokens (numbers or numpy arrays)."""
    return -(-num_tokens // block_size)


# ------------------------------------------------------------------------------------------ contiguous


@dataclass(frozen=True)
class Reservation:
    """The token slots a contiguous policy reserves for a request at admission (before allocator
    rounding): the one home of the reservation rule. ``tokens`` answers for one request; ``column``
    applies the same method to a whole request table (up-front rejection), so the two cannot disagree.

    max: the model's max length. oracle: exactly prompt + output. pow2: the prompt plus the output
    length rounded up to a power of two (the PagedAttention paper's Orca (Pow2): true output 25 -> 32
    reserved, at most 2x), capped at the max length.
    NOTE: rounding prompt + output instead would make pow2 identical to oracle under a buddy allocator,
    which rounds oracle's slab to that same power of two."""

    kind: str  # max | pow2 | oracle (config.ContiguousAllocator.reserve)
    max_model_len: int

    def tokens(self, prompt_tokens: int, output_tokens: int) -> int:
        if self.kind == "max":
            return self.max_model_len
        if self.kind == "pow2":
            return min(prompt_tokens + (1 << (output_tokens - 1).bit_length()), self.max_model_len)
        return prompt_tokens + output_tokens  # oracle

    def column(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
        """``tokens`` of each request (once per request and policy run: ~0.3 us a request)."""
        p, o = np.asarray(prompt_tokens).tolist(), np.asarray(output_tokens).tolist()
        return np.fromiter(map(self.tokens, p, o), dtype=np.int64, count=len(p))


class BuddyAllocator:
    """Binary buddy allocator over ``[0, capacity)`` token slots.

    A capacity that is not a power of two is covered by aligned power-of-two roots, largest first
    (14400 = 8192 @0 + 4096 @8192 + 2048 @12288 + 64 @14336), so ``offset ^ size`` is always the buddy
    inside a root. A request of ``n`` slots takes a block of ``2**ceil(log2 n)`` (the rounding is
    external fragmentation); freed buddies merge back up to their root."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.roots: list[tuple[int, int]] = []  # (base, order), increasing base
        base = 0
        for order in range(capacity.bit_length() - 1, -1, -1):
            if capacity & (1 << order):
                self.roots.append((base, order))
                base += 1 << order
        self.max_order = self.roots[0][1] if self.roots else 0
        self.free_lists: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        for b, o in self.roots:
            self.free_lists[o].add(b)
        self.allocated: dict[int, int] = {}  # start -> order
        self.used = 0  # slots in allocated blocks (rounded sizes)
        self._root_bases = [b for b, _ in self.roots]

    @staticmethod
    def order_for(n: int) -> int:
        return (n - 1).bit_length()

    def rounded(self, n: int) -> int:
        return 1 << self.order_for(n)

    def can_allocate(self, n: int) -> bool:
        return any(self.free_lists[o] for o in range(self.order_for(n), self.max_order + 1))

    def _root_order(self, start: int) -> int:
        return self.roots[bisect.bisect_right(self._root_bases, start) - 1][1]

    def allocate(self, n: int) -> int | None:
        """Lowest-addressed block of the smallest sufficient order, split down; None if none is free."""
        want = self.order_for(n)
        for o in range(want, self.max_order + 1):
            if self.free_lists[o]:
                start = min(self.free_lists[o])
                self.free_lists[o].remove(start)
                while o > want:  # split, keeping the lower half, freeing the upper buddy
                    o -= 1
                    self.free_lists[o].add(start + (1 << o))
                self.allocated[start] = want
                self.used += 1 << want
                return start
        return None

    def free(self, start: int) -> None:
        o = self.allocated.pop(start)  # KeyError: not allocated (freed twice)
        self.used -= 1 << o
        top = self._root_order(start)
        while o < top:
            buddy = start ^ (1 << o)
            if buddy not in self.free_lists[o]:
                break
            self.free_lists[o].remove(buddy)
            start = min(start, buddy)
            o += 1
        self.free_lists[o].add(start)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every free block."""
        return sorted((s, 1 << o) for o, fl in enumerate(self.free_lists) for s in fl)


class FirstFitAllocator:
    """Exact-size slabs at the lowest free address that fits; neighbours coalesce on free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.starts: list[int] = [0] if capacity else []  # free runs, sorted by start
        self.ends: list[int] = [capacity] if capacity else []
        self.allocated: dict[int, int] = {}  # start -> size
        self.used = 0  # slots in allocated slabs

    def rounded(self, n: int) -> int:
        return n

    def can_allocate(self, n: int) -> bool:
        return any(e - s >= n for s, e in zip(self.starts, self.ends))

    def allocate(self, n: int) -> int | None:
        for i, (s, e) in enumerate(zip(self.starts, self.ends)):
            if e - s >= n:
                if e - s == n:
                    del self.starts[i], self.ends[i]
                else:
                    self.starts[i] = s + n
                self.allocated[s] = n
                self.used += n
                return s
        return None

    def free(self, start: int) -> None:
        n = self.allocated.pop(start)  # KeyError: not allocated (freed twice)
        self.used -= n
        end = start + n
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] == start:  # merge with the run before
            i -= 1
            start = self.starts[i]
            del self.starts[i], self.ends[i]
        if i < len(self.starts) and self.starts[i] == end:  # and with the run after
            end = self.ends[i]
            del self.starts[i], self.ends[i]
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def free_runs(self) -> list[tuple[int, int]]:
        return [(s, e - s) for s, e in zip(self.starts, self.ends)]


# ------------------------------------------------------------------------------------------ managers
#
# A manager places each sequence's cache and keeps the exact split of the pool, in token slots:
#
#   capacity = token_states + reservation + internal + rounding + free_slots
#     token_states  slots holding computed K/V                     (= the scheduler's `filled`)
#     reservation   allocated slots that the request will still fill
#     internal      allocated slots it never fills: over-reservation, a last block's slack, or a
#                   finished request's slab still held by its static batch
#     rounding      slots an allocator took beyond the request (buddy rounding)
#     free_slots    unallocated; counted as external fragmentation while a request waits for memory
#
# `alloc` is the allocated slots (excluding rounding and held), `capped` the part of it the request
# will fill by its end, sum over i of min(alloc_i, max_kv_tokens_i).

class KvManager(Protocol):
    """What the scheduler asks of a KV manager; ``PagedKv``, ``ContiguousKv`` and ``sharing.SharedPagedKv``
    implement it. Ask-then-act pairs: ``can_admit``/``admit``, ``can_grow``/``grow``; ``free`` gives
    everything back. Counters, in token slots, as drawn above: ``alloc``, ``capped``, ``rounding``,
    ``held``; the filled slots are ``fill_rate`` x the scheduler's cached tokens - ``shared_filled``
    (sharing's correction; several KV groups' in sim/hybrid.py); ``shared_blocks``; ``copies``: the copy-on-write
    block copies of the step being planned; ``loads``: its blocks loaded from the CPU tier."""

    kind: str  # "paged" | "contiguous"
    caching: bool  # a prefix cache answers match_prefix
    fill_rate: int
    slides: bool
    capacity: int
    alloc: int
    capped: int
    rounding: int
    held: int
    shared_filled: int
    shared_blocks: int
    copies: list | tuple
    loads: list | tuple
    span_shared_filled: object  # None, or (k, contexts) -> shared_filled now and after each of k decode steps

    def never_fits(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray, width: int = 1) -> np.ndarray: ...
    def can_admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> bool: ...
    def admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> None: ...
    def can_grow(self, seq: Sequence, num_new: int) -> bool: ...
    def grow(self, seq: Sequence, num_new: int) -> None: ...
    def free(self, seq: Sequence) -> None: ...
    def capture(self, seqs: list) -> tuple: ...
    def segments(self, captured: tuple, blocked: bool) -> np.ndarray: ...


SLOT_TOKEN, SLOT_RESERVED, SLOT_INTERNAL, SLOT_EXTERNAL, SLOT_FREE = range(5)  # indices into sim.schema.MEMORY_CLASSES


def _merge_runs(starts: np.ndarray, lengths: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """(start, length, class) runs sorted by start, empty ones dropped, and neighbours of the same class
    joined: an (n, 3) int64 array (in numpy: a pool of millions of blocks is drawn in milliseconds)."""
    keep = lengths > 0
    s, n, c = starts[keep], lengths[keep], classes[keep]
    order = np.lexsort((c, n, s))
    s, n, c = s[order], n[order], c[order]
    if len(s) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    head = np.ones(len(s), dtype=bool)
    head[1:] = (c[1:] != c[:-1]) | (s[1:] != s[:-1] + n[:-1])  # a run that does not extend the previous one
    first = np.flatnonzero(head)
    return np.column_stack([s[first], np.add.reduceat(n, first), c[first]]).astype(np.int64)


def _merge_segments(segs: list[tuple[int, int, int]]) -> np.ndarray:
    """Sort (start, length, class) runs and join neighbours of the same class."""
    a = np.asarray(segs, dtype=np.int64).reshape(-1, 3)
    return _merge_runs(a[:, 0], a[:, 1], a[:, 2])


def _fill_runs(base: int, filled: int, fill_to: int, alloc_to: int, segs: list) -> None:
    """Slots [base, base+filled) token states, up to fill_to reserved, up to alloc_to internal."""
    segs.append((base, filled, SLOT_TOKEN))
    segs.append((base + filled, fill_to - filled, SLOT_RESERVED))
    segs.append((base + fill_to, alloc_to - fill_to, SLOT_INTERNAL))


def breakdown(capacity, filled, alloc, capped, rounding, held, blocked: bool):
    """The five memory classes (token slots); works on scalars and on per-step numpy arrays alike."""
    free_slots = capacity - alloc - rounding - held
    ext = rounding + (free_slots if blocked else 0)
    return filled, capped - filled, alloc - capped + held, ext, (0 * free_slots if blocked else free_slots)


@mypyc_attr(allow_interpreted_subclasses=True)
class PagedKv:
    """Blocks taken on demand: a sequence holds ``ceil(slots needed / block_size)`` blocks."""

    kind = "paged"
    caching = False  # see sharing.SharedPagedKv
    fill_rate = 1  # slots one cached token fills (hybrid.HybridPagedKv: one per attention group)
    slides = False  # pages can leave a sequence while it decodes (hybrid.HybridPagedKv: window groups)
    shared_filled = 0
    shared_blocks = 0
    copies: Any = ()  # copy-on-write block copies of the step being planned (sharing.py only: a list)
    loads: Any = ()  # blocks loaded from the CPU tier for the step being planned (sharing.py only: a list)
    span_shared_filled: Any = None  # several KV groups in slabs (hybrid.HybridContiguousKv): a method

    def __init__(self, pool: Any) -> None:  # a BlockPool, or a sharing.SharedBlockPool (its own bookkeeping)
        self.pool = pool
        self.block_size: int = pool.block_size  # typed: the pool is not (compiled code then adds ints as ints)
        self.capacity: int = pool.num_blocks * pool.block_size
        self.alloc = 0
        self.capped = 0
        self.rounding = 0
        self.held = 0

    def never_fits(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray, width: int = 1) -> np.ndarray:
        """Per request: even alone, its blocks exceed the pool above the admission watermark. With
        ``width`` samples or beams, each may hold its own copy of everything past the full prompt blocks."""
        p = np.asarray(prompt_tokens)
        need = -(-(p + np.asarray(output_tokens) - 1) // self.block_size)  # blocks_for, per request
        need = need + (width - 1) * (need - p // self.block_size)
        return need > self.pool.num_blocks - self.pool.watermark_blocks

    def _needed(self, seq: Sequence, num_new: int) -> int:
        return max(0, blocks_for(seq.num_computed_tokens + num_new, self.block_size) - len(seq.block_table))

    def can_admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> bool:
        return self.pool.can_allocate(self._needed(seq, num_new), admission=True)

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self.pool.can_allocate(self._needed(seq, num_new))

    def grow(self, seq: Sequence, num_new: int) -> None:
        n = self._needed(seq, num_new)
        if n:
            self._add_blocks(seq, self.pool.allocate(n))

    def admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> None:
        self.grow(seq, num_new)

    def _check(self) -> None:
        """Accounting, checked as a sequence gives its blocks back: the slots the tables hold (``alloc``,
        counted here) are the blocks the pool lent out (a block freed twice or lost shows here), and
        ``capped`` is within them."""
        pool = self.pool
        assert self.alloc == (pool.num_blocks - pool.num_free) * self.block_size and 0 <= self.capped <= self.alloc, (
            f"KV accounting: alloc {self.alloc}, capped {self.capped}, pool lent "
            f"{(pool.num_blocks - pool.num_free) * self.block_size} slots")

    def _add_blocks(self, seq: Sequence, block_ids: list[int]) -> None:
        B, cap = self.block_size, seq.max_kv_tokens
        old = len(seq.block_table) * B
        seq.block_table.extend(block_ids)
        new = len(seq.block_table) * B
        self.alloc += new - old
        self.capped += min(new, cap) - min(old, cap)

    def free(self, seq: Sequence) -> None:
        B, cap = self.block_size, seq.max_kv_tokens
        old = len(seq.block_table) * B
        self.alloc -= old
        self.capped -= min(old, cap)
        self.pool.free(seq.block_table)
        seq.block_table = []
        self._check()

    def capture(self, seqs: list) -> tuple:
        """A cheap copy of who holds what, to draw the address space later (see ``segments``)."""
        return ([(tuple(s.block_table), s.num_computed_tokens, s.max_kv_tokens) for s in seqs],
                self.pool.free_state())

    def segments(self, captured: tuple, blocked: bool) -> np.ndarray:
        """(start slot, length, class) runs covering the pool, classes as in sim.schema.MEMORY_CLASSES. Token positions
        [i*B, (i+1)*B) of a table live in slots [b*B, (b+1)*B) of its i-th block b: token states up to the
        table's filled count, then reserved slots up to its cap, then internal fragmentation."""
        B = self.block_size
        tables, (free, fresh) = captured
        lens = np.array([len(t) for t, _, _ in tables], dtype=np.int64)
        total = int(lens.sum())
        blocks = np.fromiter(chain.from_iterable(t for t, _, _ in tables), dtype=np.int64, count=total)
        pos = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)  # place in its table
        filled = np.repeat(np.array([f for _, f, _ in tables], dtype=np.int64), lens)
        cap = np.repeat(np.minimum(lens * B, np.array([m for _, _, m in tables], dtype=np.int64)), lens)
        _, first = np.unique(blocks, return_index=True)  # a block several tables share is drawn by the first
        lo, base = pos[first] * B, blocks[first] * B
        f = np.clip(filled[first] - lo, 0, B)
        r = np.clip(cap[first] - lo, 0, B)
        free = np.asarray(free, dtype=np.int64)
        idle = SLOT_EXTERNAL if blocked else SLOT_FREE
        k, m = len(base), len(free)
        return _merge_runs(
            np.concatenate([base, base + f, base + r, free * B, [fresh * B]]),
            np.concatenate([f, r - f, B - r, np.full(m, B, dtype=np.int64), [(self.pool.num_blocks - fresh) * B]]),
            np.concatenate([np.full(k, SLOT_TOKEN), np.full(k, SLOT_RESERVED), np.full(k, SLOT_INTERNAL),
                            np.full(m + 1, idle)]).astype(np.int64))  # never allocated: one run

    def add_blocks(self, seqs: list[Sequence]) -> None:
        """One more block for each decoding sequence whose next token starts a new block, in order.
        The hot path of decoding: the caller checked that enough blocks are free."""
        B, n = self.block_size, len(seqs)
        slack = 0  # capped grows by a whole block, but for a final block the request only partly fills
        for seq, b in zip(seqs, self.pool.allocate(n)):
            table = seq.block_table
            table.append(b)
            over = len(table) * B - seq.max_kv_tokens
            if over > 0:
                slack += over
        self.alloc += B * n
        self.capped += B * n - slack


@mypyc_attr(allow_interpreted_subclasses=True)
class ContiguousKv:
    """One slab per request, reserved whole at admission; decodes never need memory."""

    kind = "contiguous"
    caching = False
    fill_rate = 1
    slides = False
    shared_filled = 0
    shared_blocks = 0
    copies: tuple = ()
    loads: tuple = ()
    span_shared_filled: Any = None  # several KV groups in slabs (hybrid.HybridContiguousKv): a method

    def __init__(self, allocator: BuddyAllocator | FirstFitAllocator, reservation: Reservation) -> None:
        self.allocator = allocator
        self.reservation = reservation
        self.capacity = allocator.capacity
        self.alloc = 0
        self.capped = 0
        self.rounding = 0
        self.held = 0

    def _check(self) -> None:
        """Accounting: the allocator's used slots are exactly the slabs counted here."""
        assert self.allocator.used == self.alloc + self.rounding + self.held and 0 <= self.capped <= self.alloc, (
            f"KV accounting: allocator uses {self.allocator.used} slots, alloc {self.alloc} + rounding "
            f"{self.rounding} + held {self.held}, capped {self.capped}")

    def slab_for(self, seq: Sequence) -> int:
        return self.reservation.tokens(seq.prompt_tokens, seq.output_tokens)

    def never_fits(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray, width: int = 1) -> np.ndarray | bool:
        """Per request: its ``width`` slabs (one per sample or beam) never fit the empty pool together."""
        slab = self.reservation.column(prompt_tokens, output_tokens)
        a = self.allocator
        if isinstance(a, BuddyAllocator):  # blocks of the slab's order that the roots can give
            order = np.ceil(np.log2(np.maximum(slab, 1))).astype(np.int64)
            room = sum(np.where(order <= o, np.left_shift(1, np.maximum(o - order, 0)), 0) for _, o in a.roots)
        else:
            room = self.capacity // np.maximum(slab, 1)
        return (room < width) | (self.capacity == 0)

    def _slabs_needed(self, seq: Sequence) -> int:
        """Slabs to reserve when ``seq`` is admitted: its own, and one per sample or beam still to fork."""
        if seq.slab_start is not None:
            return 0
        g = seq.group
        return g.width if g is not None and len(g.members) == 1 else 1

    def can_admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> bool:
        n = self._slabs_needed(seq)
        if n <= 1:
            return n == 0 or self.allocator.can_allocate(self.slab_for(seq))
        taken = []  # ask by trying: place them all, then give them back (the allocator ends as it began)
        for _ in range(n):
            start = self.allocator.allocate(self.slab_for(seq))
            if start is None:
                break
            taken.append(start)
        for start in reversed(taken):
            self.allocator.free(start)
        return len(taken) == n

    def _take_slab(self, seq: Sequence) -> int:
        n = self.slab_for(seq)
        start = self.allocator.allocate(n)
        if start is None:
            raise RuntimeError(f"no slab of {n} slots free")
        self.alloc += n
        self.capped += min(n, seq.max_kv_tokens)
        self.rounding += self.allocator.rounded(n) - n
        return start

    def admit(self, seq: Sequence, num_new: int, hits: list[int] | tuple = ()) -> None:
        n = self._slabs_needed(seq)
        if not n:
            return
        seq.slab_start = self._take_slab(seq)
        seq.slab_tokens = self.slab_for(seq)
        seq.slab_rounded = self.allocator.rounded(seq.slab_tokens)
        if n > 1:  # the other samples' or beams' slabs, reserved now (their memory counts as reservation)
            group = seq.group
            assert group is not None  # n > 1: a group's leader
            group.reserved = [self._take_slab(seq) for _ in range(n - 1)]
        self._check()

    def fork(self, parent, child) -> tuple[int, int, int]:
        """``child`` takes a reserved slab; the parent's cached slots are copied into it."""
        child.slab_start = parent.group.reserved.pop()
        child.slab_tokens, child.slab_rounded = parent.slab_tokens, parent.slab_rounded
        return (parent.slab_start, child.slab_start, parent.num_computed_tokens)

    def reassign(self, moves: list[tuple]) -> list[tuple[int, int, int]]:
        """Beam search: each (target, source) gets the source's history copied into its own slab."""
        return [(source.slab_start, target.slab_start, source.num_computed_tokens) for target, source in moves]

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return True  # the slab covers the whole request

    def grow(self, seq: Sequence, num_new: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        if seq.slab_start is None:
            return
        starts = [seq.slab_start]
        g = seq.group
        if g is not None and g.reserved:  # a leader done at its first token never forked: its samples' slabs too
            starts += g.reserved
            g.reserved = []
        for start in starts:
            self.alloc -= seq.slab_tokens
            self.capped -= min(seq.slab_tokens, seq.max_kv_tokens)
            self.rounding -= seq.slab_rounded - seq.slab_tokens
            self.allocator.free(start)
        seq.slab_start = None
        self._check()

    def hold(self, seq: Sequence) -> None:
        """A finished request of a static batch keeps its slab until the batch ends (internal waste)."""
        self.alloc -= seq.slab_tokens
        self.capped -= min(seq.slab_tokens, seq.max_kv_tokens)
        self.held += seq.slab_tokens

    def release(self, seq: Sequence) -> None:
        self.held -= seq.slab_tokens
        self.alloc += seq.slab_tokens
        self.capped += min(seq.slab_tokens, seq.max_kv_tokens)
        self.free(seq)

    def capture(self, seqs: list) -> tuple:
        return ([(s.slab_start, s.num_computed_tokens, s.slab_tokens, s.max_kv_tokens, s.slab_rounded, held)
                 for s, held in seqs], self.allocator.free_runs())

    def segments(self, captured: tuple, blocked: bool) -> np.ndarray:
        slabs, free = captured
        segs: list[tuple[int, int, int]] = []
        for start, filled, reserved, max_kv, rounded, held in slabs:
            if held:  # a finished member of a static batch
                segs.append((start, reserved, SLOT_INTERNAL))
            else:
                _fill_runs(start, filled, min(reserved, max_kv), reserved, segs)
            segs.append((start + reserved, rounded - reserved, SLOT_EXTERNAL))
        idle = SLOT_EXTERNAL if blocked else SLOT_FREE
        segs.extend((st, n, idle) for st, n in free)
        return _merge_segments(segs)
