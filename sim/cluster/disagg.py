"""Prefill/decode disaggregation: a prefill pool and a decode pool of today's engines (same scheduler,
allocator and step-time model) on one SimPy clock, ``cluster: {prefill, decode, kv_transfer}``.

    arrival ─► router ─► prefill replica: prompt + first token; its KV stays there (held)
            ─► router ─► decode replica's queue ─► admitted: KV for prompt + first token reserved
            ─► transfer over the replicas' links      ─► the prefill replica frees the KV,
                                                           the decode replica decodes the rest

The rules, each decided here:

- A prefill replica runs a request as one whose output is one token (its normal scheduler and allocator;
  prefix caching included): prefill, then the first token is sampled. Its KV (the prompt's tokens) stays
  allocated there -- counted in its memory like a running request's -- until the transfer ends; the
  replica frees it at its next step boundary (at once if idle), as vLLM's connectors report finished sends
  to the next scheduler step.
- At that first token the router (the scenario's, with its own state per pool) picks a decode replica,
  whose waiting queue takes it (FCFS with its other waiting requests). The decode replica's scheduler
  admits it like any request -- its allocator must find the KV for prompt + first token, under
  ``max_num_seqs`` -- but computes nothing: the transfer starts then (the decode side pulls when it
  schedules, as vLLM's PD connectors do). Back-pressure: until that admission, the prefill replica keeps
  the KV.
- Transfers: bytes = prompt tokens x ``ModelSpec.kv_bytes_per_token`` of the whole model (all layers and
  KV heads, once, at the policy's ``kv_cache_dtype``). Every GPU has its own link of the given bandwidth
  (one NIC per GPU): a replica's ranks move their shares in parallel, so the stream takes the bytes a
  decode rank receives (its share, at its tensor parallelism) / bandwidth, times decode ranks / prefill
  ranks when the prefill replica has fewer; at equal parallelism, bytes / (bandwidth x ranks). The first
  byte lands ``latency`` after it leaves: time = stream + latency. A prefill replica sends, and a decode
  replica receives, one stream at a time (in the order decode replicas admit them): a transfer starts
  when both ends are free, and each end is busy for the stream (not the latency).
- The first token reaches the user with the KV, when the transfer ends: TTFT = transfer end - arrival,
  so TTFT includes prefill queueing, prefill, waiting for a decode replica, transfer queueing and the
  transfer. ITL and TPOT count from there: token 2 comes at the decode replica's first step after the
  KV landed. A one-token request ends on its prefill replica at its first token (no transfer).
- A request preempted on a decode replica by recompute re-prefills there, as any request does.
- Up front: a request either pool could never serve (the prefill pool: its prompt; the decode pool: the
  whole request) is rejected, so the simulation always progresses.

Results: the fleet's summary has today's metrics over all requests (``summarize``); ``requests`` adds
``prefill_replica``, ``prefill_end_s``, ``decode_wait_ms`` (first token on the prefill replica to admission
on the decode replica), ``transfer_queue_ms``, ``transfer_ms`` and ``transfer_bytes``, and ``replica`` is
the decode replica; ``replicas`` has a row per replica of both pools (``pool``; ``group`` 0 prefill, 1
decode); ``fleet`` has per-pool figures and the transfers'.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import simpy
from simpy.events import URGENT

from sim.config import PolicyConfig, PoolConfig, Scenario, ScenarioError
from sim.core import Sequence
from sim.engine import AHEAD, Engine, PolicyResult, paced_gc
from sim.metrics import RequestLog
from sim.policy import rejection_reasons, resolve_policy
from sim.schema import (EXCEEDS_KV_POOL, EXCEEDS_MAX_MODEL_LEN, FINISHED, HORIZON, PENDING, PREFILL_EXCEEDS_TOKEN_BUDGET,
                        REASONS, REJECTED, UNFINISHED, USED_CLASSES)
from sim.cluster.fleet import _imbalance, fleet_summary, merged_steps
from sim.cluster.router import Replicas, make_router

POOLS = ("prefill", "decode")


def pool_scenarios(scenario: Scenario) -> list[tuple[str, PoolConfig, Scenario]]:
    """(pool name, its config, the scenario as its replicas run it: their GPU and tensor parallelism)."""
    c = scenario.cluster
    out = []
    for name, cfg in (("prefill", c.prefill), ("decode", c.decode)):
        update = {k: v for k, v in (("gpu", cfg.gpu), ("tensor_parallel", cfg.tensor_parallel)) if v is not None}
        out.append((name, cfg, scenario.model_copy(update=update) if update else scenario))
    return out


def pool_policy(name: str, sc: Scenario, model, policy: PolicyConfig):
    """The policy as a replica of pool ``name`` runs it; what disaggregation does not simulate, or a GPU
    that cannot hold the model, is an error naming the pool."""
    where = f"cluster.{name} ({sc.gpu_spec().name} tp{sc.tensor_parallel})"  # (as a plan labels a shape)
    try:
        r = resolve_policy(sc, model, sc.gpu_spec(), policy)
    except ScenarioError as e:
        raise ScenarioError(f"{where}: {e}") from None
    if sc.sampling is not None:
        raise ScenarioError(f"{where}: parallel samples and beam search are not simulated with prefill/decode "
                            f"disaggregation (drop sampling)")
    if policy.batching == "static":
        raise ScenarioError(f"{where}: policy {policy.name}: static batching is not simulated with prefill/decode "
                            f"disaggregation (use continuous batching)")
    if r.layout is not None and not r.layout.single:
        fix = ("its Mamba layers have no other form: run it colocated" if any(g.kind == "mamba" for g in r.layout.groups)
               else "set hybrid_allocator: false")
        raise ScenarioError(f"{where}: policy {policy.name}: {model.name}'s several KV groups are not simulated with "
                            f"prefill/decode disaggregation ({fix})")
    return r


def _at(env: simpy.Environment, t: float) -> simpy.Event:
    """An urgent event at exactly time ``t`` (``now + (t - now)`` can miss ``t`` by a rounding): the
    router acts at an arrival before any replica event of the same time."""
    now = env.now
    d = t - now
    while now + d < t:
        d = math.nextafter(d, math.inf)
    while d > 0 and now + d > t:
        d = math.nextafter(d, -math.inf)
    ev = simpy.Event(env)
    ev._ok, ev._value = True, None
    env.schedule(ev, URGENT, d)
    return ev


class _Feed:
    """What a pool's replicas read of their arrivals (``Engine.attach``)."""

    def __init__(self, fleet: "DisaggFleet", n: int) -> None:
        self.fleet, self.n, self.closed = fleet, n, False

    def expected_next_s(self) -> float:
        """How far a replica of the pool prices a decode span ahead: the fleet's arrival ``AHEAD`` times as
        many ahead as the pool has replicas (as ``SharedClock.expected_next_s``)."""
        f = self.fleet
        return f._times[min(f._pos + AHEAD * self.n - 1, len(f._times) - 1)]


class DisaggFleet:
    """One policy's disaggregated fleet run."""

    def __init__(self, scenario: Scenario, model, policy: PolicyConfig, router: str, requests, executor,
                 record_steps: bool) -> None:
        self.scenario, self.requests, self.router_name = scenario, requests, router
        self.env = simpy.Environment()
        self.logs = {p: RequestLog(requests.arrival_s, requests.prompt_tokens, requests.output_tokens) for p in POOLS}
        self.pools: dict[str, list[Engine]] = {}
        self.kinds: dict[str, tuple[str, int]] = {}  # pool -> (gpu, tensor parallelism)
        for name, cfg, sc in pool_scenarios(scenario):
            gpu = sc.gpu_spec()
            resolved = pool_policy(name, sc, model, policy)
            self.pools[name] = [Engine(requests, resolved, executor(sc, model, gpu, resolved, requests),
                                       horizon_s=sc.horizon_s, exact=sc.exact, record_steps=record_steps,
                                       timeline_bin_s=sc.timeline_bin_s, startup_s=sc.startup_s, log=self.logs[name])
                                for _ in range(cfg.replicas)]
            self.kinds[name] = (gpu.name, sc.tensor_parallel)
        self.prefill, self.decode = self.pools["prefill"], self.pools["decode"]
        self.routers = {p: make_router(router, Replicas(self.pools[p]), requests, scenario.cluster.router_options,
                                       "" if p == "prefill" else p) for p in POOLS}
        self.feeds = {p: _Feed(self, len(self.pools[p])) for p in POOLS}
        self.link = scenario.cluster.link
        # the one KV-bytes function, for the whole model (every layer and KV head, once) at the policy's dtype
        dtype = 1 if policy.kv_cache_dtype == "fp8" else None
        self.bytes_per_token = model.kv_bytes_per_token(1, dtype)
        # on the wire: each GPU has its own link (one NIC per GPU), so a replica's ranks move their shares in
        # parallel; a decode rank receives its share (kv_bytes_per_token at its tensor parallelism: MLA's
        # latent and KV heads fewer than ranks are whole on every rank), and a prefill pool of fewer ranks
        # sends each of its links' share of the decode ranks' bytes
        tp_p, tp_d = self.kinds["prefill"][1], self.kinds["decode"][1]
        self.wire_bytes_per_token = model.kv_bytes_per_token(tp_d, dtype) * max(1.0, tp_d / tp_p)
        for e in self.prefill:
            e.scheduler.handoff = True
            e.on_handoff = self._handoff
        for e in self.decode:
            e.on_pull = self._pull

    def run(self) -> PolicyResult:
        r, n = self.requests, len(self.requests)
        pe, de = self.prefill[0], self.decode[0]
        pre = rejection_reasons(pe.resolved, pe.kv, r.prompt_tokens, np.ones(n, dtype=r.output_tokens.dtype))
        dec = rejection_reasons(de.resolved, de.kv, r.prompt_tokens, r.output_tokens)
        # either pool's reason, the one a colocated server would give first (max length, then the KV pool,
        # then the token budget: sim.policy.rejection_reasons; the prefill pool sees one output token, so
        # its own reason could hide the decode side's)
        rank = np.zeros(max(REASONS) + 1, dtype=np.int8)
        rank[[PREFILL_EXCEEDS_TOKEN_BUDGET, EXCEEDS_KV_POOL, EXCEEDS_MAX_MODEL_LEN]] = (1, 2, 3)
        reason = np.where(rank[dec] >= rank[pre], dec, pre)
        rejected = reason > 0
        horizon = self._horizon = math.inf if self.scenario.horizon_s is None else self.scenario.horizon_s
        routable = ~rejected & (r.arrival_s < horizon)
        late = ~rejected & ~routable
        for log in self.logs.values():
            log.status[rejected] = REJECTED
            log.reason[rejected] = reason[rejected]
            log.status[late] = UNFINISHED
            log.reason[late] = HORIZON
        order = np.flatnonzero(routable)
        self._order, self._times, self._pos = order.tolist(), r.arrival_s[order].tolist() + [math.inf], 0
        self._to_hand_off = len(order)  # routed requests not yet past their prefill
        self.prefill_of = np.full(n, -1, dtype=np.int16)
        self.decode_of = np.full(n, -1, dtype=np.int16)
        self.times = {k: np.full(n, np.nan) for k in ("prefill_end_s", "admit_s", "start_s", "end_s")}
        self._source: dict[int, tuple[Engine, Sequence]] = {}
        self._link_free = [0.0] * len(self.prefill)  # when each prefill replica's links are free to send
        self._ingress_free = [0.0] * len(self.decode)  # when each decode replica's links are free to receive
        env = self.env
        env.process(self._route(env))
        for p in POOLS:
            for e in self.pools[p]:
                e.attach(env, self.feeds[p])
        with paced_gc():
            env.run()
        return self._results()

    # ------------------------------------------------------------------------------- the flow

    def _route(self, env: simpy.Environment):
        route, times, engines = self.routers["prefill"].route, self._times, self.prefill
        cands = tuple(range(len(engines)))
        for pos, i in enumerate(self._order):
            t = times[pos]
            if t > env.now:
                yield _at(env, t)
            self._pos = pos + 1
            k = route(i, cands)
            self.prefill_of[i] = k
            engines[k].push(i, t, int(self.requests.prompt_tokens[i]), 1)
        self._close("prefill")
        if not self._to_hand_off:
            self._close("decode")

    def _close(self, pool: str) -> None:
        """No request will come to ``pool`` any more: its idle replicas with no transfer pending end."""
        self.feeds[pool].closed = True
        for e in self.pools[pool]:
            if not e.scheduler.awaits_transfer():
                e.wake(None)

    def _handoff(self, engine: Engine, done: list, now: float) -> None:
        """A prefill replica sampled these requests' first tokens (each ``(sequence, time)``)."""
        r = self.requests
        cands = tuple(range(len(self.decode)))
        for seq, t in done:
            i = seq.request_id
            self.times["prefill_end_s"][i] = t
            self._to_hand_off -= 1
            out = int(r.output_tokens[i])
            if out == 1:  # done at its first token: nothing to transfer
                engine.deliver(seq, t)
                self.logs["decode"].finish(seq, t)
                continue
            d = self.routers["decode"].route(i, cands)
            de = self.decode[d]
            remote = Sequence(i, seq.arrival_s, seq.prompt_tokens, out)
            remote.num_computed_tokens = seq.prompt_tokens  # its KV: on the prefill replica
            remote.num_output_tokens = 1
            remote.prefix_hit_tokens = 0  # counted on the prefill replica
            if de._hashes is not None:
                remote.prefix_ids, remote.hash_block = de._hashes.of(i), de._hashes.block_size
            self.decode_of[i] = d
            self._source[i] = (engine, seq)
            de.push(i, t, int(self.requests.prompt_tokens[i]), int(self.requests.output_tokens[i]), seq=remote)
        if self.feeds["prefill"].closed and not self._to_hand_off:
            self._close("decode")

    def _pull(self, engine: Engine, seqs: list[Sequence], now: float) -> None:
        """A decode replica admitted these requests (their KV reserved): transfer their KV."""
        link = self.link
        for seq in seqs:
            i = seq.request_id
            pe, pseq = self._source.pop(i)
            p, d = int(self.prefill_of[i]), int(self.decode_of[i])
            start = max(now, self._link_free[p], self._ingress_free[d])
            if start >= self._horizon:  # its link is busy past the horizon: this transfer never starts in the run
                self.times["admit_s"][i] = now
                continue
            sent = start + seq.prompt_tokens * self.wire_bytes_per_token / link.bytes_per_s
            self._link_free[p] = self._ingress_free[d] = sent  # both ends busy while it streams
            end = sent + link.latency_s
            self.times["admit_s"][i], self.times["start_s"][i], self.times["end_s"][i] = now, start, end
            ev = _at(self.env, end)
            ev.callbacks.append(lambda _, a=(pe, pseq, engine, seq, end): self._landed(*a))

    @staticmethod
    def _landed(pe: Engine, pseq: Sequence, de: Engine, seq: Sequence, t: float) -> None:
        pe.deliver(pseq, t)
        de.deliver(seq, t)

    # ------------------------------------------------------------------------------- results

    def _merged_log(self) -> RequestLog:
        """The decode log completed from the prefill log: a request that never reached the decode pool
        has its prefill status; first scheduling, prefix hits and preemptions come from both."""
        p, d = self.logs["prefill"], self.logs["decode"]
        never = d.status == PENDING
        for col in ("status", "reason", "first_token_s", "finish_s", "generated_tokens"):
            getattr(d, col)[never] = getattr(p, col)[never]
        stuck = never & (d.status == FINISHED)  # past its prefill, not on a decode replica: cannot happen
        if stuck.any():
            raise RuntimeError(f"{int(stuck.sum())} requests were lost between the pools: a bug, please report it")
        d.first_scheduled_s[:] = p.first_scheduled_s
        d.prefix_hit_tokens[:] = p.prefix_hit_tokens
        d.num_preemptions += np.where(never, 0, p.num_preemptions)
        return d

    def _results(self) -> PolicyResult:
        r = self.requests
        engines = self.prefill + self.decode
        end = max(e._end_s for e in engines)
        for e in engines:
            e._close_unfinished()
            e.idle_until(end)
        # a prefill replica makes each request's first token only: no time per output token, no latency per
        # output token of its own (its log keeps the request's whole output length, which gave TPOT 0)
        prefill_frame = self.logs["prefill"].frame().assign(tpot_ms=np.nan, normalized_latency_s=np.nan)
        frame = self._merged_log().frame()
        t = self.times
        with np.errstate(invalid="ignore"):
            frame = frame.assign(
                # ``replicas.parquet``'s numbering: the prefill pool's replicas first, then the decode pool's
                replica=np.where(self.decode_of >= 0, self.decode_of + len(self.prefill), -1).astype(np.int16),
                prefill_replica=self.prefill_of, prefill_end_s=t["prefill_end_s"],
                decode_wait_ms=(t["admit_s"] - t["prefill_end_s"]) * 1e3,
                transfer_queue_ms=(t["start_s"] - t["admit_s"]) * 1e3,
                transfer_ms=(t["end_s"] - t["start_s"]) * 1e3,
                transfer_bytes=np.where(np.isnan(t["start_s"]), 0, r.prompt_tokens * self.bytes_per_token))
        per = [e.results(prefill_frame.iloc[np.flatnonzero(self.prefill_of == k)]) for k, e in enumerate(self.prefill)]
        per += [e.results(frame.iloc[np.flatnonzero(self.decode_of == k)]) for k, e in enumerate(self.decode)]
        first, end, summary, tl = fleet_summary(frame, engines, r)
        duration = end - first
        steps, snapshot = merged_steps(per)
        rows, pools = [], {}
        for name, assigned, offset in (("prefill", self.prefill_of, 0), ("decode", self.decode_of, len(self.prefill))):
            pool = self.pools[name]
            routed = np.bincount(assigned[assigned >= 0], minlength=len(pool))
            used, busy = [], 0.0
            for k, e in enumerate(pool):
                p = per[offset + k]
                slot_s = sum(p.timeline[f"mem_{c}_slot_s"].sum() for c in USED_CLASSES)
                used.append(slot_s / (e.kv.capacity * duration) if duration > 0 and e.kv.capacity else 0.0)
                busy += float(p.timeline.busy_s.sum())
                gpu, tp = self.kinds[name]
                rows.append({"replica": offset + k, "group": POOLS.index(name), "pool": name, "gpu": gpu,
                             "tensor_parallel": tp, "num_routed": int(routed[k]), "kv_in_use": used[k], **p.summary})
            pools[name] = {"num_replicas": len(pool), "gpu": self.kinds[name][0],
                           "tensor_parallel": self.kinds[name][1],
                           "busy_fraction": busy / (duration * len(pool)) if duration > 0 else None,
                           "kv_in_use": float(np.mean(used)), "kv_capacity_tokens": sum(e.kv.capacity for e in pool),
                           "load_imbalance_requests": _imbalance(routed),
                           "load_imbalance_kv": _imbalance(np.array(used))}
        moved = frame[frame.transfer_ms.notna()]
        transfer = {"link": self.link.name, "gb_per_s": self.link.bytes_per_s / 1e9,
                    "latency_ms": self.link.latency_s * 1e3, "num_transfers": int(len(moved)),
                    "bytes": int(moved.transfer_bytes.sum())}
        for col in ("transfer_ms", "transfer_queue_ms", "decode_wait_ms"):
            v = moved[col].to_numpy()
            transfer[f"mean_{col}"] = float(v.mean()) if len(v) else None
            transfer[f"p99_{col}"] = float(np.percentile(v, 99)) if len(v) else None
        fleet = {"router": self.router_name, "num_replicas": len(engines), "split": "disaggregated", **pools,
                 "kv_transfer": transfer, "prefix_hit_rate_tokens": summary.get("prefix_hit_rate_tokens")}
        return PolicyResult(per[-1].policy, self.decode[0].pool, frame, steps, summary, snapshot, tl,
                            replicas=pd.DataFrame(rows), fleet=fleet, num_events=sum(p.num_events for p in per),
                            layout=per[-1].layout)
