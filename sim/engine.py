"""The engine: one server process (a SimPy-style generator) that plans a step, prices it, waits that
long, and completes it.

    arrivals ─► Scheduler.schedule() ─► StepPlan ─► executor ─► seconds ─► Scheduler.complete()

Arrivals are a sorted array, not processes: the server takes every request that has arrived when a
step starts. One event (a wait) per step, or per *span*: when the planned step is decode-only and
nothing can change (no finish, no block shortage, no arrival) for ``k`` steps, those ``k`` steps are
priced in closed form and taken at once. ``exact=True`` steps every iteration: the reference that
spans must reproduce. A lone server's waits follow one another on its own clock (``LoneClock``); the
replicas of a fleet that a router feeds share a ``SharedClock`` (``join``); a disaggregated fleet's
share a SimPy environment, which also orders its transfers (``attach``).
"""

from __future__ import annotations

import gc
import math
import random
from bisect import bisect_left
from contextlib import contextmanager
from typing import Any, Callable, Final

import numpy as np
import simpy
from simpy.events import NORMAL, URGENT

from sim.config import PolicyConfig
from sim.core import Group, Sequence, StepPlan
from sim.buffers import append, vec
from sim.kv import KvPool
from sim.hybrid import GroupTimeline
from sim.metrics import Recorder, SharingCounts, offload_counts
from sim.outputs import Columns
from sim.policy import ResolvedPolicy, make_kv, rejection_reasons
from sim.schema import FINISHED, HORIZON, REJECTED, UNFINISHED
from sim.scheduler import Scheduler
from sim.steptime import Executor
from sim.workload import RequestTable


class PolicyResult:
    """One policy's run: its summary, and its tables as pandas DataFrames (``requests``, ``steps``,
    ``timeline``, ``groups``). A table may be given as ``sim.outputs.Columns``: it becomes a DataFrame when first read
    (``table`` gives it as it is), so that a run whose tables are only written never imports pandas."""

    def __init__(self, policy: PolicyConfig, pool: KvPool, requests: Any, steps: Any, summary: dict,
                 snapshot: dict | None = None, timeline: Any = None, *, replicas: Any = None,
                 fleet: dict | None = None, num_events: int = 0, groups: Any = None, layout: Any = None) -> None:
        self.policy = policy
        self.pool = pool
        # several KV groups: slots per group class over time (hybrid.GroupTimeline), else None
        self._tables: dict[str, Any] = {"requests": requests, "steps": steps, "timeline": timeline, "groups": groups}
        self.summary = summary
        self.snapshot = snapshot  # the KV address space at the moment of most waiting requests
        self.replicas = replicas  # a fleet (sim.cluster): one row per replica (a DataFrame)
        self.fleet = fleet  # a fleet: routing and load-imbalance figures (summary.json "fleet")
        self.num_events = num_events  # simulation events taken: steps, spans of steps and idle gaps (the cost unit)
        self.layout = layout  # the KV layout the run used (sim.layouts.KvLayout; None: the classic one)

    def table(self, name: str) -> Any:
        """Table ``name`` ("requests", "steps", "timeline", "groups") as it is held: ``Columns`` or a DataFrame
        (None: a run of one KV group has no "groups")."""
        return self._tables[name]

    def _frame(self, name: str) -> Any:
        t = self._tables[name]
        if isinstance(t, Columns):
            t = self._tables[name] = t.frame()
        return t

    @property
    def requests(self) -> Any:
        """One row per request (``sim.metrics.RequestLog``)."""
        return self._frame("requests")

    @property
    def steps(self) -> Any:
        """One row per step or span of steps (``sim.metrics.STEP_COLUMNS``)."""
        return self._frame("steps")

    @property
    def timeline(self) -> Any:
        """Fixed-width time bins (``sim.metrics.Timeline``)."""
        return self._frame("timeline")

    @property
    def groups(self) -> Any:
        """Several KV groups: the slots each group class holds per time bin (``hybrid.GroupTimeline``); else None."""
        return None if self._tables["groups"] is None else self._frame("groups")


_NOT_WOKEN = object()  # Engine._woke while a wait has not been cut short

# A replica fed by a router prices a decode span up to the arrival AHEAD x (replicas) ahead, not knowing
# which arrivals will be its own; a push cuts the span. Priced too short, a span ends before the replica's
# next request and is taken as two (one more event); too long, the steps past the cut are priced for
# nothing, each about a six-hundredth of an event (instructions). Least-outstanding's fleet in
# bench_fleet.py, 15 minutes of the trace: 196,709 events at 1 (the N-th arrival), 191,134 at 4, against
# 191,131 for its own routing run as independent servers (cachegrind, 4 minutes: instructions -0.7 %).
AHEAD: Final = 4
# A fed server (``push``) appends each pushed request to its arrival lists; once this many are admitted, it
# drops them (``_admit_arrivals``). NOTE: kept whole, sixteen replicas' lists grew side by side in one
# heap, and each regrowth copied a list to fresh memory. Least-outstanding's fleet in bench_fleet.py, 30
# minutes of the trace: peak resident memory 247 -> 228 MB, page faults 53k -> 50k; cachegrind (4 minutes,
# 2 MiB last level): last-level data misses -5 %.
TRIM: Final = 32
# A lone server prices a decode span of at most this many steps whole, then cuts it at its next arrival,
# rather than first pricing one step to bound how many can start before the arrival: the same steps result
# (a step's price does not depend on how many are priced), for one call instead of two. (A fed replica's span
# is not cut at its estimate of the next arrival: there the bound decides the span, and is always taken.)
PRICE_WHOLE: Final = 16


class LoneClock:
    """The clock of a server that is alone on it (``Engine.serve``: its requests known ahead, no other
    process): its one process's waits follow one another, so they need no event queue. ``timeout``
    hands a wait's length back to ``serve``, which advances ``now`` by it as SimPy does (``now + delay``:
    the same times, bit for bit).

    NOTE: SimPy's queue cost a lone server about a tenth of each event (a ``Timeout`` built, scheduled,
    popped and its process resumed, in interpreted Python: the engine itself is compiled); a fleet's
    replicas share a SimPy clock (``attach``), where the queue orders them."""

    def __init__(self) -> None:
        self.now = 0.0

    def timeout(self, delay: float) -> float:
        return delay


class SharedClock(LoneClock):
    """The clock of a fleet's replicas that a router feeds at each arrival (sim/cluster/fleet.py). Each
    replica's process waits as a lone server's does (``timeout`` hands the wait back; ``event`` waits
    until woken); ``run`` resumes the replica whose wait ends first, after routing every arrival up to
    then: an arrival comes before any replica's event of its time. The replicas read the arrivals here
    (``closed``, ``expected_next_s``).

    The times are SimPy's, bit for bit: a wait ends at ``now + delay``, and a push that cuts a wait
    short resumes the replica at ``now + (at - now)``, or now (``resume_at``). Replicas do not read one
    another (the router reads them only at arrivals), so the order among equal times does not matter;
    the lowest index goes first.

    NOTE: SimPy did this in interpreted Python: per wait a ``Timeout`` made, a heap entry (tuple
    compares), the process resumed through callbacks, and per cut a new event while the old one stayed
    queued. This compiled loop keeps one float per replica instead."""

    def __init__(self, times: list[float], num_replicas: int) -> None:
        super().__init__()
        self.closed = False
        self._times = times  # the routed arrivals' times, in order, then infinity
        self._pos = 0  # the next arrival to route
        self._n = num_replicas
        self.wake = vec[float](capacity=num_replicas)  # when each replica's process resumes (infinity: when woken)
        self._procs: list[Any] = []

    def event(self) -> float:
        return math.inf

    def add(self, proc: Any) -> int:
        """A replica's process, started now; its slot."""
        self._procs.append(proc)
        self.wake = append(self.wake, self.now)
        return len(self._procs) - 1

    def resume_at(self, slot: int, at: float) -> None:
        """The process in ``slot`` resumes at ``at`` (now if that has passed) instead of when its wait ends."""
        now = self.now
        d = at - now
        self.wake[slot] = now + d if d > 0 else now

    def expected_next_s(self) -> float:
        """How far a replica prices a decode span ahead (a push cuts it): the arrival ``AHEAD`` times as
        many ahead as there are replicas (a replica gets about one in N)."""
        times = self._times
        return times[min(self._pos + AHEAD * self._n - 1, len(times) - 1)]

    def run(self, engines: list[Engine], order: list[int], cands: list[tuple[int, ...]] | None,
            whole: tuple[int, ...], route: Callable[[int, tuple[int, ...]], int], prompts: list[int],
            outputs: list[int], assigned: list[int], loads: list[int] | None = None) -> None:
        """Serve requests ``order`` (rows of the table, arriving at ``times``), each routed at its arrival by
        ``route(row, candidates)`` (``cands[pos]``, or ``whole`` for all) and pushed to that replica;
        ``assigned[row]``: the replica. ``loads``: the replicas' outstanding requests, for a least-outstanding
        router, whose choice among all replicas is ``least_loaded(loads)``, taken here without the call."""
        for e in engines:
            e.join(self)
        if not order:
            self._close(engines)
        times, wake, procs = self._times, self.wake, self._procs
        inf = math.inf
        while True:
            t = times[self._pos]
            k, w = -1, inf
            for j in range(len(wake)):
                x = wake[j]
                if x < w:
                    k, w = j, x
            if w < t:  # (t is infinite after the last arrival)
                self.now = w
                delay = next(procs[k], None)
                wake[k] = inf if delay is None else w + delay
            elif t < inf:
                self.now = t
                pos = self._pos
                while times[pos] <= t:
                    i = order[pos]
                    c = whole if cands is None else cands[pos]
                    r = least_loaded(loads) if loads is not None and c is whole else route(i, c)
                    assigned[i] = r
                    pos += 1
                    self._pos = pos
                    engines[r].push(i, t, prompts[i], outputs[i])
                if pos == len(order):
                    self._close(engines)
            else:
                return

    def _close(self, engines: list[Engine]) -> None:
        self.closed = True
        for e in engines:
            e.wake(None)


def least_loaded(loads: list[int]) -> int:
    """The replica with the fewest outstanding requests, the lowest index among ties: least-outstanding
    routing over every replica (``sim.cluster.router``)."""
    k, best = 0, loads[0]
    for j in range(1, len(loads)):
        x = loads[j]
        if x < best:
            k, best = j, x
    return k


def _step_ends(now: float, times: list[float]) -> list[float]:
    """When each step of a span ends: the clock advanced step by step, as stepping would (``now + t``)."""
    ends = []
    for t in times:
        now = now + t
        ends.append(now)
    return ends


@contextmanager
def paced_gc():
    """Run a simulation with the cyclic garbage collector paced to it: the objects alive before it starts
    are frozen (never rescanned), and a young collection waits for 50,000 new objects, not 700.

    NOTE: a run allocates millions of short-lived objects, and an overloaded server keeps a growing queue
    of live ones; at the default pace the collector rescanned that queue over and over, which made time
    grow faster than the requests (10^5 -> 4x10^5 generated requests: GC 0.5 -> 3.7 s of 6.4 -> 27 s).
    The simulator makes few reference cycles (sample groups), collected all the same, just less often."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


class Engine:
    def __init__(self, requests: RequestTable, resolved: ResolvedPolicy, executor: Executor, *,
                 horizon_s: float | None = None, exact: bool = False, record_steps: bool = True,
                 timeline_bin_s: float = 1.0, sampling=None, progress: Callable[[int, int], None] | None = None,
                 startup_s: float = 0.0, log=None) -> None:
        self.requests = requests
        self.resolved = resolved
        self.policy = resolved.policy
        self.pool = resolved.pool
        self.executor = executor
        self.horizon_s = horizon_s
        self._horizon = math.inf if horizon_s is None else horizon_s
        self._t0 = float(requests.arrival_s[0]) if len(requests) else 0.0  # the run starts at its first arrival
        self.startup_s = startup_s  # no step runs before this (a server's warm-up); requests still arrive
        self.exact = exact
        self.progress = progress
        self.sampling = sampling  # parallel samples or beams: every request is a group
        self.width = resolved.width
        self.kv: Any = make_kv(resolved)  # paged managers also have pool, block_size, ...: read where paged
        if hasattr(executor, "bind_kv"):  # a real executor reads the allocator's per-group tables (gpu/executor.py)
            executor.bind_kv(self.kv)
        self.rec = Recorder(requests, self.kv.capacity, timeline_bin_s=timeline_bin_s, record_steps=record_steps,
                            log=log)
        if hasattr(self.kv, "group_slots"):  # several KV groups (sim/hybrid.py): the memory figure splits by group
            self.rec.groups = GroupTimeline(self.kv)
        self.log = self.rec.log
        self.scheduler = Scheduler(resolved, self.kv, self.rec)
        self.scheduler.next_seq_id = len(requests)  # forked sequences get ids past the requests'
        self._holding = 0  # requests holding KV during the step being taken
        self.num_done = 0
        # fed by a router: this server's slot in its fleet's outstanding counts (pushed - finished), kept here
        self._loads: list[int] | None = None
        self._slot = 0
        self._snap_key: tuple = (0, 0)
        self._snap: tuple | None = None
        self._snap_waiting, self._snap_alloc = -1, -1  # below these, _maybe_capture has nothing to do
        self.feed: Any = None  # set by ``join``/``attach``: a router pushes this server its requests (sim.cluster)
        self._shared: SharedClock | None = None  # the fleet's clock (``join``)
        self._clock_slot = 0
        self._wakeable: str | None = None  # fed: "idle" or "span" while waiting in a way that an arrival cuts short
        self._waited_from = 0.0  # that wait's start
        self._woke: Any = _NOT_WOKEN  # ``wake``'s cause (idle), or the step at which it cut the span (span)
        self._span_ends: list[float] | None = None  # inside a decode span taken at once: its steps' ends
        self.num_events = 0
        self._dropped = 0  # fed: requests admitted and dropped from the lists (``TRIM``)
        # prefill/decode disaggregation (sim/cluster/disagg.py): sequences made by the fleet (``push``), the
        # transfers that ended (``deliver``: applied at the next step boundary), and the fleet's hooks
        self._made: dict[int, Sequence] = {}
        self.inbox: list[tuple[Sequence, float]] = []
        self.on_handoff: Callable | None = None  # a prefill replica: called with (engine, finished requests, time)
        # a decode replica: called with (engine, sequences whose KV it reserved, time)
        self.on_pull: Callable | None = None

    # ------------------------------------------------------------------------------------ run

    def run(self) -> PolicyResult:
        r = self.requests
        reason = rejection_reasons(self.resolved, self.kv, r.prompt_tokens, r.output_tokens)
        self.log.status[reason > 0] = REJECTED
        self.log.reason[:] = reason
        self.serve(np.flatnonzero(reason == 0))
        return self.results()

    def serve(self, ids: np.ndarray) -> None:
        """Serve requests ``ids`` (rows of the table, in arrival order), knowing their arrivals ahead, on
        this server's own clock. A fleet whose router reads no replica state gives each replica its
        requests this way (``sim.cluster.fleet``): the replica is then exactly a lone server."""
        clock = LoneClock()
        with paced_gc():
            for delay in self.waits(ids, clock):  # each wait the process yields, taken in turn
                clock.now = clock.now + delay
        self._end_s = clock.now

    def waits(self, ids: np.ndarray, clock: LoneClock):
        """``serve``'s process: a generator of its waits, which the caller takes on ``clock`` (``clock.now
        + delay``) one at a time (benchmarks/bench_interleave.py advances several lone servers together)."""
        r = self.requests
        self._loads = None  # no router reads a server that knows its requests ahead
        self._ids = ids.tolist()
        # plain Python lists for the hot loop, with an arrival at infinity as a sentinel
        self._arrivals = r.arrival_s[self._ids].tolist() + [math.inf]
        self._prompts = r.prompt_tokens[self._ids].tolist()
        self._outputs = r.output_tokens[self._ids].tolist()
        self._hashes = r.prefix_hashes if self.kv.caching else None
        self._next = self._dropped = 0
        return self._serve(clock)

    def record_idle(self, now: float, until: float, num_waiting: int = -1) -> None:
        """Nothing runs from ``now`` to ``until``: the memory and queues as they are (``num_waiting``: the
        queue, if not the scheduler's). Time before the first request of the table arrives is not the
        run's (its duration, and so its memory shares, start there)."""
        if now < self._t0:
            now = self._t0
        if until > now:
            sched, kv = self.scheduler, self.kv
            waiting = len(sched.waiting) if num_waiting < 0 else num_waiting
            self.rec.idle(now, until - now, sched.memory(), num_waiting=waiting,
                          num_running=sched.num_running, num_swapped=len(sched.swapped),
                          shared_slots=kv.shared_blocks * kv.block_size if kv.kind == "paged" else 0,
                          holding=sched.num_requests_holding_kv())

    def _record_startup(self, end_s: float) -> None:
        """The warm-up (``startup_s``) was idle: record it, the requests arriving meanwhile waiting, one
        more from each arrival on (they join the scheduler when it ends, at ``end_s``)."""
        arrivals, i, t, waiting = self._arrivals, self._next, 0.0, 0
        while arrivals[i] < end_s:
            self.record_idle(t, arrivals[i], waiting)
            t, i, waiting = arrivals[i], i + 1, waiting + 1
        self.record_idle(t, end_s, waiting)

    def idle_until(self, end_s: float) -> None:
        """A fleet's replica that ended before the fleet: idle, as it left off, until the fleet's end (its
        memory shares, busy fraction and per-replica rows are then over the fleet's whole run)."""
        if end_s > self._end_s:
            self.record_idle(self._end_s, end_s)
            self._end_s = end_s

    def results(self, requests: Any = None) -> PolicyResult:
        """The finished run's result; ``requests``: this server's rows of a log shared by a fleet."""
        r = self.requests
        self._close_unfinished()
        # NOTE: the loop's per-request lists (Python floats and ints: ~70 MiB at 10^6 requests) are done
        # with; dropped before the result tables are built, so that the run's peak memory is the loop's
        self._arrivals = self._prompts = self._outputs = None
        sharing = self.sharing_counts()
        req, steps, timeline, summary = self.rec.results(float(r.arrival_s[0]) if len(r) else 0.0, self._end_s,
                                                         sharing, requests)
        if r.beyond_horizon and requests is None:  # requests arriving at or after the horizon were never generated
            summary["num_requests"] += r.beyond_horizon
            summary["num_unfinished"] += r.beyond_horizon
        groups = self.rec.groups.table(self.rec.timeline.bin_s) if self.rec.groups is not None else None
        return PolicyResult(self.policy, self.pool, req, steps, summary, self.snapshot(), timeline,
                            num_events=self.num_events, groups=groups, layout=self.resolved.layout)

    def sharing_counts(self) -> SharingCounts | None:
        """What block sharing counted (None when the run neither shares nor copies blocks)."""
        kv = self.kv
        if self.resolved.sharing:
            return SharingCounts(True, kv.caching, kv.block_size, self.rec.prefill_tokens_saved, kv.num_copies,
                                 kv.pool.num_evicted, offload=offload_counts(kv, self.pool.kv_bytes_per_token))
        if self.sampling is not None:
            return SharingCounts(False, False, self.pool.block_size, num_slab_copies=self.rec.num_slab_copies)
        return None

    def _admit_arrivals(self, now: float) -> None:
        arr, nxt = self._arrivals, self._next
        while arr[nxt] <= now:
            i = self._ids[nxt]
            seq = self._made.pop(i, None) if self._made else None
            if seq is not None:
                self.scheduler.add(seq)
                nxt += 1
                continue
            seq = Sequence(i, arr[nxt], self._prompts[nxt], self._outputs[nxt])
            if self._hashes is not None:
                seq.prefix_ids, seq.hash_block = self._hashes.of(i), self._hashes.block_size
            if self.sampling is not None:
                sp = self.sampling
                seq.group = Group(sp.kind, self.width, getattr(sp, "keep_probability", 1.0),
                                  random.Random(getattr(sp, "seed", 0) * 1_000_003 + i))
                seq.group.members.append(seq)
            self.scheduler.add(seq)
            nxt += 1
        if nxt >= TRIM and self.feed is not None:  # fed: drop the admitted (see ``TRIM``)
            del arr[:nxt], self._ids[:nxt], self._prompts[:nxt], self._outputs[:nxt]
            self._dropped += nxt
            nxt = 0
        self._next = nxt

    def _next_event_s(self) -> float:
        """The next time the scheduler must look again regardless of the batch: an arrival or the horizon."""
        return min(self._arrivals[self._next], self._horizon)

    def _serve(self, env: Any):  # a simpy.Environment, or a lone server's LoneClock (``serve``)
        sched, executor, log, arrivals = self.scheduler, self.executor, self.log, self._arrivals
        if self.startup_s > 0:
            yield env.timeout(min(self.startup_s, self._horizon))
            self._record_startup(env.now)
        while True:
            now = env.now
            if now >= self._horizon:
                self._end_s = now
                return
            if self.inbox:
                self._take_inbox()
            if arrivals[self._next] <= now:
                self._admit_arrivals(now)
            plan = sched.schedule()
            if sched.pulled:
                self.on_pull(self, sched.pulled, now)  # type: ignore[misc]  # set: a decode replica pulls
                sched.pulled = []
            if plan is None:
                if sched.has_work() and not sched.awaits_transfer():
                    raise RuntimeError(f"scheduler stalled at t={now:.3f}s with {len(sched.waiting)} waiting, "
                                       f"{len(sched.swapped)} swapped: a bug, please report it")
                t = self._next_event_s()
                if self.feed is not None:  # fed by a router: wait for a push, the horizon, or the end of arrivals
                    if self.feed.closed and math.isinf(t) and not sched.awaits_transfer():
                        self._end_s = now
                        return
                    self._wakeable, self._waited_from, self._woke = "idle", now, _NOT_WOKEN
                    yield env.event() if math.isinf(t) else env.timeout(t - now)  # ``wake`` may end it sooner
                    self._wakeable = None
                    if self._woke is not _NOT_WOKEN:
                        if self._woke is None:  # no more arrivals: this server ended when it went idle
                            self._end_s = now
                            return
                        t = self._woke  # the pushed request's arrival
                    t = min(t, self._horizon)
                if math.isinf(t):
                    self._end_s = now
                    return
                self.record_idle(now, t)
                self.num_events += 1
                if self.feed is None:
                    yield env.timeout(t - now)
                continue
            if len(sched.waiting) + len(sched.swapped) > self._snap_waiting or self.kv.alloc > self._snap_alloc:
                self._maybe_capture(now)  # the address space as this step holds it
            self._holding = sched.num_requests_holding_kv()  # as planned: those that finish in it included
            if sched.first_admitted:  # the requests this step schedules for the first time
                for seq in sched.first_admitted:
                    log.scheduled(seq.request_id, now)
            k = 1 if self.exact else sched.span_limit(plan)
            cuttable, times = False, None
            if k > 1:
                cuttable = sched.arrivals_matter()
                stop = self._next_event_s() if cuttable else self._horizon
                if cuttable and self.feed is not None:  # pushes are not known ahead: price up to when one may
                    stop = min(self.feed.expected_next_s(), self._horizon)  # come, cut when one does (below)
                if stop < math.inf and (k > PRICE_WHOLE or self.feed is not None):
                    # price only the steps that can start before it (step times only grow along a span; if a
                    # model's did not, the span would just end sooner: still exact)
                    first = executor.decode_span_s(plan, 1)  # None: no closed form (a real executor)
                    k = 1 if first is None else min(k, int((stop - now) / first[0]) + 2)
                if k > 1:
                    times = executor.decode_span_s(plan, k)  # None: no closed form; else step j's seconds
            if times is None:
                dt = executor.step_time_s(plan)
                yield env.timeout(dt)
                self._record(now, [dt], plan, *sched.complete(env.now))
            else:
                ends = _step_ends(now, times)
                cut = bisect_left(ends, stop if self.feed is None else self._horizon)
                if cut < k:  # stop at the first step that ends at or after the next admissible arrival
                    del ends[cut + 1:], times[cut + 1:]
                self._span_ends = ends  # what a router reads of a fed replica's KV meanwhile (kv_slots_in_use)
                if self.feed is None or not (cuttable or sched.pulling):  # a landing KV cuts it too
                    yield env.timeout(ends[-1] - now)
                else:
                    self._wakeable, self._waited_from, self._woke = "span", now, _NOT_WOKEN
                    yield env.timeout(ends[-1] - now)  # a push may end it sooner (``wake``)
                    self._wakeable = None
                    if self._woke is not _NOT_WOKEN:  # cut at the first step ending at or after the push
                        del ends[self._woke + 1:], times[self._woke + 1:]
                self._span_ends = None
                mem, shared = sched.complete_span(ends)
                self._record(now, times, plan, mem, shared, ends)
            done = sched.done
            if done:
                self.rec.finished(env.now, done)
                self.num_done += len(done)
                if self._loads is not None:
                    self._loads[self._slot] -= len(done)
                if self.on_handoff is not None:
                    self.on_handoff(self, done, env.now)
                done.clear()
            self.num_events += 1
            if self.progress is not None and self.num_events % 512 == 0:
                self.progress(self.num_done, self._dropped + len(self._ids))

    # ---------------------------------------------------------------- fed by a router (sim.cluster)

    def join(self, clock: SharedClock) -> None:
        """Serve, on a clock shared with other servers, the requests a router ``push``es at their arrival
        (instead of the whole table). ``clock.closed``: no request will come any more;
        ``clock.expected_next_s()``: when one may next come (how far a decode span is priced ahead; a push
        cuts the span at the first step ending at or after it, as a known arrival would)."""
        self._fed(clock)
        self._shared = clock
        self._clock_slot = clock.add(self._serve(clock))

    def attach(self, env: simpy.Environment, feed) -> None:
        """As ``join``, on a SimPy environment (a disaggregated fleet's, which also times its transfers);
        ``feed`` has ``closed`` and ``expected_next_s``."""
        self._fed(feed)
        self.process = env.process(self._serve(env))

    def _fed(self, feed) -> None:
        self.feed = feed
        self._ids, self._arrivals, self._prompts, self._outputs = [], [math.inf], [], []
        self._hashes = self.requests.prefix_hashes if self.kv.caching else None
        self._next = self._dropped = 0
        self._end_s = 0.0

    def share_load(self, loads: list[int], slot: int) -> None:
        """Keep ``loads[slot]`` equal to this server's outstanding requests (pushed, not yet finished), for
        a router that reads them at every arrival (``sim.cluster.router.Replicas``). Before ``attach``:
        nothing is pushed yet. (A server given its requests ahead, ``serve``, keeps no count.)"""
        loads[slot] = 0
        self._loads, self._slot = loads, slot

    def push(self, i: int, arrival_s: float, prompt_tokens: int, output_tokens: int,
             seq: Sequence | None = None) -> None:
        """Request ``i`` arrives now (``arrival_s``, the clock's time) with these lengths: it joins at the next
        step. Disaggregation: a prefill replica gets it with ``output_tokens`` 1; a decode replica gets the
        ``seq`` the fleet made (its KV on a prefill replica)."""
        self._arrivals[-1] = arrival_s
        self._arrivals.append(math.inf)
        self._ids.append(i)
        self._prompts.append(prompt_tokens)
        self._outputs.append(output_tokens)
        if self._loads is not None:
            self._loads[self._slot] += 1
        if seq is not None:
            self._made[i] = seq
        self.wake(arrival_s)

    def deliver(self, seq: Sequence, t: float) -> None:
        """A transfer of ``seq``'s KV ended now (``t``): a prefill replica frees it, a decode replica
        decodes it, from the next step boundary (an idle replica wakes now)."""
        self.inbox.append((seq, t))
        self.wake(t)

    def _take_inbox(self) -> None:
        sched = self.scheduler
        for seq, t in self.inbox:
            if seq in sched.held:
                sched.release(seq)
            else:
                sched.land(seq, t)
        self.inbox.clear()

    def wake(self, cause) -> None:
        """Cut an idle wait or a cuttable span short: ``cause`` an arrival time, or None (arrivals ended:
        only an idle wait ends)."""
        w = self._wakeable
        if w == "idle" or (w and cause is not None):
            self._wakeable = None
            start = self._waited_from
            if w == "span":  # end at the first step ending at or after ``cause``
                # set: in a span (kept whole: until the cut, the step in progress is the same)
                ends: list[float] = self._span_ends  # type: ignore[assignment]
                self._woke = cut = bisect_left(ends, cause)
                at = start + (ends[cut] - start)
            else:
                self._woke = cause
                at = start + (cause - start) if cause is not None else start
            self._resume_at(at)

    def _resume_at(self, at: float) -> None:
        """The waiting process resumes at ``at`` (now if ``at`` has passed) instead of when its wait ends.
        NOTE: a new event takes over the process's resume callback, as SimPy's ``Interruption`` moves it,
        without throwing an exception into the generator and waking it twice (at the push, then at the
        cut); the old wait's event still fires, with nothing to call. Bit for bit where the interrupt
        landed: at ``now + (at - now)``, or now, before the clock's ordinary events (urgent)."""
        if self._shared is not None:
            self._shared.resume_at(self._clock_slot, at)
            return
        proc = self.process
        env = proc.env
        ev = simpy.Event(env)
        ev._ok, ev._value = True, None
        d = at - env.now
        if d > 0:
            env.schedule(ev, NORMAL, d)
        else:
            env.schedule(ev, URGENT)
        proc._target.callbacks.remove(proc._resume)
        ev.callbacks.append(proc._resume)
        proc._target = ev

    def kv_slots_in_use(self) -> int:
        """KV slots in use now (allocated, held, rounding), as exact stepping holds them: every step's
        blocks are placed as it is planned, so inside a decode span taken at once (whose blocks are placed
        when it ends) the blocks of the steps begun by now count too. The step in progress is the first
        one ending at or after now (one ending now has not completed: a router acts first). A router reads
        this (sim/cluster/router.py); a manager whose pages leave a window while decoding (``kv.slides``)
        steps exactly under such a router (``Replicas.exact_kv``), so this sum holds for every manager."""
        kv = self.kv
        used = kv.alloc + kv.held + kv.rounding
        ends = self._span_ends
        if ends is not None and kv.kind == "paged":
            j = bisect_left(ends, self._shared.now if self._shared is not None else self.process.env.now)
            used += kv.fill_rate * kv.block_size * self.scheduler.clock.crossings(j)
        return used

    def _record(self, start_s: float, times: list[float], plan: StepPlan, mem, shared_blocks: int | list[int],
                ends: list[float] | None = None) -> None:
        """Hand the recorder one step, or a span of ``len(times)`` decode steps ending at ``ends``."""
        s = self.scheduler
        joins: list[int] = []  # steps at which arrivals during a span join the queue (as stepping adds them)
        if ends is not None:
            arr, i, end = self._arrivals, self._next, ends[-1]
            while arr[i] <= end:
                joins.append(bisect_left(ends, arr[i]) + 1)
                i += 1
        shared: int | list[int]
        if not s.paged:
            shared = 0
        elif isinstance(shared_blocks, int):
            shared = shared_blocks * self.kv.block_size
        else:
            shared = [x * self.kv.block_size for x in shared_blocks]
        self.rec.step(start_s, times, plan, mem, len(s.waiting), s.num_running, len(s.swapped), shared,
                      self._holding, s.step_prompt_tokens, s.step_hit_tokens, ends, joins)

    def _maybe_capture(self, now: float) -> None:
        """Keep the address space at (about) the moment of most waiting requests, or of most memory
        allocated while none wait. NOTE: a new copy only when the queue grows by 5 % (or memory, while
        nothing waits), so a run keeps O(log) copies; the kept moment is within 5 % of the peak. The
        loop calls this only past the thresholds below (a cheap check of every step)."""
        s, kv = self.scheduler, self.kv
        waiting, alloc = len(s.waiting) + len(s.swapped), kv.alloc + kv.held + kv.rounding
        best_w, best_a = self._snap_key
        if waiting > best_w * 1.05 or (waiting == best_w and alloc > best_a * 1.05):
            self._snap_key = (waiting, alloc)
            self._snap = (now, waiting, s.num_running, s.capture())
            best_w, best_a = waiting, alloc
        self._snap_waiting = int(best_w * 1.05)  # more waiting than this, or
        self._snap_alloc = int(best_a * 1.05) - kv.held - kv.rounding if waiting == best_w else kv.capacity  # this

    def snapshot(self) -> dict | None:
        """The kept moment: time, waiting and running counts, and (start, length, class) slot runs."""
        if self._snap is None:
            return None
        t, waiting, running, captured = self._snap
        return {"time_s": t, "num_waiting": waiting, "num_running": running,
                "segments": self.scheduler.segments(captured)}

    def _close_unfinished(self) -> None:
        s = self.scheduler
        running = s.running
        self.log.flush()
        for seq in (running + list(s.waiting) + list(s.swapped) + [b for b in s.batch if b not in running]
                    + list(s.pulling)):
            if seq.group is not None:  # a sample or beam (ids past the requests'): its request is the leader's
                seq = seq.group.members[0]
            if self.log.status[seq.request_id] != FINISHED:
                self.log.unfinished(seq, HORIZON)
        for i in self._ids[self._next:]:  # arrived after the horizon
            self.log.status[i] = UNFINISHED
            self.log.reason[i] = HORIZON
