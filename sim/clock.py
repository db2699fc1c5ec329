"""The decode clock: the running sequences past their prefill, advanced together in O(1) per step.

Decoding sequences all compute one token and sample one per step, so instead of visiting each of them
the scheduler keeps them on one ``DecodeClock`` and moves the clock.

The invariant, stated once:

- A **tick** is one decode step of the whole group: every member computes one token and samples one.
  ``ticks`` counts the ticks so far (it never goes back).
- A sequence is **on the clock** exactly while ``seq.clock is`` this clock, which is exactly while it is
  a key of ``members`` (kept in arrival order). Members are running, past their prefill (each step is
  one token), and not beams (beams are reselected every step, so they stay with the scheduler). While on
  the clock, ``seq._computed`` and ``seq._output`` are *offsets*: the true counts are offset + ``ticks``
  (``Sequence``'s properties add it), so a tick changes every member without touching any.
  ``offset_sum`` is the sum of the members' ``_computed`` offsets; ``_offsets`` holds them sorted (their
  order never changes as the clock ticks) once ``decode_contexts`` has been asked for (window keys: models
  of several KV groups), else it is None and costs nothing.
- A member's **finish tick** is the value of ``ticks`` once it has sampled its last output token:
  ``output_tokens - _output``, fixed while it stays on. ``_finish_at`` is a heap of (finish tick, order,
  seq); an entry whose sequence left the clock (and perhaps rejoined with another offset) is stale and is
  skipped when met.
- **Block crossings** (paged): the tick that makes ``ticks == t`` computes each member's token at slot
  ``_computed + t - 1``, which needs a new block when that slot is a multiple of ``block_size``. So the
  members needing a block at tick ``t`` are ``_cross[t % block_size]`` (in arrival order): a member sits
  in class ``(1 - _computed) % block_size`` for as long as it is on the clock.
- **Inter-token gaps**: a member's first tick after joining is measured from its own last token
  (``_fresh``); every other member's from the previous tick (``_last_tick_s``).

The scheduler decides who joins and leaves (``join``/``leave``) and whether a tick happens; the clock
answers how far the group can run unchanged (``span``) and does the ticks (``advance``).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import deque
from typing import TYPE_CHECKING

from sim.core import Sequence

if TYPE_CHECKING:  # (typed for the compiled build's direct calls)
    from sim.metrics import ItlHistogram


def insert_by_arrival(queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
    """Put ``seq`` before the first queued sequence that arrived after it."""
    for i, s in enumerate(queue):  # preempted sequences are old: they land near the front
        if s.order > seq.order:
            queue.insert(i, seq)
            return
    queue.append(seq)


def add_sorted(d: dict[Sequence, None], seq: Sequence) -> dict[Sequence, None]:
    """Insert into an insertion-ordered dict kept in arrival order (rebuilt only for an old sequence)."""
    assert seq not in d, f"{seq} is already there"
    if d and next(reversed(d)).order > seq.order:
        items = sorted([*d, seq], key=lambda s: s.order)
        return dict.fromkeys(items)
    d[seq] = None
    return d


class DecodeClock:
    """The clocked decode group of one scheduler (see the module's docstring for the invariant)."""

    def __init__(self, block_size: int, paged: bool, itl: ItlHistogram) -> None:
        self.ticks = 0
        self.members: dict[Sequence, None] = {}  # the sequences on the clock, in arrival order
        self.offset_sum = 0  # sum of the members' computed-token offsets
        self.block_size = block_size
        self.paged = paged
        self._itl = itl  # inter-token latency sink: add(value, times), add_gaps(ends, times)
        self._fresh: dict[Sequence, None] = {}  # joined since the last tick: their next gap is their own
        self._last_tick_s = 0.0
        self._finish_at: list[tuple[int, int, Sequence]] = []  # (finish tick, order, seq) heap; stale entries skipped
        self._cross: list[list[Sequence]] = [[] for _ in range(block_size)] if paged else []
        self._offsets: list[int] | None = None  # the members' computed-token offsets, sorted, once asked for

    # ------------------------------------------------------------------------------------ members

    def join(self, seq: Sequence) -> None:
        """A sequence entering (or resuming) the decode phase: its counters become offsets."""
        assert seq.clock is None, f"{seq} joins the clock twice"
        t = self.ticks
        seq._computed -= t
        seq._output -= t
        seq.clock = self
        self.members = add_sorted(self.members, seq)
        self.offset_sum += seq._computed
        if self._offsets is not None:
            insort(self._offsets, seq._computed)
        self._fresh[seq] = None
        heapq.heappush(self._finish_at, (seq.output_tokens - seq._output, seq.order, seq))
        if self.paged:
            cls = self._cross[(1 - seq._computed) % self.block_size]
            if cls and cls[-1].order > seq.order:
                insert_by_arrival(cls, seq)
            else:
                cls.append(seq)

    def leave(self, seq: Sequence) -> None:
        """Leave the group: the sequence's counters become plain values again."""
        assert seq.clock is self, f"{seq} leaves a clock it is not on"
        if self.paged:
            self._cross[(1 - seq._computed) % self.block_size].remove(seq)
        self.offset_sum -= seq._computed
        offs = self._offsets
        if offs is not None:
            del offs[bisect_left(offs, seq._computed)]
        del self.members[seq]
        if self._fresh.pop(seq, 0) is not None:  # not fresh: its last token came at the last tick
            seq.last_token_s = self._last_tick_s
        t = self.ticks
        seq.clock = None
        seq._computed += t
        seq._output += t

    # ------------------------------------------------------------------------------------ queries

    def crossers(self, tick: int) -> list[Sequence]:
        """Members that need a new block at ``tick``, in arrival order."""
        return self._cross[tick % self.block_size] if self.paged else []

    def crossings(self, j: int) -> int:
        """Blocks the members take at ticks ``ticks + 2 .. ticks + 1 + j`` (the ``j`` ticks of a decode span
        after its first, whose blocks are placed when it is planned): each member one per ``block_size``
        ticks, in its class."""
        if not self.paged or j <= 0:
            return 0
        B, t, cross = self.block_size, self.ticks, self._cross
        whole, rest = divmod(j, B)
        return whole * len(self.members) + sum(len(cross[(t + 2 + i) % B]) for i in range(rest))

    def decode_keys(self) -> int:
        """Keys the members read at the next tick: each its cached context plus the new token."""
        return self.offset_sum + len(self.members) * (self.ticks + 1)

    def decode_contexts(self) -> tuple[list[int], int, int]:
        """The keys each member reads at the next tick (cached context + the token) as ``offs[i] + d``: the
        members' offsets, sorted, their sum (``offset_sum``), and ``d`` (a model of several KV groups prices
        window keys from them). Offsets keep their order as the clock ticks: kept sorted as members join
        and leave. (No prefix sums: rebuilt at each change, they cost more than the few sums a window
        group's pricing takes from the nearer end, ``layouts.head_sum``.)"""
        if self._offsets is None:  # first asked: kept sorted from now on
            self._offsets = sorted(s._computed for s in self.members)
        return self._offsets, self.offset_sum, self.ticks + 1

    def _next_finish_tick(self) -> int:
        heap = self._finish_at
        while heap[0][2].clock is not self or heap[0][0] != heap[0][2].output_tokens - heap[0][2]._output:
            heapq.heappop(heap)  # stale: the sequence left the clock (and may have rejoined)
        return heap[0][0]

    def span(self, free_blocks: int) -> int:
        """How many ticks from now, the next included, run with no finish before the last one and every
        block a member needs at ticks 2.. among ``free_blocks`` (the next tick's blocks are placed)."""
        t = self.ticks
        k = self._next_finish_tick() - t
        if not self.paged or k <= 1:
            return k
        # ticks t+2 .. t+k need blocks; every block_size consecutive ticks need one per member
        n, B = len(self.members), self.block_size
        full = free_blocks // n
        m, free = full * B, free_blocks - full * n
        while m < k - 1:
            need = len(self._cross[(t + 2 + m) % B])
            if need > free:
                break
            free -= need
            m += 1
        return min(k, 1 + m)

    # ------------------------------------------------------------------------------------ ticks

    def place_span_blocks(self, kv, k: int, filled: list, shared0=None,
                          shared: list | None = None) -> tuple:
        """Give the members the blocks of ticks 2..k (the next tick's are placed when it is planned),
        tick by tick, oldest first; returns the manager's (alloc, capped) after each of the k ticks.
        ``shared0``: the manager's ``shared_filled`` before the span, for a manager of several KV groups
        (sim/hybrid.py), whose window blocks freed at crossings leave ``filled`` (corrected in place);
        ``shared``: its ``shared_blocks`` is appended after each tick (prefix-cached pages leave a window too)."""
        alloc, capped = [kv.alloc], [kv.capped]
        t0, B, cross, add = self.ticks, self.block_size, self._cross, kv.add_blocks
        if shared0 is not None:  # several KV groups: the whole span's crossings in one call (sim/hybrid.py)
            kv.span_blocks([cross[(t0 + 1 + j) % B] for j in range(1, k)], alloc, capped, filled, shared0, shared)
            return alloc, capped
        a, c = alloc[0], capped[0]
        for j in range(1, k):
            movers = cross[(t0 + 1 + j) % B]
            if movers:  # (only this changes the manager's figures here)
                add(movers)
                a, c = kv.alloc, kv.capped
            alloc.append(a)
            capped.append(c)
        return alloc, capped

    def advance(self, k: int, ends_s: list[float]) -> None:
        """``k`` ticks: every member computed ``k`` tokens; tick j ended at ``ends_s[j]``."""
        n = len(self.members)
        first = ends_s[0]
        itl = self._itl
        for seq in self._fresh:  # their first decode: the gap since their own last token
            itl.add(first - seq.last_token_s)
        if n > len(self._fresh):
            itl.add(first - self._last_tick_s, n - len(self._fresh))
        if k > 1:
            itl.add_gaps(ends_s, n)
        self._fresh = {}
        self._last_tick_s = ends_s[-1]
        self.ticks += k

    def pop_finished(self) -> list[Sequence]:
        """Members that have sampled their last token by now, in finish-tick order."""
        out: dict[Sequence, None] = {}
        heap, t = self._finish_at, self.ticks
        while heap and heap[0][0] <= t:
            tick, _, seq = heapq.heappop(heap)
            if seq.clock is self and tick == seq.output_tokens - seq._output:
                out[seq] = None  # a sequence that left and rejoined may have two live entries
        return list(out)
