"""The sweep file: its model (axes, zipped groups, the capacity search and its SLO), axis paths, and
loading a sweep into its grid of points."""

from __future__ import annotations

import copy
import difflib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sim.config import (Name, PolicyConfig, Real, Scenario, ScenarioError, Strict, format_validation_error, parse_scenario,
                        check_kind, file_kind, own_arrivals, read_yaml, validate_mapping)
from sim.schema import METRICS, RATE_AXIS, RATE_SCALE_AXIS
from sim.userfile import user_path

RATE_AXES = (RATE_AXIS, RATE_SCALE_AXIS)  # what a capacity search may search: generated, or a trace's
MAX_POINTS = 10_000  # a sweep's points, each a simulation (and each built and checked when the sweep loads)
SEED = ("workload", "seed")  # where a sweep's ``seed`` axis goes

# ---------------------------------------------------------------------------------------------- the file


def summary_metric_names() -> list[str]:
    """The metrics a policy's summary may hold (what an SLO may bound, the sweep table's columns): the
    declared schema, ``sim.schema.METRICS``."""
    return list(METRICS)


def known_slo_metrics(slo: dict) -> dict:
    """``slo`` itself when every key is a summary metric; else a ValueError naming the first unknown one
    (an SLO's keys, in a sweep's capacity search and in a plan)."""
    names = summary_metric_names()
    for metric in slo:
        if metric not in names:
            hint = difflib.get_close_matches(metric, names, 1)
            raise ValueError(f"unknown metric {metric!r}" + (f" (did you mean {hint[0]!r}?)" if hint else
                             f"; expected a summary metric such as {', '.join(names[8:14])}"))
        top = getattr(slo[metric], "max", None)
        # every summary metric is >= 0: such a bound fails every run, whatever it serves (0 can hold: a count,
        # a scheduling delay)
        if top is not None and top < 0:
            raise ValueError(f"{metric}: at most {top:g} can never be met (it is never negative); expected a "
                             "bound of 0 or more")
    return slo


class Bound(Strict):
    """A limit on one summary metric: ``max`` (at most) and/or ``min`` (at least)."""

    max: Real | None = None
    min: Real | None = None

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
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}: no value meets it")
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
    min: Real = Field(gt=0, le=1e12, description="lowest value tried: if it fails, the answer is 'none'")
    max: Real = Field(gt=0, le=1e12, description="highest value tried: if it passes, the answer is 'above max'")
    start: Real | None = Field(None, gt=0, le=1e12, description="first probe when the axis is not swept "
                                "(default: min)")
    tolerance: Real | None = Field(None, gt=0, description="bisection stops when passing and failing values are "
                                    "this close (axis units)")
    relative_tolerance: Real | None = Field(None, gt=0, lt=1, description="... or this close relative to the "
                                             "passing value (0.02: within 2 %)")

    @field_validator("slo")
    @classmethod
    def _known_metrics(cls, slo: dict[str, Bound]) -> dict[str, Bound]:
        return known_slo_metrics(slo)

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

    name: Name | None = Field(None, description="default: the file's name without .yaml")
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
        return SEED, None
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
        scenario = parse_scenario(data, where, base_dir=self.base_dir)
        if scenario.cluster is not None and len(scenario.cluster.routers) > 1:
            # (a list runs each router as its own policy, named policy/router: a point's task runs one policy)
            raise ScenarioError(f"{where}: cluster.router: a sweep point runs one router, not "
                                f"{', '.join(scenario.cluster.routers)}; sweep them as an axis "
                                "(axes: {cluster.router: [...]})")
        return scenario


def _line_of(lines: dict, *path: Any) -> str:
    line = lines.get(tuple(path))
    return f":{line}" if line else ""


def _axes(spec: SweepFile, source: str, lines: dict) -> tuple[list[Axis], list[list[Axis]]]:
    """Every axis, checked (a field that exists, a non-empty list, no path twice, zipped lengths equal)."""
    axes: list[Axis] = []
    groups: list[list[Axis]] = []
    seen: dict[tuple[str, ...], str] = {}

    def one(path: str, values: Any, key: str, loc: tuple, zipped: bool = False) -> Axis:
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
            # ("policies", "*", f): that field of every policy, so also of each named one (block_size and
            # policies.vllm.block_size: the later one silently won)
            same = all(a == b or (i == 1 and target[0] == "policies" and "*" in (a, b))
                       for i, (a, b) in enumerate(zip(target[:n], other_target[:n])))
            if same and not whole_list:
                raise ScenarioError(f"{where}: sets the same field as {other_key}")
        seen[target] = key
        if not zipped:  # (a zipped axis may repeat a value: its group's combinations must differ)
            _no_repeats([(v,) for v in values], where, [])
        column = "seed" if target == SEED else path
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
        members = [one(p, v, f"{zip_key(i)}.{p}", (*zip_loc(i), p), zipped=True) for p, v in group.items()]
        lengths = {a.key: len(a.values) for a in members}
        if len(set(lengths.values())) > 1:
            raise ScenarioError(f"{source}{_line_of(lines, *zip_loc(i))}: {zip_key(i)}: zipped axes differ in "
                                "length (" + ", ".join(f"{k.split('.', 1)[1]}: {n}" for k, n in lengths.items())
                                + "); give each the same number of values")
        _no_repeats(list(zip(*(a.values for a in members))), f"{source}{_line_of(lines, *zip_loc(i))}: {zip_key(i)}",
                    [a.column for a in members])
        axes += members
        groups.append(members)
    return axes, groups


def _no_repeats(combos: list[tuple], where: str, columns: list[str]) -> None:
    """Each value of an axis (each combination of a zipped group's ``columns``) once: a repeat ran the same
    points twice (a plan refuses a value listed twice too)."""
    first: dict[tuple, int] = {}
    for i, combo in enumerate(combos):
        k = tuple(_display(v) for v in combo)
        if k in first:
            shown = ", ".join(f"{c}={v}" for c, v in zip(columns, k)) if columns else str(k[0])
            raise ScenarioError(f"{where}: {shown} is listed twice (values {first[k] + 1} and {i + 1}); give each "
                                f"{'combination' if columns else 'value'} once")
        first[k] = i


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


def read_base(path: Path, base: str | dict, lines: dict) -> tuple[Any, dict | None, str, str]:
    """A sweep's or a plan's ``base``: (data, its key lines, its source, its folder). A path is read relative
    to ``path``'s folder (a missing file names the ``base`` key's line); a mapping is copied."""
    if isinstance(base, str):
        base_path = path.parent / base
        if not base_path.is_file():
            raise ScenarioError(f"{path}{_line_of(lines, 'base')}: base: {base_path}: no such scenario file")
        data, base_lines = read_yaml(base_path, "base scenario")
        kind = file_kind(data)
        if kind in ("sweep", "plan"):  # (itself included: was a list of "unknown key" lines, one per key)
            raise ScenarioError(f"{path}{_line_of(lines, 'base')}: base: {base_path} is a {kind} file, not a "
                                f"scenario; base: names a scenario file (or give the scenario's keys under base:)")
        return data, base_lines, str(base_path), str(base_path.parent)
    return copy.deepcopy(base), None, str(path), str(path.parent)


def load_sweep(path: str | Path) -> Sweep:
    """Read a sweep file and build (and validate) every point; each problem raises :class:`ScenarioError`
    naming the file, the line and the key."""
    path = user_path(path, "sweep file", ScenarioError)
    data, lines = read_yaml(path, "sweep")
    check_kind(data, path, "sweep")
    source = str(path)
    spec = validate_mapping(SweepFile, data, source, lines, keys="sweep keys (base, axes, zip, capacity)")
    base, base_lines, base_source, base_dir = read_base(path, spec.base, lines)
    if isinstance(spec.base, str):
        parse_scenario(base, base_source, base_lines, base_dir)
    else:
        if isinstance(base, dict):  # an inline base is named after the sweep, as a plan's is
            base.setdefault("name", spec.name or path.stem)
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
        if cap.axis not in RATE_AXES:  # the search assumes more of it is harder to serve
            raise ScenarioError(f"{source}{_line_of(lines, 'capacity', 'axis')}: capacity.axis: {cap.axis} is not a "
                                f"request rate; the search is over {' or '.join(RATE_AXES)}")
        if (cap.axis == RATE_AXIS and own_arrivals(base.get("workload") if isinstance(base, dict) else None)
                and not any(a.target[:2] == ("workload", "arrival") for a in axes)):
            # (was: "workload.arrival: Unable to extract tag using discriminator 'kind'")
            raise ScenarioError(f"{source}{_line_of(lines, 'capacity', 'axis') or _line_of(lines, 'capacity')}: "
                                f"capacity.axis: the base workload is a trace, with its own arrival times: set "
                                f"capacity.axis: workload.rate_scale (or give the trace an arrival process)")
        zipped = [a for g in groups if len(g) > 1 for a in g if a.target == target]
        if zipped:
            raise ScenarioError(f"{source}{_line_of(lines, 'capacity', 'axis')}: capacity.axis: {cap.axis} is zipped "
                                f"with other axes ({zipped[0].key}); sweep it under 'axes' so each combination of "
                                "the others gets its own search")
    sweep = Sweep(name=spec.name or path.name.removesuffix(".yaml").removesuffix(".sweep"),
                  description=spec.description, source=source, axes=axes, groups=groups, points=[],
                  capacity=cap, base=base, base_dir=base_dir, base_source=base_source)
    n = math.prod(len(g[0].values) for g in groups)
    if n > MAX_POINTS:
        raise ScenarioError(f"{source}: {n:,} points (the product of the axes' values): at most {MAX_POINTS:,} in "
                            "one sweep; sweep fewer values, or split it")
    sweep.points = [Point(i, values, sweep.point_scenario(values)) for i, values in enumerate(_grid(groups))]
    if cap is not None:  # every probe must be a valid scenario too: try the search's ends
        for values in _search_combos(sweep)[:1]:
            for rate in (cap.min, cap.max):
                sweep.point_scenario({**values, cap.axis: rate})
    return sweep


def _search_combos(sweep: Sweep) -> list[dict[str, Any]]:
    """The combinations of the other axes a capacity search runs at (the grid without the capacity axis)."""
    axis = sweep.capacity.axis if sweep.capacity else None
    groups = [g for g in sweep.groups if not (len(g) == 1 and g[0].column == axis)]
    return list(_grid(groups))
