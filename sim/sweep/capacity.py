"""Capacity search: bracketing and bisection of the rate at which a policy still meets the SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sim.sweep.spec import CapacityConfig, Sweep, _display, _search_combos
from sim.sweep.tasks import Task, make_task

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
