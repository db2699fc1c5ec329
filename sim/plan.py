"""``sim plan``: the cheapest deployment (GPU, tensor parallelism, replicas, colocated or a prefill:decode
split, policy, knobs) that meets an SLO, for each request rate of a workload.

A plan file::

    name: plan-azure
    base: ../azure_conv.yaml          # a scenario (file or mapping): model, workload, step time, ...
    rate_scales: [1, 2, 4]            # or rates: [...] (workload.arrival.rate of a generated workload)
    slo: {p99_ttft_ms: 2000, mean_tpot_ms: 100}     # as a sweep's capacity.slo
    gpus: [a100-80gb, h100]           # catalog names; each needs a price ($/GPU-hour)
    prices: {h100: 6.0}               # overrides sim.catalog.GPU_PRICES
    tensor_parallel: [1, 2]
    replicas: {min: 1, max: 16}
    router: least-outstanding
    policies: [vllm, orca-oracle]
    max_num_seqs: [128, 256]          # optional knobs, crossed
    block_size: [16, 32]
    split: [colocated, disaggregated] # optional; disaggregated: prefill:decode pools of these ratios
    prefill_decode: ["1:1", "1:3"]
    kv_transfer: infiniband-400g      # the disaggregated pools' link

A *shape* is one (gpu, tensor_parallel, policy, knobs, split); a *configuration* a shape with a count:
replicas (``cluster: {replicas: n, router: ...}``), or for a p:d split n units of p prefill and d decode
replicas (``cluster: {prefill: {replicas: n p}, decode: {replicas: n d}, kv_transfer: ...}``), the units
whose replicas lie within the plan's range. Each simulation is run by the sweep's
executors and stored in the sweep's point store (``points/``), so a rerun into the same folder reuses it.

Search: rates in ascending order; per rate, every shape's fewest passing replicas: from the lowest
count not yet ruled out, steps of 1, 2, 4, ... until a count passes, then bisection; all shapes' probes
of a round run together (one wave). Two monotonicities prune the grid: more replicas (units) of
the same shape never hurt the SLO (so one run decides every count above a pass or below a failure), and
a count that fails at a rate fails at every higher rate (so a shape's search at a rate starts at its
fewest passing count of the rate before). Every configuration of the grid gets a row: run, or inferred
with the reason (``pruned_by``).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Union

import pandas as pd
from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from sim.catalog import GPU_PRICES, GPUS, LINKS
from sim.config import (Name, MAX_REPLICAS, Int, KvTransferConfig, Policy, ProfileConfig, Real, Scenario, ScenarioError,
                        Strict, _known_link, _number, _routers, check_kind, check_unique_names, format_validation_error,
                        own_arrivals, parse_scenario, read_yaml, validate_mapping)
from sim.cluster.router import NEEDS as ROUTER_NEEDS, check_routers
from sim.kv import CapacityError, check_tensor_parallel
from sim.outputs import ReportWriter, claim, out_dir as out_dir_checked, write_result_table
from sim.schema import PLAN_MARK, RATE_AXIS, RATE_SCALE_AXIS, plan_label, plural
from sim.userfile import user_path
from sim.sweep.drive import Outcome, PointStore, Progress, drive
from sim.sweep.spec import (Axis, Bound, Sweep, _line_of, _Under, axis_target, known_slo_metrics,
                             read_base)
from sim.sweep.tables import _metric_row
from sim.sweep.tasks import make_task
from sim.steptime import load_profile
from sim.workload import TraceReader, load_requests

PLAN_TABLE, BEST_TABLE, PLAN_INFO = "plan.parquet", "best.csv", PLAN_MARK


class ReplicaRange(Strict):
    min: Int = Field(1, description="fewest replicas tried")
    max: Annotated[int, BeforeValidator(_number), Field(le=MAX_REPLICAS)] = Field(
        description=f"most replicas tried (at most {MAX_REPLICAS})")

    @model_validator(mode="after")
    def _range(self) -> "ReplicaRange":
        if self.min < 1:
            raise ValueError(f"min must be at least 1 replica (got {self.min})")
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be at least min ({self.min})")
        return self


class PlanFile(Strict):
    """What a plan file holds (see the module docstring)."""

    name: Name | None = Field(None, description="default: the file's name without .yaml")
    description: str = ""
    base: Union[str, dict[str, Any]] = Field(description="scenario file (relative to the plan) or mapping")
    rates: list[Real] | None = Field(None, min_length=1, description="workload.arrival.rate values (req/s)")
    rate_scales: list[Real] | None = Field(None, min_length=1, description="workload.rate_scale values (traces)")
    slo: dict[str, Bound] = Field(min_length=1, description="summary metric -> bound; all must hold")
    gpus: list[str] = Field(min_length=1, description="catalog GPU names")
    prices: dict[str, Annotated[float, BeforeValidator(_number), Field(le=1e6)]] = Field(
        default_factory=dict, validate_default=True, description="$/GPU-hour, over the catalog's")
    tensor_parallel: list[Int] = Field([1], min_length=1)
    replicas: ReplicaRange
    router: str = "least-outstanding"
    policies: list[Union[str, dict[str, Any]]] = Field(["vllm"], min_length=1)
    max_num_seqs: list[Int] | None = Field(None, min_length=1)
    block_size: list[Int] | None = Field(None, min_length=1)
    split: Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        ["colocated"], min_length=1, description="colocated (prefill and decode on the same replicas) and/or "
                                                 "disaggregated (prefill and decode pools)")
    prefill_decode: list[str] | None = Field(None, min_length=1, description="disaggregated: prefill:decode replicas "
                                                                            "per unit (default 1:1)")
    kv_transfer: Annotated[str | KvTransferConfig | None, BeforeValidator(_known_link)] = Field(
        None, description="disaggregated: the pools' link (a catalog link or {gb_per_s, latency_ms})")

    @field_validator("slo")
    @classmethod
    def _known_metrics(cls, slo: dict[str, Bound]) -> dict[str, Bound]:
        slo = known_slo_metrics(slo)
        for m, b in slo.items():
            if b.min is not None:  # NOTE: the search infers a failure at a rate from a lower rate's failure
                raise ValueError(f"{m}: min {b.min:g}: the plan's search assumes a configuration that fails at a "
                                 "rate fails above it, which a minimum (such as on throughput, met more easily at "
                                 "higher rates) breaks; bound a maximum (a latency) instead")
        return slo

    @field_validator("split")
    @classmethod
    def _splits(cls, v: list[str]) -> list[str]:
        for x in v:
            if x not in SPLITS:
                raise ValueError(f"unknown split {x!r}; expected {' or '.join(SPLITS)}")
        if len(set(v)) < len(v):
            raise ValueError("a split is listed twice")
        return v

    @field_validator("prefill_decode")
    @classmethod
    def _ratios(cls, v: list[str] | None) -> list[str] | None:
        for x in v or []:
            # NOTE: ASCII digits only (str.isdigit took '¹', which int() refuses, and Arabic-Indic '١', which it reads)
            if not (re.fullmatch(r"[0-9]+:[0-9]+", str(x)) and min(ratio(x)) > 0):
                raise ValueError(f"{x!r}: expected prefill:decode replicas per unit, whole numbers of 1 or more in "
                                 "the digits 0-9, such as '1:3'")
        if v is not None and len({ratio(x) for x in v}) < len(v):
            raise ValueError("a ratio is listed twice")
        return v

    @field_validator("gpus")
    @classmethod
    def _known_gpus(cls, gpus: list[str]) -> list[str]:
        for g in gpus:
            if g not in GPUS:
                hint = difflib.get_close_matches(g, GPUS, 1)
                raise ValueError(f"unknown gpu {g!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                 + f"; expected catalog names: {', '.join(GPUS)}")
        if len(set(gpus)) < len(gpus):
            raise ValueError("a GPU is listed twice")
        return gpus

    @field_validator("prices")
    @classmethod
    def _priced(cls, prices: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        gpus = info.data.get("gpus") or []
        for g, price in prices.items():
            if g not in gpus:
                raise ValueError(f"{g}: not one of the plan's gpus ({', '.join(gpus)})")
            if not price > 0:
                raise ValueError(f"{g}: a price must be above 0 $/GPU-hour (got {price})")
        for g in gpus:
            if g not in prices and g not in GPU_PRICES:
                raise ValueError(f"gpu {g!r} has no price in the catalog: give prices: {{{g}: <$/GPU-hour>}}")
        return prices

    @field_validator("router")
    @classmethod
    def _known_router(cls, v: str) -> str:
        return _routers(v)  # (by the plan's own line: it was found in a generated point's scenario)

    @field_validator("rates", "rate_scales")
    @classmethod
    def _positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(x <= 0 for x in v):
            raise ValueError(f"every value must be above 0 (got {v})")
        if v is not None and len(set(v)) < len(v):
            raise ValueError(f"a value is listed twice (got {v})")
        return None if v is None else sorted(v)

    @field_validator("tensor_parallel", "max_num_seqs", "block_size")
    @classmethod
    def _positive_ints(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 1 for x in v):
            raise ValueError(f"every value must be at least 1 (got {v})")
        if v is not None and len(set(v)) < len(v):
            raise ValueError(f"a value is listed twice (got {v})")
        return v

    @model_validator(mode="after")
    def _checks(self) -> "PlanFile":
        if (self.rates is None) == (self.rate_scales is None):
            raise ValueError("give one of 'rates' (req/s of a generated workload) and 'rate_scales' (a trace's "
                             "rate multipliers)")
        if "disaggregated" in self.split:
            if self.kv_transfer is None:
                raise ValueError(f"split disaggregated needs kv_transfer: a link ({', '.join(LINKS)}) "
                                 "or {gb_per_s, latency_ms}")
        elif self.kv_transfer is not None or self.prefill_decode is not None:
            raise ValueError("kv_transfer and prefill_decode apply to split: disaggregated only")
        return self

    @property
    def ratios(self) -> list[tuple[int, int]]:
        """(prefill, decode) replicas per unit of the disaggregated split."""
        return [ratio(x) for x in self.prefill_decode or ["1:1"]]

    def price(self, gpu: str) -> float | None:
        return self.prices.get(gpu, GPU_PRICES.get(gpu))


SPLITS = ("colocated", "disaggregated")


def ratio(text: str) -> tuple[int, int]:
    p, _, d = str(text).partition(":")
    return int(p), int(d)


@dataclass(frozen=True)
class Shape:
    """One deployment shape: everything but the replica count (``pd``: a disaggregated split's prefill and
    decode replicas per unit; None: colocated)."""

    gpu: str
    tensor_parallel: int
    policy: Any  # the plan's entry (a preset name or a policy mapping)
    policy_name: str
    knobs: tuple[tuple[str, int], ...]  # (("max_num_seqs", 128), ("block_size", 16)), those the plan varies
    pd: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """The shape in words, for messages: ``vllm on h100 tp1`` (and a split's ratio)."""
        return f"{self.policy_name} on {self.gpu} tp{self.tensor_parallel}" + (
            f" {self.pd[0]}:{self.pd[1]}" if self.pd else "")

    def columns(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "tensor_parallel": self.tensor_parallel, "policy": self.policy_name,
                **dict(self.knobs)}

    def split_columns(self, n: int) -> dict[str, Any]:
        """A plan with a disaggregated split: the split and each pool's replicas at count ``n``."""
        if self.pd is None:
            return {"split": "colocated", "prefill_decode": None, "prefill_replicas": None, "decode_replicas": None}
        p, d = self.pd
        return {"split": "disaggregated", "prefill_decode": f"{p}:{d}", "prefill_replicas": n * p,
                "decode_replicas": n * d}

    def replicas(self, n: int) -> int:
        """Replicas (all pools) at count ``n``: n replicas, or n units of a split."""
        return n if self.pd is None else n * sum(self.pd)

    def counts(self, spec: "PlanFile") -> tuple[int, int]:
        """The lowest and highest count whose replicas lie within the plan's range."""
        lo, hi = spec.replicas.min, spec.replicas.max
        if self.pd is None:
            return lo, hi
        u = sum(self.pd)
        return max(1, -(-lo // u)), hi // u


@dataclass
class Plan:
    """A loaded plan: its spec, its shapes, and the sweep-like builder of each configuration's scenario."""

    name: str
    source: str
    spec: PlanFile
    shapes: list[Shape]
    builder: Sweep = field(repr=False)  # its axes and base: point_scenario(values) for any configuration

    @property
    def rate_column(self) -> str:
        return "rate" if self.spec.rates is not None else "rate_scale"

    @property
    def rate_values(self) -> list[float]:
        return self.spec.rates if self.spec.rates is not None else self.spec.rate_scales

    @property
    def disaggregated(self) -> bool:
        return "disaggregated" in self.spec.split

    def scenario(self, rate: float, shape: Shape, n: int) -> Scenario:
        """The configuration of ``shape`` at count ``n`` (replicas, or units of a prefill:decode split)."""
        values = {self.rate_column: rate, "gpu": shape.gpu, "tensor_parallel": shape.tensor_parallel,
                  "policies": shape.policy, **dict(shape.knobs), "cluster.router": self.spec.router}
        if shape.pd is None:
            values["cluster.replicas"] = n
        else:
            t = self.spec.kv_transfer
            values.update({"cluster.prefill.replicas": n * shape.pd[0], "cluster.decode.replicas": n * shape.pd[1],
                           "cluster.kv_transfer": t if isinstance(t, str) else t.model_dump(mode="json")})
        return self.builder.point_scenario(values)

    def rejects(self, summary: dict) -> bool:
        """The run rejected requests that another deployment could serve (its KV pool or token budget is
        too small for them; the model's max length rejects alike everywhere). Unless the SLO bounds
        ``num_rejected`` itself, such a configuration does not serve the traffic: it fails, at every count
        of its shape (each replica of a shape rejects the same requests) and, as the search assumes of any
        failure, at every higher rate."""
        return "num_rejected" not in self.spec.slo and \
            summary.get("num_rejected", 0) > summary.get("num_rejected_max_model_len", 0)

    def met(self, summary: dict | None) -> bool:
        """Every SLO bound holds and no request was rejected for this deployment (:meth:`rejects`):
        latencies are over the finished requests, so one that served less of the traffic would meet a
        bound more easily."""
        return summary is not None and not self.rejects(summary) and \
            all(b.holds(summary.get(m)) for m, b in self.spec.slo.items())

    def slo_text(self) -> str:
        return " and ".join(b.text(m) for m, b in self.spec.slo.items())


class _PlanPolicies(Strict):
    policies: list[Policy]

    @field_validator("policies")
    @classmethod
    def _names(cls, policies: list) -> list:
        check_unique_names(policies)
        return policies


MAX_CONFIGURATIONS = 100_000  # a plan's grid, before pruning (a sweep's points: sim.sweep.spec.MAX_POINTS)


def load_plan(path: str | Path) -> Plan:
    """Read a plan file, check it, and check one scenario of every shape; each problem raises
    :class:`ScenarioError` naming the file, the line and the key."""
    path = user_path(path, "plan file", ScenarioError)
    data, lines = read_yaml(path, "plan")
    check_kind(data, path, "plan")
    source = str(path)
    spec = validate_mapping(PlanFile, data, source, lines,
                            keys="plan keys (base, rates or rate_scales, slo, gpus, replicas, ...)")
    # the plan's own policies, by its own lines (checked in the base they read as the base's mistakes)
    validate_mapping(_PlanPolicies, {"policies": list(spec.policies)}, source, lines)
    base, base_lines, base_source, base_dir = read_base(path, spec.base, lines)
    if not isinstance(base, dict):
        raise ScenarioError(f"{base_source}: expected a mapping of scenario keys")
    base.setdefault("name", spec.name or path.stem)
    base.setdefault("gpu", spec.gpus[0])
    base.setdefault("policies", list(spec.policies))
    base["decompose"] = False  # a plan keeps each configuration's own metrics only
    cluster = base.get("cluster")
    at = "" if isinstance(spec.base, str) else "base."  # a base file, or the plan's own mapping
    if isinstance(cluster, dict):  # the plan makes each configuration's replicas or pools itself (a base pool's
        # gpu was kept: every run put that pool on it while the tables named and priced the plan's GPU)
        for key in ("replicas", "prefill", "decode"):
            if cluster.get(key) is not None:
                raise ScenarioError(f"{base_source}: {at}cluster.{key}: the plan sets every configuration's replicas "
                                    "and pools (replicas, split, prefill_decode); remove it from the base")
    if isinstance(spec.base, str):
        parse_scenario(base, base_source, base_lines, base_dir)
    else:
        try:
            Scenario.model_validate(base)
        except Exception as e:
            if hasattr(e, "errors"):
                raise ScenarioError(format_validation_error(_Under("base", e), source, lines)) from None
            raise
    # what the plan leaves out, the base gives (its policies, tensor parallelism, router: they ran as the plan's
    # defaults, vllm at TP 1 behind least-outstanding, whatever the base said); what both give, the plan does
    given, inherit = spec.model_fields_set, {}
    if "policies" not in given and isinstance(base.get("policies"), list) and base["policies"]:
        inherit["policies"] = list(base["policies"])
    if "tensor_parallel" not in given and base.get("tensor_parallel") is not None:
        inherit["tensor_parallel"] = [int(base["tensor_parallel"])]
    router = cluster.get("router") if isinstance(cluster, dict) else None
    if "router" not in given and router is not None:
        if not isinstance(router, str):
            raise ScenarioError(f"{base_source}: {at}cluster.router: a plan runs one router; give it as the plan's "
                                "router:")
        inherit["router"] = router
    if inherit:
        spec = spec.model_copy(update=inherit)
    recorded = own_arrivals(base.get("workload"))  # (a re-timed trace has a rate: it was refused both ways)
    if spec.rates is not None and recorded:
        raise ScenarioError(f"{source}{_line_of(lines, 'rates')}: rates: the base workload is a trace, with its own "
                            f"arrival times: give rate_scales (multiples of its rate) instead")
    if spec.rate_scales is not None and not recorded:
        raise ScenarioError(f"{source}{_line_of(lines, 'rate_scales')}: rate_scales: the base workload is generated: "
                            f"give rates (requests per second) instead")
    rate_path = RATE_AXIS if spec.rates is not None else RATE_SCALE_AXIS
    axes = [Axis("rate" if spec.rates is not None else "rate_scale", axis_target(rate_path)[0], (),
                 "rates" if spec.rates is not None else "rate_scales")]
    for column, path_ in [("gpu", "gpu"), ("tensor_parallel", "tensor_parallel"), ("policies", "policies"),
                          ("max_num_seqs", "max_num_seqs"), ("block_size", "block_size"),
                          ("cluster.replicas", "cluster.replicas"), ("cluster.router", "cluster.router"),
                          ("cluster.prefill.replicas", "cluster.prefill.replicas"),
                          ("cluster.decode.replicas", "cluster.decode.replicas"),
                          ("cluster.kv_transfer", "cluster.kv_transfer")]:
        axes.append(Axis(column, axis_target(path_)[0], (), column))
    builder = Sweep(name=spec.name or path.stem, description=spec.description, source=source, axes=axes,
                    groups=[], points=[], capacity=None, base=base, base_dir=base_dir, base_source=base_source)
    knob_lists = [(k, getattr(spec, k)) for k in ("max_num_seqs", "block_size") if getattr(spec, k) is not None]
    shapes: list[Shape] = []
    first = min(spec.rates if spec.rates is not None else spec.rate_scales)
    plan = Plan(builder.name, source, spec, shapes, builder)
    splits = ([None] if "colocated" in spec.split else []) + (spec.ratios if "disaggregated" in spec.split else [])
    for split in splits:
        probe = Shape("", 1, None, "", (), split)
        lo, hi = probe.counts(spec)
        if lo > hi:
            raise ScenarioError(f"{source}{_line_of(lines, 'prefill_decode')}: prefill_decode: a {split[0]}:{split[1]} "
                                f"unit is {sum(split)} replicas, and no whole number of units lies in replicas "
                                f"{spec.replicas.min} to {spec.replicas.max}")
    for gpu in spec.gpus:
        for tp in spec.tensor_parallel:
            for policy in spec.policies:
                combos: list[tuple] = [()]
                for k, vs in knob_lists:
                    combos = [(*c, (k, v)) for c in combos for v in vs]
                for knobs in combos:
                    for split in splits:
                        shape = Shape(gpu, tp, policy, "", knobs, split)
                        scenario = plan.scenario(first, shape, shape.counts(spec)[0])
                        shapes.append(Shape(gpu, tp, policy, scenario.policies[0].name, knobs, split))
    probe_scenario = plan.scenario(first, shapes[0], shapes[0].counts(spec)[0])
    key = "rates" if spec.rates is not None else "rate_scales"
    for r in plan.rate_values[1:]:  # every rate now, not when the search reaches it (after the lower ones ran)
        try:
            plan.scenario(r, shapes[0], shapes[0].counts(spec)[0])
        except ScenarioError as e:
            raise ScenarioError(f"{source}{_line_of(lines, key)}: {key}: {r:g}: {str(e).split(': ', 1)[-1]}") from None
    model = probe_scenario.model_spec()
    st = probe_scenario.step_time
    if isinstance(st, ProfileConfig):  # a calibration profile prices one GPU's steps: not the other GPUs'
        for gpu in spec.gpus:
            try:
                load_profile(probe_scenario.resolve_path(st.path), model, gpu)
            except ScenarioError as e:
                raise ScenarioError(f"{source}{_line_of(lines, 'gpus')}: gpus: {gpu}: {e}") from None
    for tp in spec.tensor_parallel:
        try:
            check_tensor_parallel(model, tp)
        except CapacityError as e:
            raise ScenarioError(f"{source}{_line_of(lines, 'tensor_parallel')}: tensor_parallel: {e}") from None
    if spec.router in ROUTER_NEEDS:  # (the requests are made only for a router that reads them)
        try:
            check_routers([spec.router], load_requests(probe_scenario))
        except ScenarioError as e:
            raise ScenarioError(f"{source}{_line_of(lines, 'router')}: {str(e).removeprefix('cluster.')}") from None
    size = sum(hi - lo + 1 for lo, hi in (s.counts(spec) for s in shapes)) * len(plan.rate_values)
    if size > MAX_CONFIGURATIONS:
        raise ScenarioError(f"{source}: {size:,} configurations (shapes x replica counts x rates): at most "
                            f"{MAX_CONFIGURATIONS:,}; narrow gpus, tensor_parallel, policies, the knobs, replicas "
                            "or the rates")
    names = {}
    for s in shapes:
        key = (s.gpu, s.tensor_parallel, s.knobs, s.policy_name, s.pd)
        if key in names:
            raise ScenarioError(f"{source}{_line_of(lines, 'policies')}: policies: two policies named "
                                f"{s.policy_name!r}; give each a distinct name")
        names[key] = s
    _check_some_shape_runs(plan, first)
    return plan


def _check_some_shape_runs(plan: Plan, rate: float) -> None:
    """A plan none of whose shapes can run (a GPU that cannot hold the model, static batching with a
    disaggregated split, ...) stops here, each shape's reason a line, as ``sim check`` does; while one can run,
    the others' failures are reported by the search (a shape of a larger GPU or tensor parallelism may be the
    answer). The shapes are resolved as a run resolves them, up to the first that runs; nothing is simulated."""
    from sim.run import resolve_all

    reasons: dict[str, str] = {}
    for s in plan.shapes:
        scenario = plan.scenario(rate, s, s.counts(plan.spec)[0])
        try:
            resolve_all(scenario, scenario.model_spec(), scenario.gpu_spec())
            return
        except ScenarioError as e:
            reasons[s.label] = str(e)
    raise ScenarioError("\n".join(f"{plan.source}: no shape of the plan can run: {label}: {why}"
                                  for label, why in reasons.items()))


# ---------------------------------------------------------------------------------------------- search

# why a configuration was decided without running it
MORE_THAN_PASSING = "more replicas than a passing run"
FEWER_THAN_FAILING = "fewer replicas than a failing run"
FAILED_AT_LOWER_RATE = "as many replicas failed at a lower rate"
SHAPE_ERROR = "this shape's run failed"
SHAPE_REJECTS = "this shape rejects requests at any count"


@dataclass
class _Search:
    """A shape's fewest passing replica count at one rate: every count <= ``fail`` fails, >= ``ok`` passes."""

    fail: int  # highest count known to fail (min - 1: none)
    ok: int  # lowest count known to pass (max + 1: none)
    inherited: int  # counts <= this failed at a lower rate
    runs: dict[int, str] = field(default_factory=dict)  # count -> task key
    error: str | None = None
    rejects: bool = False  # a run rejected requests another deployment could serve (Plan.rejects)


@dataclass
class PlanResult:
    plan: Plan
    table: pd.DataFrame  # every configuration of the grid
    best: pd.DataFrame  # the cheapest passing configuration per rate
    num_runs: int
    num_reused: int
    num_configurations: int
    failures: list[tuple[str, str]]
    wall_s: float


def run_plan(plan: Plan, out_dir: str | Path, executor, *, resume: bool = True, progress: Progress | None = None,
             read_trace: TraceReader | None = None) -> PlanResult:
    """Search every rate of the plan (see the module docstring) on an executor of :mod:`sim.executors`,
    storing each run under ``out_dir/points``; returns the tables (not yet written)."""
    t0 = time.perf_counter()
    store = PointStore(Path(out_dir))
    spec = plan.spec
    bounds = [shape.counts(spec) for shape in plan.shapes]  # each shape's lowest and highest count
    outcomes: dict[str, Outcome] = {}
    searches: dict[tuple[int, int], _Search] = {}
    progress = progress or Progress()
    for ri, rate in enumerate(plan.rate_values):
        current: dict[int, _Search] = {}
        for si, shape in enumerate(plan.shapes):
            lo, hi = bounds[si]
            before = searches.get((ri - 1, si))
            if before is not None and (before.error or before.rejects):
                current[si] = _Search(hi, hi + 1, hi, error=before.error, rejects=before.rejects)
                continue
            floor = lo - 1 if before is None else min(before.ok - 1, hi)
            current[si] = _Search(floor, hi + 1, floor)
            searches[(ri, si)] = current[si]
        while True:
            wave: dict[int, tuple[int, Any]] = {}
            for si, s in current.items():
                hi = bounds[si][1]
                if s.error is None and s.ok - s.fail > 1:
                    # no pass yet: climb from the floor by doubling steps (1, 2, 4, ... above it), since
                    # the answer is usually near the floor; then bisect between a failure and a pass
                    n = (min(hi, s.fail + max(1, s.fail - s.inherited)) if s.ok > hi else (s.fail + s.ok) // 2)
                    wave[si] = (n, make_task(plan.scenario(rate, plan.shapes[si], n), 0))
            if not wave:
                break
            outcomes.update(drive(executor, [t for _, t in wave.values()], [], None, store, resume, progress,
                                  read_trace))
            for si, (n, task) in wave.items():
                s, out = current[si], outcomes[task.key]
                s.runs[n] = task.key
                if out.error:
                    s.error = out.error
                elif plan.rejects(out.summary):  # so does every count: none passes
                    s.rejects, s.fail = True, bounds[si][1]
                elif plan.met(out.summary):
                    s.ok = n
                else:
                    s.fail = n
        for si, s in current.items():
            searches[(ri, si)] = s
        passing = sum(s.ok <= bounds[si][1] and s.error is None and not s.rejects for si, s in current.items())
        progress.note(f"{plan.rate_column} {rate:g} searched: shapes meeting the SLO {passing} of "
                      f"{len(plan.shapes)}; {plural(sum(not o.reused for o in outcomes.values()), 'run')} so far "
                      f"(and {sum(o.reused for o in outcomes.values()):,} reused), {time.perf_counter() - t0:,.1f} s")
    table = _table(plan, searches, outcomes)
    best = _best(plan, table)
    failures = [(f"{plan.shapes[si].label} at {plan.rate_column} {plan.rate_values[ri]:g}", s.error)
                for (ri, si), s in searches.items() if s.error and s.runs]
    return PlanResult(plan, table, best, sum(not o.reused for o in outcomes.values()),
                      sum(o.reused for o in outcomes.values()), len(table), failures, time.perf_counter() - t0)


def _table(plan: Plan, searches: dict[tuple[int, int], _Search], outcomes: dict[str, Outcome]) -> pd.DataFrame:
    """One row per configuration of the grid (rate x shape x replica count), run or inferred."""
    spec = plan.spec
    rows = []
    for ri, rate in enumerate(plan.rate_values):
        for si, shape in enumerate(plan.shapes):
            s = searches[(ri, si)]
            price = spec.price(shape.gpu)
            lo, hi = shape.counts(spec)
            for n in range(lo, hi + 1):
                key = s.runs.get(n)
                out = outcomes.get(key) if key else None
                if out is not None:
                    passed, pruned, error = (None if out.error else plan.met(out.summary)), None, out.error
                elif s.error:
                    passed, pruned, error = None, SHAPE_ERROR, s.error
                elif s.rejects:
                    passed, pruned, error = False, SHAPE_REJECTS, None
                elif n >= s.ok:
                    passed, pruned, error = True, MORE_THAN_PASSING, None
                elif n <= s.inherited:
                    passed, pruned, error = False, FAILED_AT_LOWER_RATE, None
                else:
                    passed, pruned, error = False, FEWER_THAN_FAILING, None
                gpus = shape.replicas(n) * shape.tensor_parallel
                metrics = _metric_row(out)
                per_hour = gpus * price
                tokens = metrics.get("total_token_throughput")
                rows.append({plan.rate_column: rate, **shape.columns(), "replicas": shape.replicas(n),
                             **(shape.split_columns(n) if plan.disaggregated else {}), "num_gpus": gpus,
                             "usd_per_gpu_hour": price, "usd_per_hour": per_hour,
                             "usd_per_million_tokens": (per_hour / (tokens * 3600 / 1e6)) if tokens else None,
                             "goodput_request_rate": (metrics.get("request_throughput") if passed else 0.0)
                             if out is not None and not out.error else None,
                             "passed": passed, "ran": out is not None, "pruned_by": pruned, **metrics,
                             "point_key": key, "error": error})
    return pd.DataFrame(rows)


def _nearest(plan: Plan, t: pd.DataFrame) -> str | None:
    """Where nothing meets the SLO at a rate: the run that came nearest (the smallest worst ratio of a metric
    to its bound, among runs that served every request), in words with the bounds it missed; None if none."""
    best, worst = None, math.inf
    for _, r in t[t["ran"] & t["error"].isna()].iterrows():
        if plan.rejects(r):
            continue
        ratios = [(r.get(m) / b.max if b.max else math.inf) if r.get(m) == r.get(m) and r.get(m) is not None
                  else math.inf for m, b in plan.spec.slo.items() if b.max is not None]
        if ratios and max(ratios) < worst:
            best, worst = r, max(ratios)
    if best is None:
        return None
    missed = [f"{m} {best[m]:,.4g} (at most {b.max:g})" for m, b in plan.spec.slo.items()
              if b.max is not None and not b.holds(best[m])]
    return f"{plan_label(best)}: " + ", ".join(missed)


def _best(plan: Plan, table: pd.DataFrame) -> pd.DataFrame:
    """The cheapest passing configuration per rate (by $/hour, then $/million tokens), with its rank
    among every shape's cheapest passing one. A rate that nothing meets gets a row saying so."""
    rows = []
    keys = [c for c in ("gpu", "tensor_parallel", "policy", "max_num_seqs", "block_size", "split", "prefill_decode")
            if c in table]
    for rate, t in table.groupby(plan.rate_column, sort=True):
        ok = t[(t["passed"] == True) & t["ran"]]  # noqa: E712 (a column of True/False/None)
        if ok.empty:
            rows.append({plan.rate_column: rate, "met": False, "num_passing_shapes": 0, "nearest": _nearest(plan, t)})
            continue
        # each shape's cheapest passing count is the one it ran at its fewest passing replicas
        firsts = ok.sort_values("replicas").groupby(keys, sort=False, dropna=False).head(1)
        ranked = firsts.sort_values(["usd_per_hour", "usd_per_million_tokens", "num_gpus"]).reset_index(drop=True)
        w = ranked.iloc[0]
        rows.append({plan.rate_column: rate, "met": True, "num_passing_shapes": len(ranked),
                     **{c: w[c] for c in (*keys, "replicas", *(("prefill_replicas", "decode_replicas")
                                                              if plan.disaggregated else ()),
                                          "num_gpus", "usd_per_gpu_hour", "usd_per_hour",
                                          "usd_per_million_tokens", "request_throughput", "offered_request_rate",
                                          *plan.spec.slo)},
                     "runner_up": (f"{plan_label(ranked.iloc[1])} ${ranked.iloc[1]['usd_per_hour']:.2f}/h")
                     if len(ranked) > 1 else None,
                     "point_key": w["point_key"]})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------- output


def write_plan(result: PlanResult, out_dir: str | Path, executor_name: str, report: ReportWriter | None = None
               ) -> dict[str, Path]:
    """plan.parquet, best.csv, plan.json and report.html (by ``report``, when given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plan": out / PLAN_TABLE, "best": out / BEST_TABLE, "info": out / PLAN_INFO}
    write_result_table(result.table, paths["plan"])
    result.best.to_csv(paths["best"], index=False)
    p, spec = result.plan, result.plan.spec
    info = {"name": p.name, "description": spec.description, "source": p.source, "kind": "plan",
            "rate_column": p.rate_column, "rates": p.rate_values, "slo": p.slo_text(), "slo_metrics": list(spec.slo),
            "gpus": {g: spec.price(g) for g in spec.gpus}, "tensor_parallel": spec.tensor_parallel,
            "replicas": [spec.replicas.min, spec.replicas.max], "router": spec.router, "split": spec.split,
            "prefill_decode": [f"{a}:{b}" for a, b in spec.ratios] if p.disaggregated else None,
            "kv_transfer": spec.kv_transfer if isinstance(spec.kv_transfer, (str, type(None)))
            else spec.kv_transfer.model_dump(mode="json"),
            "num_shapes": len(p.shapes), "num_configurations": result.num_configurations,
            "executor": executor_name, "wall_s": result.wall_s, "num_runs": result.num_runs,
            "num_reused": result.num_reused, "failures": [{"what": w, "error": e} for w, e in result.failures]}
    paths["info"].write_text(json.dumps(info, indent=2, allow_nan=False))
    if report:
        paths["report"] = report(out)
    return paths


def plan_to_dir(plan_path: str | Path, out_dir: str | Path | None = None, *, executor: str = "local",
                workers: int | None = None, address: str | None = None, resume: bool = True,
                report: ReportWriter | None = None, read_trace: TraceReader | None = None,
                console=None) -> tuple[PlanResult, dict[str, Path]]:
    """``sim plan``: load, search with a progress bar, write the tables (and the report, by ``report``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    from sim.executors import make_executor
    from sim.run import default_out
    from sim.sweep.output import _BarProgress, folder_lock

    plan = load_plan(plan_path)
    out = claim(out_dir_checked(out_dir, "out_dir") if out_dir is not None else default_out(plan.name, "plan"), "plan",
                plan.name, default=out_dir is None)
    with make_executor(executor, workers=workers, address=address) as ex, folder_lock(out), \
            Bar(TextColumn("{task.description}", markup=False),  # markup=False: the name as written
                BarColumn(), MofNCompleteColumn(), TextColumn("runs"), TimeElapsedColumn(), console=console,
                transient=True) as bar:
        task_id = bar.add_task(f"{plan.name} ({ex.name}, {ex.slots} workers)", total=0)
        result = run_plan(plan, out, ex, resume=resume, progress=_BarProgress(bar, task_id), read_trace=read_trace)
    return result, write_plan(result, out, executor, report=report)
