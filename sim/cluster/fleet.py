"""A fleet: replicas of today's server (each an ``Engine``: same scheduler, allocator and step-time
model) on one clock (``engine.SharedClock``), behind a router that sends each request to a replica at
its arrival.

    arrivals ─► router (live replica state) ─► Engine.push ─► replica's steps ─► shared request log

A router that reads no replica state (``Router.live`` false: round-robin, random) routes every request
ahead instead, and each replica serves its own requests as a lone server does (``Engine.serve``): the
replicas then cannot affect one another, so running them one after the other is the same simulation,
without a push per request and with decode spans priced up to the replica's own next arrival.

The fleet's summary has the single server's metrics (the same names, over all requests; time shares
such as ``busy_fraction`` are means over replicas; ``kv_capacity_tokens`` is the fleet's total),
computed by the same ``summarize``; so a fleet of one replica gives exactly the single server's
results. Per replica: ``replicas`` (one row each, every metric) and ``fleet`` (routing and
load-imbalance figures).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sim.config import PolicyConfig, Scenario, ScenarioError
from sim.engine import Engine, PolicyResult, SharedClock, paced_gc
from sim.metrics import ItlHistogram, RequestLog, SharingCounts, Timeline, summarize
from sim.outputs import Columns
from sim.policy import rejection_reasons, resolve_policy
from sim.schema import HORIZON, MEMORY_CLASSES, REJECTED, UNFINISHED, USED_CLASSES
from sim.cluster.router import LeastOutstanding, Replicas, make_router


def fleet_runs(scenario: Scenario) -> list[tuple[PolicyConfig, str]]:
    """Each policy once per router: named ``policy/router`` when the scenario lists several routers."""
    routers = scenario.cluster.routers
    if len(routers) == 1:
        return [(p, routers[0]) for p in scenario.policies]
    return [(p.model_copy(update={"name": f"{p.name}/{r}"}), r) for p in scenario.policies for r in routers]


def replica_scenarios(scenario: Scenario) -> list[tuple[int, Scenario]]:
    """(group index, the scenario as that group's replicas run it: its GPU and tensor parallelism), one per replica."""
    out = []
    for gi, g in enumerate(scenario.cluster.groups):
        update = {k: v for k, v in (("gpu", g.gpu), ("tensor_parallel", g.tensor_parallel)) if v is not None}
        sc = scenario.model_copy(update=update) if update else scenario
        out += [(gi, sc)] * g.count
    return out


def replica_policy(scenario: Scenario, group: int, sc: Scenario, model, policy: PolicyConfig):
    """The policy as a replica of ``group`` runs it; a GPU that cannot hold the model names the group."""
    try:
        return resolve_policy(sc, model, sc.gpu_spec(), policy)
    except ScenarioError as e:
        if not isinstance(scenario.cluster.replicas, list):
            raise
        # (the GPU and tensor parallelism as a plan labels a shape: "3 x h100" read as three replicas)
        raise ScenarioError(f"cluster.replicas[{group}] ({sc.gpu_spec().name} tp{sc.tensor_parallel}): {e}") from None


class Fleet:
    """One policy's fleet run."""

    def __init__(self, scenario: Scenario, model, policy: PolicyConfig, router: str, requests, executor,
                 record_steps: bool) -> None:
        self.scenario, self.requests, self.router_name = scenario, requests, router
        self.log = RequestLog(requests.arrival_s, requests.prompt_tokens, requests.output_tokens)
        self.engines: list[Engine] = []
        self.kinds: list[tuple[int, str, int]] = []  # (group, gpu, tensor_parallel) per replica
        for gi, sc in replica_scenarios(scenario):
            gpu = sc.gpu_spec()
            resolved = replica_policy(scenario, gi, sc, model, policy)
            self.engines.append(Engine(requests, resolved, executor(sc, model, gpu, resolved, requests),
                                       horizon_s=sc.horizon_s, exact=sc.exact, record_steps=record_steps,
                                       timeline_bin_s=sc.timeline_bin_s, sampling=sc.sampling,
                                       startup_s=sc.startup_s, log=self.log))
            self.kinds.append((gi, gpu.name, sc.tensor_parallel))
        self.router = make_router(router, Replicas(self.engines), requests, scenario.cluster.router_options)

    def run(self) -> PolicyResult:
        r, n = self.requests, len(self.requests)
        groups = [self.engines[[k[0] for k in self.kinds].index(g)] for g in sorted({k[0] for k in self.kinds})]
        reasons = [rejection_reasons(e.resolved, e.kv, r.prompt_tokens, r.output_tokens) for e in groups]
        oks = np.stack([reason == 0 for reason in reasons])  # oks[g, i]: group g can serve request i
        rejected = ~oks.any(axis=0)
        self.log.status[rejected] = REJECTED
        self.log.reason[rejected] = reasons[0][rejected]
        horizon = math.inf if self.scenario.horizon_s is None else self.scenario.horizon_s
        routable = ~rejected & (r.arrival_s < horizon)
        late = ~rejected & ~routable  # arriving at or after the horizon: never routed
        self.log.status[late] = UNFINISHED
        self.log.reason[late] = HORIZON
        order = np.flatnonzero(routable)
        whole = tuple(range(len(self.engines)))
        per = None  # each routed request's candidate replicas (None: any replica can serve any request)
        if not oks[:, order].all():
            masks, inverse = np.unique(oks[:, order].T, axis=0, return_inverse=True)
            sets = [tuple(i for i, k in enumerate(self.kinds) if m[k[0]]) for m in masks]
            sets = [whole if len(c) == len(whole) else c for c in sets]  # (the clock's fast path: ``c is whole``)
            per = [sets[j] for j in inverse.ravel().tolist()]
        if not self.router.live:  # routing reads no replica state: route every request now, and each replica
            self._preassign(order.tolist(), per, whole)  # serves its own like a lone server (its spans priced
            return self._results()  # up to its own next arrival)
        assigned = [-1] * n
        clock = SharedClock(r.arrival_s[order].tolist() + [math.inf], len(self.engines))
        with paced_gc():
            clock.run(self.engines, order.tolist(), per, whole, self.router.route, r.prompt_tokens.tolist(),
                      r.output_tokens.tolist(), assigned,
                      self.router.replicas.loads() if isinstance(self.router, LeastOutstanding) else None)
        self.assigned = np.array(assigned, dtype=np.int16)
        return self._results()

    def _preassign(self, order: list[int], per: list[tuple[int, ...]] | None, whole: tuple[int, ...]) -> None:
        """Route in arrival order, as at the arrivals, then run each replica to its end on its own clock:
        with no state read at routing, replicas never affect one another."""
        route, assigned = self.router.route, np.full(len(self.requests), -1, dtype=np.int16)
        for pos, i in enumerate(order):
            assigned[i] = route(i, whole if per is None else per[pos])
        self.assigned = assigned
        for k, e in enumerate(self.engines):
            e.serve(np.flatnonzero(assigned == k))

    # ------------------------------------------------------------------------------------- results

    def _results(self) -> PolicyResult:
        engines, r = self.engines, self.requests
        end = max(e._end_s for e in engines)
        for e in engines:
            e._close_unfinished()
            e.idle_until(end)
        # NOTE: numpy columns (sim.outputs.Columns), not DataFrames: pandas sliced the whole log once per
        # replica and built every replica's timeline and steps as frames. bench_fleet.py's hour, where this
        # was 3.5 % of least-outstanding's run: 0.28-0.38 -> 0.26-0.28 s of CPU (3 runs each); instructions
        # of its first 4 minutes, simulation and results (bench_instructions.py fleet-lo): 3,581 -> 3,411 M
        log = self.log.columns()
        per = [e.results(log.take(np.flatnonzero(self.assigned == k))) for k, e in enumerate(engines)]
        first, end, summary, tl = fleet_summary(log, engines, r)
        requests = Columns({**log.data, "replica": self.assigned}, log.categories)
        steps, snapshot = merged_steps(per)
        duration = end - first
        routed = np.bincount(self.assigned[self.assigned >= 0], minlength=len(engines))
        used = []  # each replica's KV in use (token states, reservation, internal), time-averaged over the run
        for p, e in zip(per, engines):
            timeline = Columns.of(p.table("timeline"))
            slot_s = sum(timeline[f"mem_{c}_slot_s"].sum() for c in USED_CLASSES)
            used.append(slot_s / (e.kv.capacity * duration) if duration > 0 and e.kv.capacity else 0.0)
        rows = []
        for k, (p, e) in enumerate(zip(per, engines)):
            g, gpu, tp = self.kinds[k]
            rows.append({"replica": k, "group": g, "gpu": gpu, "tensor_parallel": tp, "num_routed": int(routed[k]),
                         "kv_in_use": used[k], **{m: v for m, v in p.summary.items()}})
        replicas = pd.DataFrame(rows)
        fleet = {"router": self.router_name, "num_replicas": len(engines),
                 "load_imbalance_requests": _imbalance(routed), "load_imbalance_kv": _imbalance(np.array(used)),
                 "prefix_hit_rate_tokens": summary.get("prefix_hit_rate_tokens")}
        if hasattr(self.router, "num_capped"):
            fleet.update(num_prefix_affine=self.router.num_affine, num_load_capped=self.router.num_capped)
        pool = engines[0].pool
        groups = None  # several KV groups (sim/hybrid.py): the fleet's slots per group class, summed over replicas
        if any(r.groups is not None for r in per):
            groups = (pd.concat([r.groups for r in per if r.groups is not None], ignore_index=True)
                      .groupby(["bin_start_s", "group", "kind", "window", "groups"], sort=True, as_index=False,
                               observed=True)["slots"]
                      .sum())
        return PolicyResult(per[0].policy, pool, requests, steps, summary, snapshot, tl, replicas=replicas, fleet=fleet,
                            num_events=sum(r.num_events for r in per), groups=groups, layout=per[0].layout)


def _imbalance(x: np.ndarray) -> float | None:
    """max / mean (1: perfectly balanced); None when the mean is 0."""
    m = float(np.mean(x)) if len(x) else 0.0
    return float(np.max(x)) / m if m > 0 else None


def merge_itl(hists: list[ItlHistogram]) -> ItlHistogram:
    if len(hists) == 1:
        return hists[0]
    out = ItlHistogram()
    for h in hists:
        h.flush()
        out.counts += h.counts
        out.count += h.count
    out.total = math.fsum(h.total for h in hists)
    return out


def merge_timelines(timelines: list[Timeline]) -> Timeline:
    """The fleet's bins: every replica's at the widest replica's bin width (widths are the same base
    doubled, so a wide bin is whole narrow ones), summed."""
    if len(timelines) == 1:
        return timelines[0]
    for t in timelines:
        t.flush()
    w = max(t.bin_s for t in timelines)
    parts = []
    for t in timelines:
        f = round(w / t.bin_s)
        d = t.data[: t.n]
        if len(d) % f:
            d = np.vstack([d, np.zeros((f - len(d) % f, d.shape[1]))])
        parts.append(d.reshape(-1, f, d.shape[1]).sum(axis=1))
    n = max(len(p) for p in parts)
    out = Timeline(w, timelines[0].max_bins)
    out.data = np.zeros((max(n, 1), parts[0].shape[1]))
    for p in parts:
        out.data[: len(p)] += p
    out.n = n
    return out


def merge_sharing(counts: list[SharingCounts | None]) -> SharingCounts | None:
    if counts[0] is None or len(counts) == 1:
        return counts[0]
    c = counts[0]
    offload = None
    if c.offload is not None:  # the CPU tier's counts add up over replicas (the rates are made from the sums)
        offload = {k: sum(x.offload[k] for x in counts) for k in c.offload}
    return SharingCounts(c.paged, c.caching, c.block_size, sum(x.prefill_tokens_saved for x in counts),
                         sum(x.num_cow_copies for x in counts), sum(x.num_evicted_blocks for x in counts),
                         sum(x.num_slab_copies for x in counts), offload=offload)


def fleet_summary(frame: Columns | pd.DataFrame, engines: list[Engine], requests) -> tuple[float, float, dict, pd.DataFrame]:
    """(first arrival, end, summary, merged timeline) of ``engines`` serving ``requests`` together: today's
    metrics by the same ``summarize`` over every request of ``frame``; KV capacity, steps and preemptions
    summed over replicas; memory shares and ``busy_fraction`` means over them (a mean of one replica is its
    own value, bit for bit)."""
    first = float(requests.arrival_s[0]) if len(requests) else 0.0
    end = max(e._end_s for e in engines)
    capacity = sum(e.kv.capacity for e in engines)
    tl = merge_timelines([e.rec.timeline for e in engines]).frame(capacity, end, first)
    mem = np.array([tl[f"mem_{c}_slot_s"].sum() for c in MEMORY_CLASSES])
    recs = [e.rec for e in engines]
    summary = summarize(Columns.of(frame), merge_itl([x.itl for x in recs]), mem, end - first, capacity,
                        float(tl.busy_s.sum()), sum(x.num_steps for x in recs), sum(x.seq_steps for x in recs),
                        int(tl.num_preempted.sum()), decode_steps=sum(x.decode_steps for x in recs),
                        decode_seq_steps=sum(x.decode_seq_steps for x in recs),
                        running_request_s=math.fsum(x.running_request_s for x in recs),
                        sharing=merge_sharing([e.sharing_counts() for e in engines]),
                        shared_slot_s=float(tl.shared_slot_s.sum()))
    if summary["busy_fraction"] is not None:
        summary["busy_fraction"] /= len(engines)  # a mean over replicas, like the memory shares
    if requests.beyond_horizon:
        summary["num_requests"] += requests.beyond_horizon
        summary["num_unfinished"] += requests.beyond_horizon
    return first, end, summary, tl


def merged_steps(per: list[PolicyResult]) -> tuple[Columns, dict | None]:
    """Every replica's steps (a ``replica`` column), and the snapshot of the replica with the longest queue
    (its ``replica`` named)."""
    parts = [Columns.of(p.table("steps")) for p in per]
    steps = Columns({**{k: np.concatenate([c[k] for c in parts]) for k in parts[0].data},
                     "replica": np.repeat(np.arange(len(parts), dtype=np.int16), [len(c) for c in parts])},
                    parts[0].categories)
    snaps = [(p.snapshot["num_waiting"], -k, p.snapshot) for k, p in enumerate(per) if p.snapshot is not None]
    if not snaps:
        return steps, None
    waiting, k, snap = max(snaps, key=lambda x: x[:2])
    return steps, {**snap, "replica": -k}


def run_fleet(scenario: Scenario, model, policy: PolicyConfig, router: str, requests, executor,
              record_steps: bool) -> PolicyResult:
    """One policy of a ``cluster:`` scenario, run as a whole fleet on the scenario's requests (a
    disaggregated one with prefill and decode pools: ``sim/cluster/disagg.py``)."""
    if scenario.cluster.disaggregated:
        from sim.cluster.disagg import DisaggFleet

        return DisaggFleet(scenario, model, policy, router, requests, executor, record_steps).run()
    return Fleet(scenario, model, policy, router, requests, executor, record_steps).run()
