"""The scheduler: which sequences run in the next step, and how many tokens each computes.

The same code drives the simulator and the GPU replay. It asks the KV manager where caches go
(``can_admit``/``admit``, ``can_grow``/``grow``, ``free``) and hands the step to an executor as a
:class:`StepPlan`.

Queues, each kept in arrival order (FCFS; sequence ids follow arrival):
  waiting  not in GPU memory: new, or preempted by recompute (ahead of later arrivals)
  running  cache in GPU memory; split into the *clocked* decode group and the *explicit* rest
  swapped  cache in CPU swap space; swapped back in before any new admission
Static batching adds ``batch``: the current batch, finished members included (they keep their slabs).

A step schedules, in this order (vLLM's decode-first policy):
  1. decodes of running sequences, oldest first; when one needs a block and none is free, the newest
     running sequence not yet scheduled is preempted: all its blocks freed (recompute: back to
     waiting, to re-prefill prompt + generated tokens) or copied to CPU (swap);
  2. prefill chunks of running sequences (chunked mode), oldest first;
  3. swapped sequences, oldest first, while blocks above the watermark allow;
  4. waiting sequences, FCFS, while memory, ``max_num_seqs`` and the token budget allow.
Step shapes by ``prefill`` mode: separate (vLLM v0: a step either prefills new prompts or decodes),
mixed (Orca: whole prompts join the decodes), chunked (vLLM v1: prompts split under the token budget).

Groups (parallel samples, beams; see ``core.Group``): the leader prefills the prompt, and at its first
sample the others fork from it (``_fork``); beams are reselected after every step (``_reselect``). A
group is admitted, preempted and swapped as a unit, and its request finishes when all its members have.

The decode clock (``sim/clock.py``): running sequences past their prefill decode in lockstep on one
``DecodeClock``, O(1) per step instead of O(batch); the rest of running is ``explicit`` (prefilling,
just admitted or swapped in, beams). When a step needs more than the clock's fast path gives (blocks run
out, the budget is short), the general per-sequence path runs instead, with the same outcome.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from sim.clock import DecodeClock, add_sorted, insert_by_arrival
from sim.core import DONE, NEW, RUNNING, SWAPPED, WAITING, Sequence, StepPlan
from sim.kv import KvManager, PagedKv, breakdown
from sim.policy import Preemption, ResolvedPolicy

if TYPE_CHECKING:  # (typed for the compiled build's direct calls)
    from sim.metrics import Recorder


def before_copies(pairs: list[tuple[int, int]], copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Swap-out ``pairs`` (GPU block, CPU block) as the executor runs them: before the step's block copies
    (``StepPlan``). A block that a copy made earlier in this step fills (copy-on-write) still holds its old
    content then: swap out the copy's source instead, and drop the copy, whose destination the swap-out
    frees. ``copies`` (source, destination) changes in place; a step's copies never chain (a destination is
    no source: ``gpu/kv_cache.copy_blocks`` runs them at once). (Swapped out as it was, the block brought a
    sample stale keys and values back: found by the GPU replay, whose sequences then generated other tokens
    than the plain run's.)"""
    src_of = {d: s for s, d in copies}
    out = [(src_of.get(b, b), c) for b, c in pairs]
    gone = {b for b, _ in pairs}
    if not gone.isdisjoint(src_of):
        copies[:] = [(s, d) for s, d in copies if d not in gone]
    return out


class Scheduler:
    def __init__(self, r: ResolvedPolicy, kv: KvManager, rec: Recorder) -> None:
        policy = r.policy
        self.policy = policy
        self.kv: Any = kv  # paged managers also have pool, add_blocks, match_prefix, ...: read under self.paged
        self.paged = kv.kind == "paged"
        self.block_size = policy.block_size
        self.static = policy.batching == "static"
        self.prefill = policy.prefill
        self.max_num_seqs = policy.max_num_seqs
        self.max_num_batched_tokens = r.max_num_batched_tokens
        self.preemption = Preemption(policy.preemption, r.swap_blocks, policy.block_size)  # owns the swap space
        self.rec = rec  # the run's metrics.Recorder: ITL gaps and sharing counts go to it
        self.itl = rec.itl  # inter-token latency sink: add(value, times), add_gaps(ends, times)
        self.waiting: deque[Sequence] = deque()
        self.swapped: list[Sequence] = []
        self.batch: list[Sequence] = []
        self.explicit: dict[Sequence, None] = {}  # running, not clocked (prefilling, or just admitted)
        self.filled = 0  # token slots holding computed K/V, over all sequences in GPU memory
        self.blocked = False  # a request waits because memory (not policy) keeps it out
        self.done: list[tuple[Sequence, float]] = []  # finished since the engine last looked
        self.step_prompt_tokens = 0  # prompts first admitted in the planned step, and their cache hits
        self.step_hit_tokens = 0
        self.first_admitted: list[Sequence] = []  # requests the planned step schedules for the first time
        self.next_seq_id = 0  # ids for forked sequences (the engine starts them past the request ids)
        self._grouped = False  # some request has samples or beams (then requests != sequences)
        self._pending_forks: list[tuple[int, int]] = []  # (source, target) ids, for the next plan
        self._pending_slot_copies: list[tuple[int, int, int]] = []
        self.clock = DecodeClock(self.block_size, self.paged, self.itl)  # the running sequences that decode
        self._contexts = self.clock.decode_contexts  # (bound once: a plan carries it)
        # the step being planned
        self._entries: list[tuple[Sequence, int]] = []  # explicit sequences and their new tokens
        self._tick = False  # the clocked group decodes in this step
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._num_preempted = 0
        # prefill/decode disaggregation (sim/cluster/disagg.py). A prefill replica (``handoff``) keeps a
        # finished request's KV in ``held`` until its transfer ends (``release``). A decode replica gets
        # requests whose KV is elsewhere: a waiting sequence with computed tokens; admitting one reserves its
        # KV (prompt + first token) and puts it in ``pulling`` (listed in ``pulled`` for the engine, which
        # starts the transfer) until its KV lands (``land``); it computes nothing before.
        self.handoff = False
        self.held: dict[Sequence, None] = {}
        self.pulling: dict[Sequence, None] = {}
        self.pulled: list[Sequence] = []

    # ------------------------------------------------------------------------------------ queries

    @property
    def running(self) -> list[Sequence]:
        """All running sequences in arrival order (O(n): for inspection, not the hot path)."""
        return sorted([*self.clock.members, *self.explicit], key=lambda s: s.order)

    @property
    def num_running(self) -> int:
        return len(self.clock.members) + len(self.explicit)

    def add(self, seq: Sequence) -> None:
        if seq.group is not None:
            self._grouped = True
        assert seq.state == NEW, f"{seq} added twice"
        seq.state = WAITING
        self.waiting.append(seq)

    def num_requests_holding_kv(self) -> int:
        """Requests whose KV cache is in GPU memory: the running ones, and under static batching every
        request of the current batch (finished ones keep their slabs until the batch ends). A request's
        samples or beams count once; swapped and waiting requests hold none. O(1) without groups."""
        seqs = self.batch if self.static else None
        if not self._grouped:
            if seqs is not None:
                return len(seqs)
            return len(self.clock.members) + len(self.explicit) + len(self.held) + len(self.pulling)
        if seqs is None:
            seqs = [*self.clock.members, *self.explicit]
        return len({s.request_id for s in seqs})

    def has_work(self) -> bool:
        return bool(self.waiting or self.clock.members or self.explicit or self.swapped or self.batch)

    def awaits_transfer(self) -> bool:
        """KV held for, or reserved for, a transfer that has not ended (disaggregation): an event outside
        this server will change its state."""
        return bool(self.held or self.pulling)

    def arrivals_matter(self) -> bool:
        """Could a request arriving now be admitted before something finishes? Not while requests
        wait or are swapped out (FCFS keeps later arrivals behind them, and during a decode span
        nothing that keeps them out changes), nor while a static batch runs."""
        return not (self.waiting or self.swapped or self.static)

    def memory(self):
        """The five memory classes (token slots) of the current state."""
        kv = self.kv
        return breakdown(kv.capacity, self.filled * kv.fill_rate - kv.shared_filled, kv.alloc, kv.capped, kv.rounding,
                         kv.held, self.blocked)

    # ------------------------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan | None:
        """Decide the next step and place the K/V slots it writes; None when nothing can run."""
        self._entries, self._tick, self._swap_out, self._swap_in, self._num_preempted = [], False, [], [], 0
        self.step_prompt_tokens = self.step_hit_tokens = 0
        if self.first_admitted:
            self.first_admitted = []
        if self.kv.copies:
            self.kv.copies = []
        if self.kv.loads:
            self.kv.loads = []
        if self.static:
            self._schedule_static()
        else:
            self.blocked = False
            budget = self.max_num_batched_tokens
            if self.prefill == "separate" and not self.swapped and self._admit_waiting(budget, chunked=False):
                pass  # a prefill-only step (vLLM v0)
            else:
                budget = self._schedule_decodes(budget)
                if self.prefill != "separate":
                    budget = self._schedule_chunks(budget, chunked=self.prefill == "chunked")
                if not self._num_preempted:
                    budget = self._schedule_swapped(budget)
                    if self.prefill != "separate" and not self.swapped:
                        self._admit_waiting(budget, chunked=self.prefill == "chunked")
                elif not self._entries and not self._tick:
                    # every running sequence was preempted (a group goes as a unit, and it may be all that
                    # ran): rather than an empty step, the next one's swap-ins and admissions run now
                    budget = self._schedule_swapped(self.max_num_batched_tokens)
                    if not self.swapped:
                        self._admit_waiting(budget, chunked=self.prefill == "chunked")
        if not self._entries and not self._tick:
            return None
        plan = self._plan()
        if self._pending_forks or self._pending_slot_copies:
            self._pending_forks, self._pending_slot_copies = [], []
        return plan

    def _schedule_static(self) -> None:
        if not self.batch:  # the previous batch is done: form the next one, FCFS
            self.blocked = False
            while self.waiting and len(self.batch) + self._width(self.waiting[0]) <= self.max_num_seqs:
                seq = self.waiting[0]
                if not self.kv.can_admit(seq, seq.num_uncomputed_tokens):
                    self.blocked = True
                    break
                self._admit(self.waiting.popleft(), seq.num_uncomputed_tokens)
                self.batch.append(seq)
        else:  # after its prefill step the whole batch decodes (no token budget, contiguous slabs never run out)
            self._schedule_decodes(len(self.batch))

    def _admit_waiting(self, budget: int, chunked: bool) -> bool:
        """Admit waiting sequences FCFS; True if any was admitted."""
        admitted = False
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.num_running + len(self.pulling) + self._width(seq) > self.max_num_seqs:
                break
            if seq._computed:  # its KV is on a prefill replica: reserve prompt + first token, pull it
                if not self.kv.can_admit(seq, 1):
                    self.blocked = True
                    break
                self.waiting.popleft()
                seq.state = RUNNING
                self.kv.admit(seq, 1)
                self.pulling[seq] = None
                self.pulled.append(seq)
                continue
            hits = self.kv.match_prefix(seq) if self.kv.caching else ()  # cached blocks need no prefill
            n = seq.num_uncomputed_tokens - len(hits) * self.block_size
            if chunked:
                n = min(n, budget)
            elif n > budget:
                break
            if not self.kv.can_admit(seq, n, hits):
                self.blocked = True
                break
            self._admit(self.waiting.popleft(), n, hits)
            if chunked and self.kv.caching:  # vLLM v1 caches the blocks as it schedules them
                self.kv.register(seq, seq.num_computed_tokens + n)
            budget -= n
            admitted = True
        return admitted

    @staticmethod
    def _width(seq: Sequence) -> int:
        """Sequences ``seq`` will run as: all its samples or beams when it has yet to fork."""
        g = seq.group
        return g.width if g is not None and len(g.members) == 1 else 1

    def _admit(self, seq: Sequence, n: int, hits=()) -> None:
        assert seq.state == WAITING, f"{seq} admitted from state {seq.state}"
        seq.state = RUNNING
        self.kv.admit(seq, n, hits)
        if hits:
            self.filled += seq.num_computed_tokens
            self.rec.prefill_tokens_saved += seq.num_computed_tokens
        if seq.prefix_hit_tokens is None:  # a request's first admission: what the hit rate counts
            seq.prefix_hit_tokens = len(hits) * self.block_size
            self.step_prompt_tokens += seq.prompt_tokens
            self.step_hit_tokens += seq.prefix_hit_tokens
            self.first_admitted.append(seq)
        self.explicit = add_sorted(self.explicit, seq)
        self._entries.append((seq, n))

    def _schedule_decodes(self, budget: int) -> int:
        """Step 1: every decoding sequence computes one token. Returns the budget left."""
        n = len(self.clock.members)
        stragglers = [s for s in self.explicit if s.in_decode] if self.explicit else []
        if not stragglers and n <= budget:
            cross = self.clock.crossers(self.clock.ticks + 1)
            if not cross or self.kv.pool.can_allocate(len(cross)):  # the fast path
                if cross:
                    self.kv.add_blocks(cross)
                self._tick = n > 0
                return budget - n
        # the general path: one sequence at a time, oldest first, preempting the newest unscheduled
        order = sorted([*self.clock.members, *stragglers], key=lambda s: s.order)
        # with the plain paged pool, a clocked member whose next token starts no block needs nothing and cannot
        # fail: only the crossers ask the pool (the others' asking was most of a preempting step's cost)
        crossing = set(self.clock.crossers(self.clock.ticks + 1)) if type(self.kv) is PagedKv else None
        scheduled: set[Sequence] = set()
        for seq in order:
            if seq.state != RUNNING:
                continue  # preempted meanwhile
            if budget < 1:
                if seq.clock is not None:  # skipped this step; it rejoins the clock after its next decode
                    self.clock.leave(seq)
                    self.explicit = add_sorted(self.explicit, seq)
                continue
            if crossing is not None and seq.clock is not None and seq not in crossing:
                scheduled.add(seq)
                budget -= 1
                continue
            while not self.kv.can_grow(seq, 1):
                victim = self._newest_unscheduled(scheduled)
                self._preempt(victim)  # type: ignore[arg-type]  # never None: seq itself at worst
                if victim is seq or (seq.group is not None and victim.group is seq.group):  # type: ignore[union-attr]
                    break
            else:
                self.kv.grow(seq, 1)
                scheduled.add(seq)
                budget -= 1
                if seq.clock is None:
                    self._entries.append((seq, 1))
        self._tick = bool(self.clock.members)
        return budget

    def _newest_unscheduled(self, scheduled: set[Sequence]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq not in scheduled:
                return seq
        return None

    def _schedule_chunks(self, budget: int, chunked: bool) -> int:
        """Step 2: running sequences still prefilling get their next chunk (chunked mode)."""
        if not self.explicit:
            return budget
        # scheduled: the clocked members (the decodes, disjoint from explicit) and these; the union is
        # built only to pick a victim (O(batch): not every step)
        scheduled = {s for s, _ in self._entries}
        for seq in list(self.explicit):
            if seq in scheduled or seq not in self.explicit or budget <= 0:
                continue
            n = seq.num_uncomputed_tokens
            if chunked:
                n = min(n, budget)
            elif n > budget:
                continue
            while not self.kv.can_grow(seq, n):
                victim = self._newest_unscheduled(scheduled.union(self.clock.members, (seq,)))
                if victim is None or victim.order < seq.order:  # it is the newest unscheduled itself
                    if seq.group is None:  # preempted, as a decode is and as vLLM v1 does (running.pop())
                        self._preempt(seq)
                    break  # (a group's member waits: its group is preempted whole, by a decode)
                if seq.group is not None and victim.group is seq.group:
                    break
                self._preempt(victim)
            else:
                self.kv.grow(seq, n)
                if chunked and self.kv.caching:  # (as in _admit_waiting)
                    self.kv.register(seq, seq.num_computed_tokens + n)
                self._entries.append((seq, n))
                scheduled.add(seq)
                budget -= n
        return budget

    def _schedule_swapped(self, budget: int) -> int:
        """Step 3: swap sequences back in, oldest first, while blocks (above the watermark) allow."""
        while self.swapped and self.num_running < self.max_num_seqs:
            seq = self.swapped[0]
            g = seq.group
            if g is not None and g.swapped:  # a group comes back whole
                if self.num_running + len(g.swapped) > self.max_num_seqs or budget < len(g.swapped):
                    break
                if not self.preemption.can_swap_in_group(self.kv, g.swapped):
                    self.blocked = True
                    break
                self.swapped.pop(0)
                self._swap_in.extend(self.preemption.swap_in_group(self.kv, g.swapped))
                for m in g.swapped:
                    assert m.state == SWAPPED, f"{m} swapped in from state {m.state}"
                    m.state = RUNNING
                    self.kv.grow(m, 1)
                    self.filled += m.num_computed_tokens
                    self.explicit = add_sorted(self.explicit, m)
                    self._entries.append((m, 1))
                budget -= len(g.swapped)
                g.swapped = []
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            if not self.preemption.can_swap_in(self.kv, seq, n):
                self.blocked = True
                break
            self.swapped.pop(0)
            assert seq.state == SWAPPED, f"{seq} swapped in from state {seq.state}"
            seq.state = RUNNING
            self._swap_in.extend(self.preemption.swap_in(self.kv, seq, n))
            self.filled += seq.num_computed_tokens
            self.explicit = add_sorted(self.explicit, seq)
            self._entries.append((seq, n))
            budget -= n
        return budget

    def _leave(self, seq: Sequence) -> None:
        """Take a running sequence out of running (and out of the step being planned)."""
        assert seq.state == RUNNING, f"{seq} leaves running from state {seq.state}"
        if seq.clock is not None:
            self.clock.leave(seq)
        else:
            del self.explicit[seq]
            self._entries = [(s, n) for s, n in self._entries if s is not seq]

    def _preempt(self, seq: Sequence) -> None:
        """Preempt ``seq`` -- a group of samples or beams as a unit -- and queue it to come back;
        ``self.preemption`` decides whether its cache is swapped out or freed (recompute)."""
        g = seq.group
        group = g is not None and len(g.members) > 1
        # (the type checker cannot see that ``group`` means ``g`` is set)
        live = [m for m in g.members if m.state == RUNNING] if group else [seq]  # type: ignore[union-attr]
        for m in live:
            self._leave(m)
            self.filled -= m.num_computed_tokens
            m.num_registered = 0  # its next blocks are new ones
        (g.members[0] if group else seq).num_preemptions += 1  # type: ignore[union-attr]
        self._num_preempted += 1
        self.blocked = True
        pairs = self.preemption.swap_out(self.kv, live, group)
        if pairs is not None:
            copies = self.kv.copies
            self._swap_out.extend(before_copies(pairs, copies) if copies else pairs)
            for m in live:
                m.state = SWAPPED
            if group:
                g.swapped = live  # type: ignore[union-attr]
            insert_by_arrival(self.swapped, live[0])
            return
        keep = self.kv.caching and not group  # (a group's members share and swap blocks: not kept)
        for m in live:
            if keep:
                self.kv.keep(m)
            self.kv.free(m)
            m.num_computed_tokens = m.num_registered = 0  # (coming back, it registers what it computes again)
            m.state = WAITING
            insert_by_arrival(self.waiting, m)

    def _plan(self) -> StepPlan:
        e = self._entries
        n_clk = len(self.clock.members) if self._tick else 0
        prefill = decode = sampled = keys = pairs = 0
        for s, n in e:  # entries are never on the clock: plain counters
            c = s._computed
            if n == 1:
                decode += 1
                keys += c + 1
            else:
                prefill += n
                pairs += n * c + n * (n + 1) // 2
            sampled += c + n == s.prompt_tokens + s._output
        if n_clk:
            decode += n_clk
            sampled += n_clk
            keys += self.clock.decode_keys()
        kv = self.kv
        return StepPlan(  # positionally, in the order of its fields
            len(e) + n_clk, prefill + decode, prefill, decode, sampled, keys, pairs, self.block_size, self.paged,
            tuple(self._swap_out) if self._swap_out else (), tuple(self._swap_in) if self._swap_in else (),
            tuple(kv.copies) if kv.copies else (),
            tuple(self._pending_slot_copies) if self._pending_slot_copies else (),
            tuple(self._pending_forks) if self._pending_forks else (), self._num_preempted,
            self.clock.members if n_clk else (), e, {}, tuple(kv.loads) if kv.loads else (),
            self._contexts if n_clk else None)

    # ------------------------------------------------------------------------------------ complete

    def complete(self, end_s: float):
        """The planned step ran and ended at ``end_s``: count its tokens, sample, finish.
        Returns the memory classes as the step left them (before finished requests are freed), and the
        block references sharing saved then."""
        finished: list[Sequence] = []
        sampled: list[Sequence] = []
        caching = self.kv.caching
        for seq, n in self._entries:  # NOTE: entries are never on the clock: their counters are plain values
            seq._computed += n
            self.filled += n
            if caching:
                self.kv.register(seq)
            if seq._computed == seq.prompt_tokens + seq._output:
                seq._output += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end_s
                else:
                    self.itl.add(end_s - seq.last_token_s)
                seq.last_token_s = end_s
                (finished if seq._output == seq.output_tokens else sampled).append(seq)
        if self._tick:
            self.filled += len(self.clock.members)
            self.clock.advance(1, [end_s])
            finished += self.clock.pop_finished()
        mem, shared = self.memory(), self.kv.shared_blocks
        if finished or self.static:  # (a static batch may end with no finish in this step)
            self._finish(finished, end_s)
        beams: dict | None = None
        for seq in sampled:
            g = seq.group
            if g is None or (g.kind == "parallel" and len(g.members) > 1):
                if seq in self.explicit:  # now decoding: join the clock
                    del self.explicit[seq]
                    self.clock.join(seq)
            elif len(g.members) == 1:
                self._fork(seq, end_s)  # the leader's first sample: the other samples or beams start here
            else:
                if beams is None:
                    beams = {}
                beams[id(g)] = g  # beams stay explicit: they are reselected every step
        if beams is not None:
            for g in beams.values():
                self._reselect(g)
        return mem, shared

    def _fork(self, leader: Sequence, end_s: float) -> None:
        g = leader.group
        for j in range(1, g.width):  # type: ignore[union-attr]  # a member's group is set
            child = Sequence(leader.request_id, leader.arrival_s, leader.prompt_tokens, leader.output_tokens,
                             leader.prefix_ids, leader.hash_block, seq_id=self.next_seq_id, index=j)
            self.next_seq_id += 1
            child.group = g
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_output_tokens = leader.num_output_tokens
            child.first_token_s = child.last_token_s = end_s
            child.prefix_hit_tokens = 0  # not a request's first admission, should it be readmitted (its leader's)
            child.state = RUNNING
            copy = self.kv.fork(leader, child)
            if copy is not None:
                self._pending_slot_copies.append(copy)
                self.rec.num_slab_copies += 1
            self._pending_forks.append((leader.seq_id, child.seq_id))
            g.members.append(child)  # type: ignore[union-attr]  # a member's group is set
            self.filled += child.num_computed_tokens
            self.explicit = add_sorted(self.explicit, child)
            if self.static:
                self.batch.append(child)

    def _reselect(self, g) -> None:
        """Beam search's step: each new beam continues its own beam with probability keep_probability,
        else one chosen uniformly (seeded per request); a beam nobody continues is dropped, one
        continued twice is forked: its history is shared, and copied only where written."""
        live = [m for m in g.members if m in self.explicit]
        if len(live) != len(g.members):
            return  # members out of step (one was preempted alone): no reselection this step
        rng, w = g.rng, len(live)
        parents = [j if rng.random() < g.keep_probability else rng.randrange(w) for j in range(w)]
        # NOTE: a beam takes over another's history only when both hold as many tokens: one that was
        # preempted alone and recomputed can come back a few tokens behind, and a history of another
        # length would not fit its counts (found by tests/test_policy_combinations.py)
        moves = [(live[j], live[p]) for j, p in enumerate(parents)
                 if p != j and live[p].num_computed_tokens == live[j].num_computed_tokens]
        if moves:
            copies = self.kv.reassign(moves)
            self._pending_slot_copies.extend(copies)
            self.rec.num_slab_copies += len(copies)
            self._pending_forks.extend((src.seq_id, dst.seq_id) for dst, src in moves)

    def span_limit(self, plan: StepPlan) -> int:
        """How many decode steps, this planned one included, would be scheduled exactly like it.

        Holds while nobody finishes (the span may end with a finish), every block a decode needs is
        free, and no arrival comes (the engine cuts the span at the first step ending after one).
        Admission cannot open up meanwhile: free memory only shrinks and the batch is unchanged -- except
        where pages leave a window while decoding (``kv.slides``): there, with requests waiting or
        swapped out, a step may free what admits one, so the steps are taken one at a time."""
        if (self._entries or not self._tick or self.explicit or self._num_preempted or self._swap_in
                or self._swap_out or (self.kv.slides and (self.waiting or self.swapped))):
            return 1
        return self.clock.span(self.kv.pool.num_free if self.paged else 0)

    def complete_span(self, ends_s: list[float]) -> tuple:
        """``len(ends_s)`` decode steps of the clocked group ran (step j ended at ``ends_s[j]``).
        Does what as many ``schedule``/``complete`` rounds would. Returns the memory after each step as
        the inputs of ``kv.breakdown`` (which is linear in them, so the engine integrates them over time):
        (filled, alloc, capped) -- lists, one value per step, or a number where constant -- and the
        constant rounding, held and blocked; and the block references sharing saves (constant along a
        span: no fork, hit or copy happens in one; but a prefix-cached page of a window group that leaves a
        holder's window stops being shared: then a list, one value per step)."""
        k = len(ends_s)
        n = len(self.clock.members)
        kv = self.kv
        rate: int = kv.fill_rate  # slots a cached token fills: 1, or one per attention group (sim/hybrid.py)
        span_shared = kv.span_shared_filled  # several KV groups in slabs (sim/hybrid.py); else None
        # now, then after each step (typed: read from the untyped manager, each figure below went through
        # Python's generic arithmetic)
        span_sf: list[int] | None = None if span_shared is None else span_shared(k, self._contexts())
        sf0: int = kv.shared_filled if span_sf is None else span_sf[0]
        f0 = self.filled * rate - sf0  # physical slots
        per = rate * n
        if span_sf is None:
            filled = [f0 + per * j for j in range(1, k + 1)]
        else:  # slabs of several KV groups: less the slots that window groups do not fill
            filled = [f0 + per * j - (span_sf[j] - sf0) for j in range(1, k + 1)]
        alloc, capped = kv.alloc, kv.capped
        shared = kv.shared_blocks
        if self.paged and k > 1:
            # a manager of KV groups (sim/hybrid.py) frees window pages at crossings, even with one group
            track = [shared] if kv.slides and kv.caching else None
            alloc, capped = self.clock.place_span_blocks(kv, k, filled, sf0 if kv.slides else None, track)
            if track is not None:
                shared = track
        mem = (filled, alloc, capped, kv.rounding, kv.held, self.blocked)
        self.filled += n * k
        self.clock.advance(k, ends_s)
        self._finish(self.clock.pop_finished(), ends_s[-1])
        return mem, shared

    def _finish(self, finished: list[Sequence], end_s: float) -> None:
        for seq in finished:
            assert seq.state == RUNNING, f"{seq} finishes from state {seq.state}"
            seq.state = DONE
            if seq.clock is not None:
                self.clock.leave(seq)
            else:
                del self.explicit[seq]
            seq.last_token_s = end_s
            self.filled -= seq.num_computed_tokens
            g = seq.group
            if g is not None:
                g.num_finished += 1
                if g.width > 1 and len(g.members) == 1:  # done at its first token: no fork to make
                    g.num_finished = g.width
            if self.static:
                self.kv.hold(seq)
            elif self.handoff:  # a prefill replica: the KV stays until its transfer ends (``release``)
                self.filled += seq.num_computed_tokens
                self.held[seq] = None
                self.done.append((seq, end_s))
            else:
                self.kv.free(seq)
                if g is None or g.num_finished == g.width:  # a request is done when all its outputs are
                    self.done.append((g.members[0] if g else seq, end_s))
        if self.static and self.batch and not self.clock.members and not self.explicit:
            for seq in self.batch:  # the batch ends: all results return now
                self.kv.release(seq)
                if seq.group is None or seq is seq.group.members[0]:
                    self.done.append((seq, end_s))
            self.batch = []

    def release(self, seq: Sequence) -> None:
        """A prefill replica: ``seq``'s KV has been transferred; free it."""
        del self.held[seq]
        self.filled -= seq.num_computed_tokens
        self.kv.free(seq)

    def land(self, seq: Sequence, t: float) -> None:
        """A decode replica: ``seq``'s KV arrived at ``t``, with its first token; it decodes from the next step."""
        del self.pulling[seq]
        self.filled += seq.num_computed_tokens
        seq.first_token_s = seq.last_token_s = t
        self.explicit = add_sorted(self.explicit, seq)

    # ------------------------------------------------------------------------------------ pictures

    def capture(self) -> tuple:
        """A cheap copy of the address space's owners now; ``segments`` draws it later."""
        away = [*self.held, *self.pulling]  # disaggregation: KV held for or reserved for a transfer
        if self.paged:
            return self.kv.capture(self.running + away), self.blocked
        live = set(self.clock.members) | set(self.explicit) | set(away)
        return self.kv.capture([(s, s not in live) for s in (self.batch or self.running) + away]), self.blocked

    def segments(self, captured: tuple):
        data, blocked = captured
        return self.kv.segments(data, blocked)
