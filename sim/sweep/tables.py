"""The sweep's tables: one row per point and policy (every declared metric a column), and the capacity
tables."""

from __future__ import annotations

from typing import Any

import pandas as pd

from sim.sweep.capacity import Search, bracket
from sim.sweep.drive import Outcome
from sim.sweep.spec import RATE_AXIS, Sweep, _display, summary_metric_names
from sim.sweep.tasks import Task, make_task

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
        values = {c: _display(v) for c, v in point.values.items()}
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
        values = {c: _display(v) for c, v in s.values.items()}
        lo, hi = bracket(s.tried)
        status = ("error" if s.error else "none" if lo is None else "above max" if hi is None else "found")
        failed = [v for v, met in s.tried.items() if not met]
        if not s.error and failed and any(met and v > min(failed) for v, met in s.tried.items()):
            # a rate passed above one that failed: the SLO is not harder to meet at higher rates (a minimum
            # bound, such as on throughput), which the search assumes; its answer is not to be trusted
            status = "not monotone"
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
