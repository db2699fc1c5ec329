"""Sweeps: a base scenario, axes of values for any of its fields, and an optional capacity search.

A sweep file::

    name: opt-13b-sharegpt
    base: opt-13b-sharegpt.yaml            # a scenario file (relative to this file), or a scenario mapping
    axes:                                  # crossed (cartesian product), in this order
      workload.arrival.rate: [0.5, 1, 1.5]
      seed: [0, 1, 2]                      # shorthand for workload.seed
    zip:                                   # each group: values taken together (same lengths); crossed with the rest
      - {block_size: [16, 32], preemption: [swap, recompute]}
    capacity:                              # per policy: the highest rate whose run meets the SLO
      slo: {mean_normalized_latency_s: 0.2}          # a number is an upper bound; or {max: x} / {min: y}
      min: 0.05
      max: 8
      tolerance: 0.02

An axis path names a scenario field by its dotted path (``workload.arrival.rate``, ``gpu``,
``tensor_parallel``, ``policies``). A policy's field applies to every policy of the scenario as
``policies.*.block_size``, or to one policy as ``policies.<name>.block_size``; a bare policy field
(``block_size``, ``preemption``, ``allocator.placement``) is short for ``policies.*.<field>``.

The unit of work is one *task*: one point of the grid and one of its policies, i.e. a scenario with a
single policy (a policy's results do not depend on the other policies of a scenario: each runs alone
on the same requests). A task is keyed by a hash of its resolved scenario, so finished tasks are found
again on a second run (resume), and a capacity probe that lands on a grid point reuses it.

Capacity search, per policy and per combination of the other axes: the sweep's own runs along the
capacity axis bracket the answer when the axis is swept; otherwise probing starts at ``start``
(default ``min``) and doubles up to ``max`` or halves down to ``min`` until a passing and a failing
rate bracket it. Then bisection, until the bracket is at most ``tolerance`` wide: the sustainable rate
is the bracket's passing end. Every probe count is bounded, so a search always ends: "none" when even
``min`` fails, "above max" when ``max`` passes.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Union, get_args, get_origin

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sim.metrics import METRICS
from sim.config import (PolicyConfig, Scenario, ScenarioError, Strict, format_validation_error, parse_scenario,
                        read_yaml, validate_mapping)

RATE_AXIS = "workload.arrival.rate"
SEED_PATH = "workload.seed"
POINTS_DIR = "points"
SWEEP_TABLE, CAPACITY_TABLE, CAPACITY_RUNS_TABLE, SWEEP_INFO = (
    "sweep.parquet", "capacity.parquet", "capacity_runs.parquet", "sweep.json")


# ---------------------------------------------------------------------------------------------- the file


def summary_metric_names() -> list[str]:
    """The metrics a policy's summary may hold (what an SLO may bound, the sweep table's columns): the
    declared schema, ``sim.metrics.METRICS``."""
    return list(METRICS)


class Bound(Strict):
    """A limit on one summary metric: ``max`` (at most) and/or ``min`` (at least)."""

    max: float | None = None
    min: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _number_is_max(cls, data: Any) -> Any:
        if isinstance(data, str):  # NOTE: YAML 1.1 reads 1e-9 (no dot) as a string: a number all the same
            try:
                data = float(data)
            except ValueError:
                return data
        return {"max": data} if isinstance(data, (int, float)) and not isinstance(data, bool) else data

    @model_validator(mode="after")
    def _some(self) -> "Bound":
        if self.max is None and self.min is None:
            raise ValueError("give 'max' (at most) or 'min' (at least)")
        return self

    def holds(self, value: float | None) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False  # nothing finished: no latency to meet an SLO with
        return (self.max is None or value <= self.max) and (self.min is None or value >= self.min)

    def text(self, metric: str) -> str:
        parts = ([f"{metric} <= {self.max:g}"] if self.max is not None else []) + (
            [f"{metric} >= {self.min:g}"] if self.min is not None else [])
        return " and ".join(parts)


class CapacityConfig(Strict):
    """Capacity search: the highest value of ``axis`` (a request rate) whose run meets every bound of ``slo``."""

    axis: str = Field(RATE_AXIS, description="the swept quantity, e.g. workload.arrival.rate or workload.rate_scale")
    slo: dict[str, Bound] = Field(min_length=1, description="summary metric -> bound; all must hold")
    min: float = Field(gt=0, le=1e12, description="lowest value tried: if it fails, the answer is 'none'")
    max: float = Field(gt=0, le=1e12, description="highest value tried: if it passes, the answer is 'above max'")
    start: float | None = Field(None, gt=0, le=1e12, description="first probe when the axis is not swept "
                                "(default: min)")
    tolerance: float | None = Field(None, gt=0, description="bisection stops when passing and failing values are "
                                    "this close (axis units)")
    relative_tolerance: float | None = Field(None, gt=0, lt=1, description="... or this close relative to the "
                                             "passing value (0.02: within 2 %)")

    @field_validator("slo")
    @classmethod
    def _known_metrics(cls, slo: dict[str, Bound]) -> dict[str, Bound]:
        names = summary_metric_names()
        for metric in slo:
            if metric not in names:
                hint = difflib.get_close_matches(metric, names, 1)
                raise ValueError(f"unknown metric {metric!r}" + (f" (did you mean {hint[0]!r}?)" if hint else
                                 f"; expected a summary metric such as {', '.join(names[8:14])}"))
        return slo

    @model_validator(mode="after")
    def _range(self) -> "CapacityConfig":
        if self.max <= self.min:
            raise ValueError(f"max ({self.max:g}) must be above min ({self.min:g})")
        if self.start is not None and not self.min <= self.start <= self.max:
            raise ValueError(f"start ({self.start:g}) must lie in [min, max] = [{self.min:g}, {self.max:g}]")
        if (self.tolerance is None) == (self.relative_tolerance is None):
            raise ValueError("give one of 'tolerance' (in the axis's units) and 'relative_tolerance' (a fraction)")
        if self.tolerance is not None and self.tolerance >= self.max - self.min:
            raise ValueError(f"tolerance ({self.tolerance:g}) must be below max - min ({self.max - self.min:g})")
        return self

    def close_enough(self, lo: float, hi: float) -> bool:
        """Is the bracket [lo, hi] narrow enough to stop?"""
        if self.tolerance is not None:
            return hi - lo <= self.tolerance
        return hi - lo <= self.relative_tolerance * lo

    def tolerance_text(self) -> str:
        return f"{self.tolerance:g}" if self.tolerance is not None else f"{100 * self.relative_tolerance:g} %"

    def slo_text(self) -> str:
        return " and ".join(b.text(m) for m, b in self.slo.items())

    def met(self, summary: dict | None) -> bool:
        return summary is not None and all(b.holds(summary.get(m)) for m, b in self.slo.items())


class SweepFile(Strict):
    """What a sweep file holds (see the module docstring)."""

    name: str | None = Field(None, min_length=1, description="default: the file's name without .yaml")
    description: str = ""
    base: Union[str, dict[str, Any]] = Field(description="scenario file (relative to the sweep file) or mapping")
    axes: dict[str, Any] = Field(default_factory=dict, description="path -> list of values, crossed")
    zip: Union[dict[str, Any], list[dict[str, Any]]] = Field(
        default_factory=list, description="one group or a list of groups of paths whose values go together")
    capacity: CapacityConfig | None = None

    def zip_groups(self) -> list[dict[str, Any]]:
        return [self.zip] if isinstance(self.zip, dict) else list(self.zip)


# ---------------------------------------------------------------------------------------------- axes


@dataclass(frozen=True)
class Axis:
    """One swept field: its column name (the path as written), where it goes, its values."""

    column: str  # as written in the file; the table's column ("seed" for the seed)
    target: tuple[str, ...]  # canonical path: ("workload", "seed") or ("policies", "*", "block_size")
    values: tuple[Any, ...]
    key: str  # where in the sweep file, e.g. "axes.block_size" or "zip[0].preemption"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold (through Optional, Union, Annotated, list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in get_args(annotation) if get_origin(annotation) is not None else ():
        out += _models_in(arg)
    return out


def _check_fields(models: list[type[BaseModel]], segments: tuple[str, ...], prefix: str) -> str | None:
    """Why ``segments`` is not a field path in any of ``models`` (None when it is one)."""
    for i, seg in enumerate(segments):
        holders = [m for m in models if seg in m.model_fields]
        where = ".".join((prefix, *segments[:i])).strip(".") or "a scenario"
        if not holders:
            known = sorted({f for m in models for f in m.model_fields})
            hint = difflib.get_close_matches(seg, known, 1)
            return (f"no field {seg!r} in {where}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + (f"; its fields: {', '.join(known)}" if known and not hint else ""))
        models = [x for m in holders for x in _models_in(m.model_fields[seg].annotation)]
        if not models and i < len(segments) - 1:
            return f"{where}.{seg} is a value, not a mapping: it has no field {segments[i + 1]!r}"
    return None


def axis_target(path: str) -> tuple[tuple[str, ...], str | None]:
    """The canonical path of an axis as written, and why it names no field (None when it does)."""
    segments = tuple(path.split("."))
    if path == "seed":
        return ("workload", "seed"), None
    if not all(segments):
        return segments, "empty part in the path (two dots, or a dot at an end)"
    if segments[0] == "policies" and len(segments) > 1:
        if len(segments) == 2:
            return segments, f"give a policy field after {path}. (e.g. {path}.block_size)"
        return segments, _check_fields([PolicyConfig], segments[2:], "policy")
    if segments[0] not in Scenario.model_fields and segments[0] in PolicyConfig.model_fields:
        return ("policies", "*", *segments), _check_fields([PolicyConfig], segments, "policy")
    if segments[0] == "name":
        return segments, "the scenario's name is not swept (every point keeps the base name)"
    return segments, _check_fields([Scenario], segments, "")


def _display(value: Any) -> Any:
    """A table cell for an axis value: scalars as they are, mappings and lists as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


def _set_path(data: dict, segments: tuple[str, ...], value: Any, where: str) -> None:
    """``data[a][b]... = value``, creating missing mappings on the way."""
    node = data
    for i, seg in enumerate(segments[:-1]):
        nxt = node.get(seg)
        if nxt is None:
            nxt = node[seg] = {}
        elif not isinstance(nxt, dict):
            raise ScenarioError(f"{where}: {'.'.join(segments[:i + 1])} is {nxt!r} in the base scenario, not a "
                                "mapping: sweep the whole field instead")
        node = nxt
    node[segments[-1]] = copy.deepcopy(value)


def apply_axis(data: dict, target: tuple[str, ...], value: Any, where: str) -> None:
    """Set one axis value into a scenario mapping (policy fields into every policy or the named one)."""
    if target == ("policies",):  # which policies run: one entry, or a list of them
        data["policies"] = copy.deepcopy(value if isinstance(value, list) else [value])
        return
    if target[0] != "policies":
        _set_path(data, target, value, where)
        return
    entries = data.get("policies")
    if not isinstance(entries, list):
        raise ScenarioError(f"{where}: the base scenario has no list of policies to set {'.'.join(target)} in")
    entries = [{"preset": e} if isinstance(e, str) else copy.deepcopy(e) for e in entries]
    data["policies"] = entries
    who = target[1]
    chosen = [e for e in entries if who == "*" or isinstance(e, dict) and e.get("name", e.get("preset")) == who]
    if not chosen:
        names = [e.get("name", e.get("preset")) for e in entries if isinstance(e, dict)]
        raise ScenarioError(f"{where}: no policy named {who!r} in the base scenario "
                            f"(it has {', '.join(map(str, names))})")
    for e in chosen:
        _set_path(e, target[2:], value, where)


# ---------------------------------------------------------------------------------------------- points


@dataclass(frozen=True)
class Point:
    """One point of the grid: its axis values (by column) and its validated scenario."""

    index: int
    values: dict[str, Any]  # column -> value as written
    scenario: Scenario


@dataclass(frozen=True)
class Task:
    """One simulation: a scenario with a single policy, resolved (absolute paths), and its key."""

    key: str
    policy: str
    scenario: dict  # the resolved scenario mapping, as a worker parses it

    def payload(self) -> dict:
        return {"key": self.key, "policy": self.policy, "scenario": self.scenario}


def _kvsim_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvsim")
    except PackageNotFoundError:
        return "source"


def _file_stamp(path: Path) -> list:
    """What identifies an input file's contents cheaply: its absolute path, size and modification time."""
    p = path.resolve()
    try:
        st = p.stat()
        return [str(p), st.st_size, st.st_mtime_ns]
    except OSError:
        return [str(p), None, None]


def resolved_mapping(scenario: Scenario) -> tuple[dict, list]:
    """The scenario as a mapping a worker anywhere can parse back to the same scenario: relative paths
    made absolute, a length preset kept by name (not also as its distributions), per-step records off
    (a sweep keeps summaries only). Also the stamps of the files it reads."""
    data = scenario.model_dump(mode="json")
    data["record_steps"] = False
    files = []
    w = data["workload"]
    if w.get("kind", "synthetic") == "synthetic":
        if w.get("lengths"):
            w.pop("prompt", None)
            w.pop("output", None)
    else:
        path = scenario.resolve_path(w["path"]).resolve()
        w["path"] = str(path)
        files.append(_file_stamp(path))
    if data["model"].endswith(".json"):
        path = scenario.resolve_path(data["model"]).resolve()
        data["model"] = str(path)
        files.append(_file_stamp(path))
    return data, files


def make_task(scenario: Scenario, policy_index: int) -> Task:
    """The task running one policy of ``scenario``; keyed by a hash of what decides its results (not
    the scenario's name or description)."""
    data, files = resolved_mapping(scenario)
    data["policies"] = [data["policies"][policy_index]]
    keyed = {k: v for k, v in data.items() if k not in ("name", "description")}
    blob = json.dumps({"scenario": keyed, "files": files, "kvsim": _kvsim_version()}, sort_keys=True,
                      separators=(",", ":"))
    return Task(hashlib.sha256(blob.encode()).hexdigest()[:24], data["policies"][0]["name"], data)


# ---------------------------------------------------------------------------------------------- loading


@dataclass
class Sweep:
    """A loaded sweep: its grid of points, its axes and its capacity search (if any)."""

    name: str
    description: str
    source: str
    axes: list[Axis]
    groups: list[list[Axis]]  # the factors of the product: one axis, or one zipped group
    points: list[Point]
    capacity: CapacityConfig | None
    base: dict = field(repr=False)
    base_dir: str = "."
    base_source: str = ""

    def point_scenario(self, values: dict[str, Any]) -> Scenario:
        """The base scenario with these axis values (by column) set. Which policies run (a ``policies``
        axis) is set first, so that policy fields apply to the chosen policies."""
        data = copy.deepcopy(self.base)
        by_column = {a.column: a for a in self.axes}
        if self.capacity is not None and self.capacity.axis not in by_column:
            by_column[self.capacity.axis] = Axis(self.capacity.axis, axis_target(self.capacity.axis)[0], (),
                                                 "capacity.axis")
        for column, value in sorted(values.items(), key=lambda cv: by_column[cv[0]].target != ("policies",)):
            axis = by_column[column]
            apply_axis(data, axis.target, value, f"{self.source}: {axis.key}")
        where = f"{self.source}: point " + ", ".join(f"{c}={_display(v)}" for c, v in values.items())
        return parse_scenario(data, where, base_dir=self.base_dir)


def _line_of(lines: dict, *path: Any) -> str:
    line = lines.get(tuple(path))
    return f":{line}" if line else ""


def _axes(spec: SweepFile, source: str, lines: dict) -> tuple[list[Axis], list[list[Axis]]]:
    """Every axis, checked (a field that exists, a non-empty list, no path twice, zipped lengths equal)."""
    axes: list[Axis] = []
    groups: list[list[Axis]] = []
    seen: dict[tuple[str, ...], str] = {}

    def one(path: str, values: Any, key: str, loc: tuple) -> Axis:
        where = f"{source}{_line_of(lines, *loc)}: {key}"
        if not isinstance(values, list):
            raise ScenarioError(f"{where}: expected a list of values (got {values!r})")
        if not values:
            raise ScenarioError(f"{where}: empty axis: give at least one value")
        target, problem = axis_target(path)
        if problem:
            raise ScenarioError(f"{where}: {problem}")
        for other_target, other_key in seen.items():
            n = min(len(target), len(other_target))
            whole_list = n == 1 and target[0] == "policies"  # which policies run, and a field of them: fine
            if target[:n] == other_target[:n] and not whole_list:
                raise ScenarioError(f"{where}: sets the same field as {other_key}")
        seen[target] = key
        column = "seed" if target == ("workload", "seed") else path
        if target == ("policies",):
            column = "policies"
        return Axis(column, target, tuple(values), key)

    for path, values in spec.axes.items():
        axis = one(path, values, f"axes.{path}", ("axes", path))
        axes.append(axis)
        groups.append([axis])
    zip_key = (lambda i: "zip") if isinstance(spec.zip, dict) else (lambda i: f"zip[{i}]")
    zip_loc = (lambda i: ("zip",)) if isinstance(spec.zip, dict) else (lambda i: ("zip", i))
    for i, group in enumerate(spec.zip_groups()):
        if not group:
            raise ScenarioError(f"{source}{_line_of(lines, *zip_loc(i))}: {zip_key(i)}: empty group")
        members = [one(p, v, f"{zip_key(i)}.{p}", (*zip_loc(i), p)) for p, v in group.items()]
        lengths = {a.key: len(a.values) for a in members}
        if len(set(lengths.values())) > 1:
            raise ScenarioError(f"{source}{_line_of(lines, *zip_loc(i))}: {zip_key(i)}: zipped axes differ in "
                                "length (" + ", ".join(f"{k.split('.', 1)[1]}: {n}" for k, n in lengths.items())
                                + "); give each the same number of values")
        axes += members
        groups.append(members)
    return axes, groups


def _grid(groups: list[list[Axis]]) -> Iterator[dict[str, Any]]:
    """Axis values (by column) of every point: the product of the groups, a zipped group's values taken together."""
    factors = [[{a.column: a.values[j] for a in g} for j in range(len(g[0].values))] for g in groups]
    for combo in itertools.product(*factors):
        values: dict[str, Any] = {}
        for part in combo:
            values.update(part)
        yield values


class _Under:
    """A validation error of a mapping nested under ``key``: its locations seen from the enclosing file."""

    def __init__(self, key: str, error: ValidationError) -> None:
        self.key, self.error = key, error

    def errors(self) -> list[dict]:
        return [{**e, "loc": (self.key, *e["loc"])} for e in self.error.errors()]


def load_sweep(path: str | Path) -> Sweep:
    """Read a sweep file and build (and validate) every point; each problem raises :class:`ScenarioError`
    naming the file, the line and the key."""
    path = Path(path)
    data, lines = read_yaml(path, "sweep")
    source = str(path)
    spec = validate_mapping(SweepFile, data, source, lines, keys="sweep keys (base, axes, zip, capacity)")
    if isinstance(spec.base, str):
        base_path = path.parent / spec.base
        if not base_path.is_file():
            raise ScenarioError(f"{source}{_line_of(lines, 'base')}: base: {base_path}: no such scenario file")
        base, base_lines = read_yaml(base_path, "base scenario")
        base_source, base_dir = str(base_path), str(base_path.parent)
        parse_scenario(base, base_source, base_lines, base_dir)
    else:
        base, base_source, base_dir = spec.base, source, str(path.parent)
        try:
            Scenario.model_validate(base)
        except ValidationError as e:
            raise ScenarioError(format_validation_error(_Under("base", e), source, lines)) from None
    axes, groups = _axes(spec, source, lines)
    cap = spec.capacity
    if cap is not None:
        target, problem = axis_target(cap.axis)
        if problem or target[0] == "policies":
            raise ScenarioError(f"{source}{_line_of(lines, 'capacity', 'axis')}: capacity.axis: "
                                f"{problem or 'a rate is a workload field, not a policy field'}")
        zipped = [a for g in groups if len(g) > 1 for a in g if a.target == target]
        if zipped:
            raise ScenarioError(f"{source}{_line_of(lines, 'capacity', 'axis')}: capacity.axis: {cap.axis} is zipped "
                                f"with other axes ({zipped[0].key}); sweep it under 'axes' so each combination of "
                                "the others gets its own search")
    sweep = Sweep(name=spec.name or path.name.removesuffix(".yaml").removesuffix(".sweep"),
                  description=spec.description, source=source, axes=axes, groups=groups, points=[],
                  capacity=cap, base=base, base_dir=base_dir, base_source=base_source)
    sweep.points = [Point(i, values, sweep.point_scenario(values)) for i, values in enumerate(_grid(groups))]
    if cap is not None:  # every probe must be a valid scenario too: try the search's ends
        for values in _search_combos(sweep)[:1]:
            for rate in (cap.min, cap.max):
                sweep.point_scenario({**values, cap.axis: rate})
    return sweep


# ---------------------------------------------------------------------------------------------- capacity


def _clean(x: float) -> float:
    """A probe value without binary noise (0.35, not 0.35000000000000003)."""
    return float(f"{x:.10g}")


def bracket(tried: dict[float, bool]) -> tuple[float | None, float | None]:
    """(highest passing value below the lowest failing one, lowest failing value); None where absent."""
    fails = [v for v, ok in tried.items() if not ok]
    hi = min(fails) if fails else None
    passes = [v for v, ok in tried.items() if ok and (hi is None or v < hi)]
    return (max(passes) if passes else None), hi


def next_probe(tried: dict[float, bool], cap: CapacityConfig) -> float | None:
    """The next value to try, or None when the search is over. Pure: the same tries give the same answer."""
    lo, hi = bracket(tried)
    if hi is None:  # nothing failed yet: go up
        if lo is None:
            return cap.start or cap.min
        nxt = _clean(min(lo * 2, cap.max))
    elif lo is None:  # nothing passed below the lowest failure: go down
        nxt = _clean(max(hi / 2, cap.min))
    else:
        if cap.close_enough(lo, hi):
            return None
        nxt = _clean((lo + hi) / 2)
    return None if nxt in tried else nxt


@dataclass
class Search:
    """One capacity search: a policy at one combination of the other axes (``values``)."""

    values: dict[str, Any]
    policy_index: int
    policy: str
    seed: int
    grid_keys: dict[float, str]  # axis value -> task key of the grid's runs along the axis
    tried: dict[float, bool] = field(default_factory=dict)
    keys: dict[float, str] = field(default_factory=dict)  # every value tried -> task key
    error: str | None = None
    done: bool = False


def _search_combos(sweep: Sweep) -> list[dict[str, Any]]:
    """The combinations of the other axes a capacity search runs at (the grid without the capacity axis)."""
    axis = sweep.capacity.axis if sweep.capacity else None
    groups = [g for g in sweep.groups if not (len(g) == 1 and g[0].column == axis)]
    return list(_grid(groups))


def build_searches(sweep: Sweep, grid_tasks: dict[int, list[Task]]) -> list[Search]:
    """One search per policy and combination of the other axes, with the grid's runs along the axis."""
    cap = sweep.capacity
    if cap is None:
        return []
    along: dict[tuple, dict[float, list[Task]]] = {}
    for point in sweep.points:
        if cap.axis in point.values:
            rest = tuple((c, _display(v)) for c, v in point.values.items() if c != cap.axis)
            along.setdefault(rest, {})[float(point.values[cap.axis])] = grid_tasks[point.index]
    searches = []
    for values in _search_combos(sweep):
        scenario = sweep.point_scenario(values)
        runs = along.get(tuple((c, _display(v)) for c, v in values.items()), {})
        for i, policy in enumerate(scenario.policies):
            grid = {v: tasks[i].key for v, tasks in runs.items()}
            searches.append(Search(values, i, policy.name, scenario.workload.seed, grid))
    return searches


def probe_task(sweep: Sweep, search: Search, value: float) -> Task:
    scenario = sweep.point_scenario({**search.values, sweep.capacity.axis: value})
    return make_task(scenario, search.policy_index)


def max_probes(cap: CapacityConfig) -> int:
    """An upper bound on the runs of one search (to size the progress bar; the search itself is bounded
    by the same arithmetic): climbing or descending by factors of 2, then bisecting to the tolerance."""
    start = cap.start or cap.min
    narrowest = cap.tolerance if cap.tolerance is not None else cap.relative_tolerance * cap.min
    return (math.ceil(math.log2(cap.max / start)) + math.ceil(math.log2(start / cap.min))
            + math.ceil(math.log2((cap.max - cap.min) / narrowest)) + 3)


# ---------------------------------------------------------------------------------------------- running


@dataclass
class Outcome:
    """What one task produced: the policy's summary and its workload's, or the error it stopped with."""

    key: str
    policy: str
    summary: dict | None
    workload: dict | None
    error: str | None
    wall_s: float
    reused: bool = False

    @classmethod
    def from_json(cls, data: dict, reused: bool = False) -> "Outcome":
        return cls(data["key"], data["policy"], data.get("summary"), data.get("workload"), data.get("error"),
                   float(data.get("wall_s", 0.0)), reused)

    def to_json(self) -> dict:
        return {"key": self.key, "policy": self.policy, "summary": self.summary, "workload": self.workload,
                "error": self.error, "wall_s": self.wall_s}


class PointStore:
    """Finished tasks, one JSON file each (``points/<key>.json``), written as soon as a task finishes
    (write to a temporary name, then rename: a file is either whole or absent). Failed tasks are not
    stored: a second run tries them again."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir / POINTS_DIR

    def get(self, key: str) -> Outcome | None:
        p = self.dir / f"{key}.json"
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return Outcome.from_json(data, reused=True) if data.get("key") == key and not data.get("error") else None

    def put(self, outcome: Outcome, task: Task) -> None:
        if outcome.error:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{outcome.key}.json.tmp"
        tmp.write_text(json.dumps({**outcome.to_json(), "scenario": task.scenario}, allow_nan=False))
        tmp.replace(self.dir / f"{outcome.key}.json")


class Progress:
    """What the driver reports while it runs. This base reports nowhere (the Python API's default);
    ``sim sweep`` passes one that draws a progress bar."""

    def add_total(self, n: int) -> None:
        """``n`` more runs are expected (negative: fewer, when a search ends before its bound)."""

    def advance(self, outcome: Outcome) -> None:
        """One run finished (or was read back from an earlier run)."""


class SweepInterrupted(Exception):
    """Stopped by the user; every finished task is stored."""


def drive(executor, tasks: list[Task], searches: list[Search], sweep: Sweep, store: PointStore, resume: bool,
          progress: Progress | None = None) -> dict[str, Outcome]:
    """Run every grid task and every capacity search on ``executor`` (``submit(payload)``, ``wait_one()
    -> outcome dict``, ``slots``), storing each outcome as it arrives; returns outcomes by task key.

    Grid tasks go first, at most ``slots`` in flight. A search starts once the grid runs along its axis
    are done, keeps one probe in flight, and stops when :func:`next_probe` says so or a run fails (its
    error is kept)."""
    cap = sweep.capacity
    progress = progress or Progress()
    outcomes: dict[str, Outcome] = {}
    in_flight: dict[str, Task] = {}
    waiting_on: dict[str, list[Search]] = {}  # task key -> searches waiting for its outcome
    queue = list({t.key: t for t in tasks}.values())
    budget = max_probes(cap) if cap is not None else 0
    progress.add_total(len(queue) + budget * len(searches))

    def known(task: Task) -> bool:
        """True when the task's outcome is known (now, or stored by an earlier run); else make sure it runs."""
        if task.key in outcomes:
            return True
        stored = store.get(task.key) if resume else None
        if stored is not None:
            outcomes[task.key] = stored
            progress.advance(stored)
            return True
        if task.key not in in_flight:
            executor.submit(task.payload())
            in_flight[task.key] = task
        return False

    def finish(s: Search, error: str | None = None) -> None:
        s.done, s.error = True, error
        progress.add_total(-(budget - len(set(s.keys) - set(s.grid_keys))))

    def step(s: Search) -> None:
        """Feed a search what is known; submit its next probe, or finish it."""
        if any(k not in outcomes for k in s.grid_keys.values()):
            return  # its grid runs are not all in yet
        while True:
            for v, k in {**s.grid_keys, **s.keys}.items():
                if v not in s.tried and k in outcomes:
                    if outcomes[k].error:
                        return finish(s, outcomes[k].error)
                    s.tried[v] = cap.met(outcomes[k].summary)
                    s.keys[v] = k
            value = next_probe(s.tried, cap)
            if value is None:
                return finish(s)
            task = probe_task(sweep, s, value)
            s.keys[value] = task.key
            if not known(task):
                waiting_on.setdefault(task.key, []).append(s)
                return

    try:
        while True:
            while queue and len(in_flight) < executor.slots:
                known(queue.pop(0))
            if not queue:
                busy = {id(s) for ws in waiting_on.values() for s in ws}
                for s in searches:
                    if not s.done and id(s) not in busy:
                        step(s)
            if not in_flight:
                if queue:
                    continue
                return outcomes
            out = Outcome.from_json(executor.wait_one())
            store.put(out, in_flight.pop(out.key))
            outcomes[out.key] = out
            progress.advance(out)
            for s in waiting_on.pop(out.key, []):
                step(s)
    except KeyboardInterrupt:
        raise SweepInterrupted(f"interrupted: {sum(not o.reused for o in outcomes.values())} runs finished and are "
                               f"stored in {store.dir}; run the same command again to resume") from None


# ---------------------------------------------------------------------------------------------- tables


def grid_tasks(sweep: Sweep) -> dict[int, list[Task]]:
    """Each point's tasks, one per policy, in the scenario's order."""
    return {p.index: [make_task(p.scenario, i) for i in range(len(p.scenario.policies))] for p in sweep.points}


def _metric_row(outcome: Outcome | None) -> dict[str, Any]:
    summary = (outcome.summary if outcome else None) or {}
    row = {m: summary.get(m) for m in summary_metric_names()}
    workload = (outcome.workload if outcome else None) or {}
    row["offered_request_rate"] = workload.get("mean_request_rate")
    return row


def sweep_table(sweep: Sweep, tasks: dict[int, list[Task]], outcomes: dict[str, Outcome]) -> pd.DataFrame:
    """One row per point and policy: the axis values (columns named by their path), ``seed``, ``policy``,
    the summary metrics, ``offered_request_rate`` (the workload's mean arrival rate), ``point_key`` and
    ``error`` (None when the run succeeded)."""
    rows = []
    for point in sweep.points:
        values = {c: _display(v) for c, v in point.values.items() if c != "policies"}
        for task in tasks[point.index]:
            out = outcomes.get(task.key)
            rows.append({**values, "seed": point.scenario.workload.seed, "policy": task.policy,
                         **_metric_row(out), "point_key": task.key,
                         "error": out.error if out else "not run"})
    return pd.DataFrame(rows)


def capacity_tables(sweep: Sweep, searches: list[Search], outcomes: dict[str, Outcome]
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(capacity table: one row per search; runs table: every run a search judged, with its verdict)."""
    cap = sweep.capacity
    rows, runs = [], []
    for s in searches:
        values = {c: _display(v) for c, v in s.values.items() if c != "policies"}
        lo, hi = bracket(s.tried)
        status = ("error" if s.error else "none" if lo is None else "above max" if hi is None else "found")
        rate = None
        if lo is not None and not s.error:
            rate = lo if cap.axis == RATE_AXIS else (outcomes[s.keys[lo]].workload or {}).get("mean_request_rate")
        tried = sorted(s.tried)
        rows.append({**values, "seed": s.seed, "policy": s.policy, "axis": cap.axis,
                     "sustainable_request_rate": rate,
                     "sustainable_value": lo if not s.error else None, "met": lo is not None and not s.error,
                     "status": status, "slo": cap.slo_text(), "tolerance": cap.tolerance,
                     "relative_tolerance": cap.relative_tolerance,
                     "lowest_rate_tried": tried[0] if tried else None,
                     "highest_rate_tried": tried[-1] if tried else None,
                     "lowest_failing_rate": hi, "num_runs": len(s.tried), "error": s.error})
        for v in tried:
            out = outcomes[s.keys[v]]
            runs.append({**values, "seed": s.seed, "policy": s.policy, "axis": cap.axis, "value": v,
                         "met": s.tried[v], **{m: (out.summary or {}).get(m) for m in cap.slo},
                         "offered_request_rate": (out.workload or {}).get("mean_request_rate"),
                         "point_key": out.key})
    return pd.DataFrame(rows), pd.DataFrame(runs)


@dataclass
class SweepResult:
    sweep: Sweep
    table: pd.DataFrame
    capacity: pd.DataFrame | None
    capacity_runs: pd.DataFrame | None
    num_runs: int  # simulations run now
    num_reused: int  # finished earlier, read back
    failures: list[tuple[str, str]]  # (what, error)
    wall_s: float


def run_sweep(sweep: Sweep, out_dir: str | Path, executor, *, resume: bool = True,
              progress: Progress | None = None) -> SweepResult:
    """Run a loaded sweep on an executor (see :mod:`sim.executors`), storing each task as it finishes
    under ``out_dir/points``; returns the tables (not yet written)."""
    out = Path(out_dir)
    t0 = time.perf_counter()
    tasks = grid_tasks(sweep)
    searches = build_searches(sweep, tasks)
    outcomes = drive(executor, [t for ts in tasks.values() for t in ts], searches, sweep, PointStore(out), resume,
                     progress)
    table = sweep_table(sweep, tasks, outcomes)
    capacity = runs = None
    if sweep.capacity is not None:
        capacity, runs = capacity_tables(sweep, searches, outcomes)
    failures: list[tuple[str, str]] = []
    for _, r in table[table["error"].notna()].iterrows():
        where = ", ".join(f"{a.column}={r[a.column]}" for a in sweep.axes if a.column in r.index)
        failures.append((f"{r['policy']} at {where or 'the base scenario'}", r["error"]))
    if capacity is not None:
        for _, r in capacity[capacity["status"] == "error"].iterrows():
            failures.append((f"capacity search for {r['policy']}", r["error"]))
    return SweepResult(sweep, table, capacity, runs, sum(not o.reused for o in outcomes.values()),
                       sum(o.reused for o in outcomes.values()), failures, time.perf_counter() - t0)


def write_sweep(result: SweepResult, out_dir: str | Path, executor_name: str, report: bool = True
                ) -> dict[str, Path]:
    """sweep.parquet/.csv, capacity.parquet/.csv and capacity_runs.parquet (with a capacity search),
    sweep.json (what was swept, the SLO, timings, failures) and report.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sweep": out / SWEEP_TABLE, "sweep_csv": out / "sweep.csv", "info": out / SWEEP_INFO}
    result.table.to_parquet(paths["sweep"], index=False)
    result.table.to_csv(paths["sweep_csv"], index=False)
    for p in (CAPACITY_TABLE, "capacity.csv", CAPACITY_RUNS_TABLE):
        (out / p).unlink(missing_ok=True)  # a sweep without a capacity search leaves none behind
    if result.capacity is not None:
        paths["capacity"] = out / CAPACITY_TABLE
        paths["capacity_csv"] = out / "capacity.csv"
        paths["capacity_runs"] = out / CAPACITY_RUNS_TABLE
        result.capacity.to_parquet(paths["capacity"], index=False)
        result.capacity.to_csv(paths["capacity_csv"], index=False)
        result.capacity_runs.to_parquet(paths["capacity_runs"], index=False)
    s = result.sweep
    cap = s.capacity
    info = {
        "name": s.name, "description": s.description, "source": s.source, "base": s.base_source,
        "axes": [{"column": a.column, "key": a.key, "values": [_display(v) for v in a.values]} for a in s.axes],
        "num_points": len(s.points), "num_rows": len(result.table),
        "capacity": None if cap is None else {"axis": cap.axis, "slo": cap.slo_text(), "min": cap.min,
                                              "max": cap.max, "tolerance": cap.tolerance_text()},
        "executor": executor_name, "wall_s": result.wall_s, "num_runs": result.num_runs,
        "num_reused": result.num_reused, "failures": [{"what": w, "error": e} for w, e in result.failures],
    }
    paths["info"].write_text(json.dumps(info, indent=2, allow_nan=False))
    if report:
        from reports.html import write_report

        paths["report"] = write_report(out)
    return paths


def sweep_to_dir(sweep_path: str | Path, out_dir: str | Path | None = None, *, executor: str = "local",
                 workers: int | None = None, address: str | None = None, resume: bool = True, report: bool = True,
                 console=None) -> tuple[SweepResult, dict[str, Path]]:
    """``sim sweep``: load, run with a progress bar (ETA), write the tables and the report."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from sim.executors import make_executor
    from sim.run import slug

    sweep = load_sweep(sweep_path)
    out = Path(out_dir) if out_dir is not None else Path("runs") / slug(sweep.name, "sweep")
    with make_executor(executor, workers=workers, address=address) as ex, \
            Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("runs"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                transient=True) as bar:
        task_id = bar.add_task(f"{sweep.name} ({ex.name}, {ex.slots} workers)", total=0)
        result = run_sweep(sweep, out, ex, resume=resume, progress=_BarProgress(bar, task_id))
    return result, write_sweep(result, out, executor, report=report)


class _BarProgress(Progress):
    """Advances a rich progress bar; capacity probes count against an upper bound, trimmed at the end."""

    def __init__(self, bar, task_id) -> None:
        self.bar, self.task_id, self.total = bar, task_id, 0

    def add_total(self, n: int) -> None:
        self.total += n
        self.bar.update(self.task_id, total=self.total)

    def advance(self, outcome: Outcome) -> None:
        self.bar.advance(self.task_id)



