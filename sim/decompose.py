"""What each setting explains: a one-knob-at-a-time decomposition of the difference between policies.

Starting from a scenario's first policy (the *base*), every other policy (a *target*) is reached by
changing one knob at a time, in this order::

    base ─batching─► p1 ─reservation─► p2 ─paged allocation─► p3 ─prefill─► p4 ─block size─► p5 ─other─► target

Each intermediate policy runs on the same requests; a knob's *share* of a metric's difference is the
metric after its step minus the metric before. The shares telescope: they add up to target − base
(up to floating-point rounding), whatever the metric. A knob that changes nothing, or whose change
makes no difference to the run, has a share of exactly zero.

Knobs (``KNOBS``), applied to the resolved policy fields:
  batching          ``batching`` (static vs continuous, iteration-level)
  reservation       ``allocator.reserve``, when both allocators are contiguous (max, pow2, oracle)
  paged allocation  the allocator's kind: contiguous slabs vs paged blocks (the target's whole allocator)
  prefill           ``prefill`` (separate, mixed, chunked)
  block size        ``block_size``
  other             every remaining field (placement, watermark, preemption, swap space, max_num_seqs,
                    max_num_batched_tokens, prefix caching)

NOTE: a one-at-a-time decomposition depends on the order: where knobs interact (continuous batching
helps more once memory is paged, say), the interaction is credited to the later knob. The order above
is fixed so that every scenario is decomposed the same way. When a knob alone would give a policy that
does not exist (static batching with paged blocks), it is merged with the next knob into one step
(``knobs`` lists both).

The intermediate runs are cached by their resolved policy (``policy_key``): an intermediate that equals
one of the scenario's policies (``fastertransformer`` + continuous batching is ``orca-max``) is not run
again, and one reached from several targets runs once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from sim.config import PolicyConfig
from sim.schema import METRICS

KNOBS: tuple[str, ...] = ("batching", "reservation", "paged allocation", "prefill", "block size", "other")

# The metrics decomposed by default: throughput, then latency (all declared in sim.schema.METRICS).
DECOMPOSED_METRICS: tuple[str, ...] = ("request_throughput", "output_throughput", "mean_normalized_latency_s",
                                      "median_ttft_ms", "median_tpot_ms")

_IDENTITY = ("name", "preset")  # fields that name a policy but do not change what it does


def policy_fields(policy: PolicyConfig) -> dict[str, Any]:
    """The fields that decide a policy's behaviour (its name and preset left out)."""
    return {k: v for k, v in policy.model_dump(mode="json").items() if k not in _IDENTITY}


def policy_key(policy: PolicyConfig | dict) -> str:
    """Two policies with the same key run identically on the same requests."""
    fields = policy if isinstance(policy, dict) else policy_fields(policy)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _apply(knob: str, cur: dict, target: dict) -> dict:
    """``cur`` with ``knob`` set as in ``target``."""
    new = json.loads(json.dumps(cur))  # a deep copy of plain JSON values
    a, b = new["allocator"], target["allocator"]
    if knob == "batching":
        new["batching"] = target["batching"]
    elif knob == "reservation":
        if a["kind"] == b["kind"] == "contiguous":
            a["reserve"] = b["reserve"]
    elif knob == "paged allocation":
        if a["kind"] != b["kind"]:
            new["allocator"] = json.loads(json.dumps(b))
    elif knob == "prefill":
        new["prefill"] = target["prefill"]
    elif knob == "block size":
        new["block_size"] = target["block_size"]
    elif knob == "other":
        new = json.loads(json.dumps(target))
    else:
        raise ValueError(f"unknown knob {knob!r}; expected one of {', '.join(KNOBS)}")
    return new


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(before: dict, after: dict) -> dict[str, list]:
    """``{field path: [before, after]}`` for every field that differs (None where a field is absent)."""
    fb, fa = _flat(before), _flat(after)
    return {k: [fb.get(k), fa.get(k)] for k in sorted(set(fb) | set(fa)) if fb.get(k) != fa.get(k)}


@dataclass(frozen=True)
class Step:
    """One step of a chain: the knobs it changes (one, or several merged), and the policy it reaches."""

    knobs: tuple[str, ...]
    changes: dict[str, list]
    policy: PolicyConfig

    @property
    def label(self) -> str:
        return " + ".join(self.knobs)


def chain(base: PolicyConfig, target: PolicyConfig) -> tuple[list[Step], list[str]]:
    """The steps from ``base`` to ``target``, one knob at a time (a knob that would give an invalid
    policy merged with the next ones), and the knobs that change nothing. The last step's policy has
    the target's fields exactly."""
    cur, goal = policy_fields(base), policy_fields(target)
    steps: list[Step] = []
    unchanged: list[str] = []
    pending: list[str] = []
    state = cur  # may be an invalid combination while knobs are pending
    for knob in KNOBS:
        new = _apply(knob, state, goal)
        if new == state:
            unchanged.append(knob)
            continue
        pending.append(knob)
        state = new
        label = " + ".join(pending)
        try:
            policy = PolicyConfig.model_validate({**state, "name": f"{base.name} → {target.name}, after {label}"})
        except ValidationError:
            continue  # not a policy on its own: merge with the next knob
        steps.append(Step(tuple(pending), changes(cur, state), policy))
        cur, pending = state, []
    if pending:  # only if the target itself were invalid, which a validated PolicyConfig is not
        raise ValueError(f"cannot reach {target.name} from {base.name}: {', '.join(pending)} left over")
    return steps, unchanged


def _delta(after: float | None, before: float | None) -> float | None:
    if after is None or before is None or not math.isfinite(after) or not math.isfinite(before):
        return None
    return after - before


def decompose(policies: list[PolicyConfig], summaries: dict[str, dict],
              run_policy: Callable[[PolicyConfig], dict],
              metrics: Iterable[str] = DECOMPOSED_METRICS) -> dict:
    """The decomposition of every policy's difference from the first one.

    ``summaries``: each scenario policy's summary by name (already run); ``run_policy``: runs an
    intermediate policy on the same requests and returns its summary (called once per distinct
    resolved policy that is not one of the scenario's). Returns what ``summary.json`` holds under
    ``decomposition``: the base, the knobs and metrics, and per target its steps (knobs, changed fields,
    the scenario policy it equals if any, every metric after the step and the step's share), the knobs
    it leaves unchanged and the total difference."""
    metrics = list(metrics)
    for m in metrics:
        if m not in METRICS:
            raise ValueError(f"decomposition: unknown metric {m!r}; expected one declared in sim.schema.METRICS")
    base = policies[0]
    known = {policy_key(p): p.name for p in policies}
    by_key: dict[str, dict] = {policy_key(p): summaries[p.name] for p in policies}
    extra_runs = 0
    targets = {}
    for target in policies[1:]:
        steps, unchanged = chain(base, target)
        prev = summaries[base.name]
        out_steps = []
        for step in steps:
            key = policy_key(step.policy)
            if key not in by_key:
                by_key[key] = run_policy(step.policy)
                extra_runs += 1
            now = by_key[key]
            out_steps.append({
                "knobs": list(step.knobs), "label": step.label, "changes": step.changes,
                "same_as": known.get(key),
                "metrics": {m: now.get(m) for m in metrics},
                "share": {m: _delta(now.get(m), prev.get(m)) for m in metrics},
            })
            prev = now
        end = summaries[target.name]
        targets[target.name] = {
            "steps": out_steps, "unchanged": unchanged,
            "total": {m: _delta(end.get(m), summaries[base.name].get(m)) for m in metrics},
        }
    return {"base": base.name, "knobs": list(KNOBS), "metrics": metrics,
            "base_metrics": {m: summaries[base.name].get(m) for m in metrics},
            "targets": targets, "num_intermediate_runs": extra_runs}
