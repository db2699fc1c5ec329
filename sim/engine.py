"""The SimPy engine: one server process that plans a step, prices it, waits that long, and completes it.

    arrivals ─► Scheduler.schedule() ─► StepPlan ─► executor ─► seconds ─► Scheduler.complete()

Arrivals are a sorted array, not processes: the server takes every request that has arrived when a
step starts. One SimPy event per step, or per *span*: when the planned step is decode-only and
nothing can change (no finish, no block shortage, no arrival) for ``k`` steps, those ``k`` steps are
priced in closed form and taken at once. ``exact=True`` steps every iteration: the reference that
spans must reproduce.
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Callable

import numpy as np
import pandas as pd
import simpy

from sim.catalog import GIB, ModelSpec
from sim.config import PolicyConfig
from sim.core import Group, Sequence
from sim.kv import (MEMORY_CLASSES, BlockPool, BuddyAllocator, ContiguousKv, FirstFitAllocator, KvPool, PagedKv,
                    breakdown)
from sim.metrics import FINISHED, REJECTED, STEP_COLUMNS, ItlHistogram, RequestLog, Timeline, summarize
from sim.scheduler import Scheduler
from sim.sharing import SharedBlockPool, SharedPagedKv
from sim.steptime import Executor
from sim.workload import RequestTable


@dataclass
class PolicyResult:
    policy: PolicyConfig
    pool: KvPool
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict
    snapshot: dict | None = None  # the KV address space at the moment of most waiting requests
    timeline: pd.DataFrame | None = None  # fixed-width time bins (see metrics.Timeline)


def resolved_token_budget(policy: PolicyConfig, model: ModelSpec) -> int:
    if policy.max_num_batched_tokens is not None:
        return policy.max_num_batched_tokens
    return 2048 if policy.prefill == "chunked" else max(2048, model.max_model_len)


def make_kv(policy: PolicyConfig, pool: KvPool, model: ModelSpec, sharing: bool = False) -> PagedKv | ContiguousKv:
    """The policy's KV manager; ``sharing`` (prefix caching, samples or beams) needs reference counts."""
    a = policy.allocator
    if a.kind == "paged":
        watermark = int(a.watermark * pool.num_blocks)
        if sharing or policy.prefix_caching:
            return SharedPagedKv(SharedBlockPool(pool.num_blocks, pool.block_size, watermark), policy.prefix_caching)
        return PagedKv(BlockPool(pool.num_blocks, pool.block_size, watermark))
    alloc = BuddyAllocator(pool.num_slots) if a.placement == "buddy" else FirstFitAllocator(pool.num_slots)
    return ContiguousKv(alloc, a.reserve, model.max_model_len)


def rejection_reasons(policy: PolicyConfig, kv, model: ModelSpec, budget: int, prompt: np.ndarray,
                      output: np.ndarray, width: int = 1) -> np.ndarray:
    """Why each request can never be served (0 = it can). Checked up front, so the simulation always
    progresses: a request admitted alone always fits, and the oldest running one is never preempted."""
    reason = np.zeros(len(prompt), dtype=np.int8)
    total = prompt + output
    over_pool = kv.never_fits(prompt, output, width)
    if policy.batching == "continuous" and policy.prefill != "chunked":
        # a prefill is never split: a preempted (recomputed) request re-prefills all its tokens
        prefill_max = total - 1 if kv.kind == "paged" else prompt
        reason[prefill_max > budget] = 3
    reason[over_pool] = 2
    reason[total > model.max_model_len] = 1
    return reason


class Engine:
    def __init__(self, requests: RequestTable, policy: PolicyConfig, model: ModelSpec, pool: KvPool,
                 executor: Executor, *, horizon_s: float | None = None, exact: bool = False,
                 record_steps: bool = True, timeline_bin_s: float = 1.0, sampling=None,
                 progress: Callable[[int, int], None] | None = None, startup_s: float = 0.0) -> None:
        self.requests = requests
        self.policy = policy
        self.model = model
        self.pool = pool
        self.executor = executor
        self.horizon_s = horizon_s
        self._horizon = math.inf if horizon_s is None else horizon_s
        self.startup_s = startup_s  # no step runs before this (a server's warm-up); requests still arrive
        self.exact = exact
        self.record_steps = record_steps
        self.progress = progress
        self.sampling = sampling  # parallel samples or beams: every request is a group
        self.width = 1 if sampling is None else (sampling.n if sampling.kind == "parallel" else sampling.width)
        self.kv = make_kv(policy, pool, model, sharing=sampling is not None)
        swap_pool = None
        if (policy.preemption == "swap" or sampling is not None) and self.kv.kind == "paged":
            cpu_blocks = int(policy.swap_space_gib * GIB) // (pool.block_size * pool.kv_bytes_per_token)
            swap_pool = BlockPool(cpu_blocks, pool.block_size)
        self.budget = resolved_token_budget(policy, model)
        self.itl = ItlHistogram()
        self.timeline = Timeline(timeline_bin_s)
        self.scheduler = Scheduler(policy, self.kv, self.budget, swap_pool, self.itl)
        self.scheduler.next_seq_id = len(requests)  # forked sequences get ids past the requests'
        self.log = RequestLog(requests.arrival_s, requests.prompt_tokens, requests.output_tokens)
        self.steps = array("d")  # step records, row after row (8 bytes a value, not a Python object)
        self.num_steps = 0
        self.seq_steps = 0  # sequences summed over steps
        self.decode_steps = 0  # steps in which some sequence decodes
        self.decode_seq_steps = 0  # decoding sequences summed over steps
        self.running_request_s = 0.0  # requests holding KV, integrated over time
        self._holding = 0  # requests holding KV during the step being taken
        self.num_done = 0
        self._snap_key: tuple = (0, 0)
        self._snap = None
        self._snap_waiting, self._snap_alloc = -1, -1  # below these, _maybe_capture has nothing to do

    # ------------------------------------------------------------------------------------ run

    def run(self) -> PolicyResult:
        r = self.requests
        reason = rejection_reasons(self.policy, self.kv, self.model, self.budget, r.prompt_tokens, r.output_tokens,
                                   self.width)
        self.log.status[reason > 0] = REJECTED
        self.log.reason[:] = reason
        self._ids = np.flatnonzero(reason == 0).tolist()
        # plain Python lists for the hot loop, with an arrival at infinity as a sentinel
        self._arrivals = r.arrival_s[self._ids].tolist() + [math.inf]
        self._prompts = r.prompt_tokens[self._ids].tolist()
        self._outputs = r.output_tokens[self._ids].tolist()
        self._hashes = r.prefix_hashes if self.kv.caching else None
        self._next = 0
        env = simpy.Environment()
        env.process(self._serve(env))
        env.run()
        self._end_s = env.now
        self._close_unfinished()
        lost = int((self.log.status == 0).sum())
        if lost:  # the accounting identity is a guarantee: never end a run without it
            raise RuntimeError(f"{lost} requests neither finished, rejected nor unfinished: a bug, please report it")
        req = self.log.frame()
        duration = self._end_s - (float(r.arrival_s[0]) if len(r) else 0.0)
        timeline = self.timeline.frame(self.kv.capacity, self._end_s)
        mem_slot_s = np.array([timeline[f"mem_{c}_slot_s"].sum() for c in MEMORY_CLASSES])
        summary = summarize(req, self.itl, mem_slot_s, duration, self.kv.capacity, float(timeline.busy_s.sum()),
                            self.num_steps, self.seq_steps, int(timeline.num_preempted.sum()),
                            decode_steps=self.decode_steps, decode_seq_steps=self.decode_seq_steps,
                            running_request_s=self.running_request_s)
        if isinstance(self.kv, SharedPagedKv):
            summary.update(self._sharing_summary(req, mem_slot_s[:3].sum(), float(timeline.shared_slot_s.sum())))
        elif self.sampling is not None:  # contiguous slabs cannot share: samples and beams are copies
            summary.update({"memory_saved_by_sharing": 0.0, "num_slab_copies": self.scheduler.num_slot_copies})
        steps = pd.DataFrame(np.frombuffer(self.steps, dtype=np.float64).reshape(-1, len(STEP_COLUMNS)),
                             columns=list(STEP_COLUMNS))
        counts = [c for c in STEP_COLUMNS if c.startswith("num_") or c == "step_index" or c == "prefill_attention_pairs"]
        steps[counts] = steps[counts].astype(np.int64)
        return PolicyResult(self.policy, self.pool, req, steps, summary, self.snapshot(), timeline)

    def _sharing_summary(self, req: pd.DataFrame, used: float, shared: float) -> dict:
        """Block sharing's figures: prefix-cache hits (finished requests), prefill saved, copies; ``used``
        and ``shared``: slot-seconds allocated, and saved by sharing."""
        kv, B = self.kv, self.kv.block_size
        fin = req[req.status == "finished"]
        prompt, hit = fin.prompt_tokens.to_numpy(), fin.prefix_hit_tokens.to_numpy()
        out = {"prefill_tokens_saved": self.scheduler.prefill_tokens_saved, "num_cow_copies": kv.num_copies,
               "num_evicted_blocks": kv.pool.num_evicted,
               # the paper's Fig. 15 measure: 1 - blocks used with sharing / blocks without
               "memory_saved_by_sharing": shared / (used + shared) if used else None}
        if kv.caching:
            out["prefix_hit_rate_tokens"] = float(hit.sum() / prompt.sum()) if prompt.sum() else None
            full = (prompt // B).sum()
            out["prefix_hit_rate_blocks"] = float((hit // B).sum() / full) if full else None
        return out

    def _admit_arrivals(self, now: float) -> None:
        arr, nxt = self._arrivals, self._next
        while arr[nxt] <= now:
            i = self._ids[nxt]
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
        self._next = nxt

    def _next_event_s(self) -> float:
        """The next time the scheduler must look again regardless of the batch: an arrival or the horizon."""
        return min(self._arrivals[self._next], self._horizon)

    def _serve(self, env: simpy.Environment):
        sched, executor, log, arrivals = self.scheduler, self.executor, self.log, self._arrivals
        loops = 0
        if self.startup_s > 0:
            yield env.timeout(min(self.startup_s, self._horizon))
        while True:
            now = env.now
            if now >= self._horizon:
                return
            if arrivals[self._next] <= now:
                self._admit_arrivals(now)
            plan = sched.schedule()
            if plan is None:
                if sched.has_work():
                    raise RuntimeError(f"scheduler stalled at t={now:.3f}s with {len(sched.waiting)} waiting, "
                                       f"{len(sched.swapped)} swapped: a bug, please report it")
                t = self._next_event_s()
                if math.isinf(t):
                    return
                self._record(now, [t - now], None, sched.memory(), idle=True)
                yield env.timeout(t - now)
                continue
            if len(sched.waiting) + len(sched.swapped) > self._snap_waiting or self.kv.alloc > self._snap_alloc:
                self._maybe_capture(now)  # the address space as this step holds it
            self._holding = sched.num_requests_holding_kv()  # as planned: those that finish in it included
            if sched.first_admitted:  # the requests this step schedules for the first time
                for seq in sched.first_admitted:
                    log.scheduled(seq.request_id, now)
            k = 1 if self.exact else sched.span_limit(plan)
            if k > 1:
                first = executor.decode_span_s(plan, 1)  # None: no closed form (a real executor)
                stop = self._next_event_s() if sched.arrivals_matter() else self._horizon
                if first is None:
                    k = 1
                elif stop < math.inf:  # price only the steps that can start before it (step times only grow
                    # along a span; if a model's did not, the span would just end sooner: still exact)
                    k = min(k, int((stop - now) / first[0]) + 2)
            if k == 1:
                dt = executor.step_time_s(plan)
                yield env.timeout(dt)
                self._record(now, [dt], plan, sched.complete(env.now))
            else:
                times = executor.decode_span_s(plan, k)
                ends = list(accumulate(times, initial=now))[1:]  # the clock as stepping would advance it
                cut = bisect_left(ends, stop)
                if cut < k:  # stop at the first step that ends at or after the next admissible arrival
                    ends, times = ends[:cut + 1], times[:cut + 1]
                yield env.timeout(ends[-1] - now)
                self._record(now, times, plan, sched.complete_span(ends), ends=ends)
            done = sched.done
            if done:
                self.timeline.add_finishes(env.now, len(done))
                for seq, end_s in done:
                    log.finish(seq, end_s)
                self.num_done += len(done)
                done.clear()
            loops += 1
            if self.progress is not None and loops % 512 == 0:
                self.progress(self.num_done, len(self._ids))

    def _record(self, start_s: float, times: list[float], plan, mem, idle: bool = False,
                ends: list[float] | None = None) -> None:
        """Account one step or an idle gap (``mem``: the five memory classes), or a span of
        ``len(times)`` decode steps ending at ``ends`` (``mem``: what ``complete_span`` returns)."""
        s, kv = self.scheduler, self.kv
        k = len(times)
        waiting = len(s.waiting)
        shared = s.shared_blocks * kv.block_size if kv.kind == "paged" else 0  # slots sharing saves
        joins: list[int] = []  # steps at which arrivals during a span join the queue (as stepping adds them)
        if ends is None:
            total = times[0]
            slot_s = [m * total for m in mem]
            waiting_s = waiting * total
        else:
            total = sum(times)
            filled, alloc, capped, rounding, held, blocked = mem
            # the classes are linear in (filled, alloc, capped): integrate those over the span's steps
            f, a, c = (sum(map(mul, times, x)) if x.__class__ is list else x * total for x in (filled, alloc, capped))
            slot_s = breakdown(kv.capacity * total, f, a, c, rounding * total, held * total, blocked)
            waiting_s = waiting * total
            arr, i, end = self._arrivals, self._next, ends[-1]
            while arr[i] <= end:
                j = bisect_left(ends, arr[i]) + 1
                joins.append(j)
                waiting_s += end - ends[j - 1]
                i += 1
        if idle:
            self.timeline.add(start_s, times, [0.0, 0.0, waiting_s, 0, 0, 0, 0, 0, *slot_s, 0, 0, shared * total, 0.0])
            k = 0
        else:
            n, holding = plan.num_seqs, self._holding
            totals = [total, n * total, waiting_s, k, plan.num_sampled * k, plan.num_prefill_tokens * k,
                      plan.num_preempted, 0, *slot_s, s.step_prompt_tokens, s.step_hit_tokens, shared * total,
                      holding * total]

            def per_step():  # only for a span across a bin edge
                filled, alloc, capped, rounding, held, blocked = mem
                for j, t in enumerate(times):
                    w = waiting + sum(1 for x in joins if x <= j)
                    cls = breakdown(kv.capacity, filled[j], alloc[j] if alloc.__class__ is list else alloc,
                                    capped[j] if capped.__class__ is list else capped, rounding, held, blocked)
                    yield [t, n * t, w * t, 1, plan.num_sampled, 0, 0, 0, *(t * x for x in cls), 0, 0, shared * t,
                           holding * t]

            self.timeline.add(start_s, times, totals, per_step if k > 1 else None)
            self.num_steps += k
            self.seq_steps += k * n
            if plan.num_decode_tokens:
                self.decode_steps += k
                self.decode_seq_steps += k * plan.num_decode_tokens
            self.running_request_s += holding * total
        if self.record_steps:
            if idle:
                shape = (0, 0, 0, 0, 0, 0, waiting, s.num_running, len(s.swapped), 0, 0)
            else:
                shape = (plan.num_seqs, plan.num_prefill_tokens, plan.num_decode_tokens, plan.num_sampled,
                         plan.prefill_attention_pairs, plan.decode_context_tokens, waiting, s.num_running,
                         len(s.swapped), plan.num_preempted, len(plan.swap_in) + len(plan.swap_out))
            row = (self.num_steps - k, start_s, total, k) + shape
            self.steps.extend(row)
            self.steps.extend([v / total if total > 0 else v for v in slot_s])

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
        for seq in running + list(s.waiting) + list(s.swapped) + [b for b in s.batch if b not in running]:
            if self.log.status[seq.seq_id] != FINISHED:
                self.log.unfinished(seq, 4)
        for i in self._ids[self._next:]:  # arrived after the horizon
            self.log.status[i] = 3
            self.log.reason[i] = 4
