"""The scheduler: which sequences run in the next step, and how many tokens each computes.

The same code drives the simulator and the GPU replay. It asks the KV manager where caches go
(``can_admit``/``admit``, ``can_grow``/``grow``, ``free``) and hands the step to an executor as a
:class:`StepPlan`.

Queues, each kept in arrival order (FCFS):
  waiting  not in GPU memory: new, or preempted by recompute (front of the line by arrival)
  running  cache in GPU memory, scheduled every step
  swapped  cache in CPU swap space; swapped back in before any new admission
Static batching adds ``batch``: the current batch, finished members included (they keep their slabs).

Step shapes by ``prefill`` mode:
  separate  (vLLM v0) a step either prefills newly admitted prompts or decodes every running sequence
  mixed     (Orca)    running sequences decode, then whole new prompts join the same step
  chunked   (vLLM v1) like mixed, but a prompt may be split into chunks under the token budget
Preemption (paged only): when a running sequence needs a block and none is free, the newest running
sequence loses all its blocks, by recompute (back to waiting) or swap (blocks copied to CPU).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from sim.config import PolicyConfig
from sim.core import Sequence, StepPlan
from sim.kv import BlockPool, ContiguousKv, PagedKv, breakdown


def _insert_by_arrival(queue, seq: Sequence) -> None:
    """Put ``seq`` before the first queued sequence that arrived after it (seq ids follow arrival)."""
    i = 0
    for i, s in enumerate(queue):  # noqa: B007 - preempted sequences are old: they land near the front
        if s.seq_id > seq.seq_id:
            queue.insert(i, seq)
            return
    queue.append(seq)


class Scheduler:
    def __init__(self, policy: PolicyConfig, kv: PagedKv | ContiguousKv, max_num_batched_tokens: int,
                 swap_pool: BlockPool | None, itl) -> None:
        self.policy = policy
        self.kv = kv
        self.static = policy.batching == "static"
        self.prefill = policy.prefill
        self.max_num_seqs = policy.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swap_pool = swap_pool  # CPU swap space, when preempting by swap
        self.itl = itl  # inter-token latency sink: add(values), add_repeated(values, times)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.batch: list[Sequence] = []
        self.filled = 0  # token slots holding computed K/V, over all sequences in GPU memory
        self.blocked = False  # a request waits because memory (not policy) keeps it out
        self.done: list[tuple[Sequence, float]] = []  # finished since the engine last looked
        # the step being planned
        self._entries: list[tuple[Sequence, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._num_preempted = 0

    # ------------------------------------------------------------------------------------ queries

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.batch)

    def memory(self):
        """The five memory classes (token slots) of the current state."""
        kv = self.kv
        return breakdown(kv.capacity, self.filled, kv.alloc, kv.capped, kv.rounding, kv.held, self.blocked)

    def capture(self) -> tuple:
        """A cheap copy of the address space's owners now; ``segments`` draws it later."""
        if self.kv.kind == "paged":
            return self.kv.capture(self.running), self.blocked
        live = set(self.running)
        return self.kv.capture([(s, s not in live) for s in self.batch or self.running]), self.blocked

    def segments(self, captured: tuple):
        data, blocked = captured
        return self.kv.segments(data, blocked)

    # ------------------------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan | None:
        """Decide the next step and place the K/V slots it writes; None when nothing can run."""
        self._entries, self._swap_out, self._swap_in, self._num_preempted = [], [], [], 0
        if self.static:
            self._schedule_static()
        elif self.prefill == "separate":
            self._schedule_separate()
        else:
            self._schedule_mixed(chunked=self.prefill == "chunked")
        if not self._entries:
            return None
        return self._plan()

    def _schedule_static(self) -> None:
        if not self.batch:  # the previous batch is done: form the next one, FCFS
            self.blocked = False
            while self.waiting and len(self.batch) < self.max_num_seqs:
                seq = self.waiting[0]
                if not self.kv.can_admit(seq, seq.num_uncomputed_tokens):
                    self.blocked = True
                    break
                self.waiting.popleft()
                self.kv.admit(seq, seq.num_uncomputed_tokens)
                self.batch.append(seq)
                self.running.append(seq)
        # the whole batch prefills in its first step, then every unfinished member decodes
        self._entries = [(s, s.num_uncomputed_tokens) for s in self.running]

    def _schedule_separate(self) -> None:
        self.blocked = False
        if not self.swapped:
            budget = self.max_num_batched_tokens
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = seq.num_uncomputed_tokens
                if n > budget:
                    break
                if not self.kv.can_admit(seq, n):
                    self.blocked = True
                    break
                self._admit(self.waiting.popleft(), n)
                budget -= n
            if self._entries:
                return  # a prefill-only step
        self._schedule_running(self.max_num_batched_tokens, chunked=False)
        if not self._num_preempted:
            self._schedule_swapped(self.max_num_batched_tokens)

    def _schedule_mixed(self, chunked: bool) -> None:
        self.blocked = False
        budget = self._schedule_running(self.max_num_batched_tokens, chunked)
        if self._num_preempted:
            return
        budget = self._schedule_swapped(budget)
        if self.swapped:
            return
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            if chunked:
                n = min(n, budget)
            elif n > budget:
                break
            if not self.kv.can_admit(seq, n):
                self.blocked = True
                break
            self._admit(self.waiting.popleft(), n)
            budget -= n

    def _admit(self, seq: Sequence, n: int) -> None:
        self.kv.admit(seq, n)
        _insert_by_arrival(self.running, seq)
        self._entries.append((seq, n))

    def _schedule_running(self, budget: int, chunked: bool) -> int:
        """Give each running sequence (oldest first) its next tokens, preempting the newest when a
        sequence needs a block and none is free. Returns the budget left."""
        run = self.running
        i = 0
        while i < len(run):
            seq = run[i]
            n = seq.num_uncomputed_tokens
            if chunked:
                n = min(n, budget)
            if n == 0 or n > budget:
                i += 1
                continue
            while not self.kv.can_grow(seq, n):
                victim = run[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.kv.grow(seq, n)
                self._entries.append((seq, n))
                budget -= n
                i += 1
        return budget

    def _schedule_swapped(self, budget: int) -> int:
        """Swap sequences back in, oldest first, while blocks (above the watermark) allow."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            if not self.kv.can_admit(seq, n):
                self.blocked = True
                break
            self.swapped.pop(0)
            self.kv.admit(seq, n)
            self._swap_in.extend(zip(seq.cpu_blocks, seq.block_table))
            self.swap_pool.free(seq.cpu_blocks)
            seq.cpu_blocks = []
            self.filled += seq.num_computed_tokens
            _insert_by_arrival(self.running, seq)
            self._entries.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Free (recompute) or swap out all of ``seq``'s blocks. "Preempted" means exactly that."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self._num_preempted += 1
        self.blocked = True
        self.filled -= seq.num_computed_tokens
        table = seq.block_table
        if self.swap_pool is not None and self.swap_pool.can_allocate(len(table)):
            seq.cpu_blocks = self.swap_pool.allocate(len(table))
            self._swap_out.extend(zip(table, seq.cpu_blocks))
            self.kv.free(seq)
            _insert_by_arrival(self.swapped, seq)
        else:  # recompute (also when the swap space is full)
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            _insert_by_arrival(self.waiting, seq)

    def _plan(self) -> StepPlan:
        e = self._entries
        paged = self.kv.kind == "paged"
        return StepPlan(
            seq_ids=tuple(s.seq_id for s, _ in e),
            num_new_tokens=tuple(n for _, n in e),
            num_computed_tokens=tuple(s.num_computed_tokens for s, _ in e),
            num_sampled=sum(1 for s, n in e if s.num_computed_tokens + n == s.num_tokens),
            block_size=self.policy.block_size,
            block_tables=tuple(s.block_table for s, _ in e) if paged else None,
            slab_starts=None if paged else tuple(s.slab_start for s, _ in e),
            swap_out=tuple(self._swap_out),
            swap_in=tuple(self._swap_in),
            num_preempted=self._num_preempted,
        )

    # ------------------------------------------------------------------------------------ complete

    def complete(self, end_s: float):
        """The planned step ran and ended at ``end_s``: count its tokens, sample, finish.
        Returns the memory classes as the step left them (before finished requests are freed)."""
        finished = []
        for seq, n in self._entries:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.num_output_tokens += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end_s
                else:
                    self.itl.add(end_s - seq.last_token_s)
                seq.last_token_s = end_s
                if seq.num_output_tokens == seq.output_tokens:
                    finished.append(seq)
        self.filled += sum(n for _, n in self._entries)
        mem = self.memory()
        self._finish(finished, end_s)
        return mem

    def span_limit(self, plan: StepPlan) -> int:
        """How many decode steps, this planned one included, would be scheduled exactly like it.

        Holds while nobody finishes (the span may end with a finish), every block a decode needs is
        free, and no arrival comes (the engine cuts the span at the first step ending after one).
        Admission cannot open up meanwhile: free memory only shrinks and the batch is unchanged."""
        if (not plan.is_decode_only or self._num_preempted or self._swap_in or self._swap_out
                or len(self._entries) != len(self.running)):
            return 1
        k = min(s.output_tokens - s.num_output_tokens for s in self.running)
        return self.kv.span_limit(self.running, k)

    def complete_span(self, ends_s: np.ndarray):
        """``len(ends_s)`` decode steps of the planned batch ran (step j ended at ``ends_s[j]``).
        Does what as many ``schedule``/``complete`` rounds would; returns per-step memory classes."""
        k = len(ends_s)
        seqs = self.running  # == the planned sequences, in order (span_limit checked it)
        n = len(seqs)
        alloc, capped = self.kv.grow_span(seqs, k)
        filled = self.filled + n * np.arange(1, k + 1, dtype=np.int64)
        kv = self.kv
        mem = breakdown(kv.capacity, filled, alloc, capped, kv.rounding, kv.held, self.blocked)
        end = float(ends_s[-1])
        first = float(ends_s[0])
        for s in seqs:
            self.itl.add(first - s.last_token_s)
            s.num_computed_tokens += k
            s.num_output_tokens += k
            s.last_token_s = end
        if k > 1:
            self.itl.add_repeated(np.diff(ends_s), n)
        self.filled += n * k
        self._finish([s for s in seqs if s.num_output_tokens == s.output_tokens], end)
        return mem

    def _finish(self, finished: list[Sequence], end_s: float) -> None:
        if finished:
            gone = set(finished)
            self.running = [s for s in self.running if s not in gone]
            for seq in finished:
                self.filled -= seq.num_computed_tokens
                if self.static:
                    self.kv.hold(seq)
                else:
                    self.kv.free(seq)
                    self.done.append((seq, end_s))
        if self.static and self.batch and not self.running:  # the batch ends: all results return now
            for seq in self.batch:
                self.kv.release(seq)
                self.done.append((seq, end_s))
            self.batch = []
