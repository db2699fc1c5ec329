"""A sweep run end to end: run the tasks, build the tables, write them (and the report)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from sim.config import ScenarioError
from sim.outputs import ReportWriter, claim, out_dir as out_dir_checked, write_result_table
from sim.schema import SWEEP_MARK
from sim.sweep.capacity import build_searches
from sim.sweep.drive import Outcome, PointStore, Progress, drive
from sim.sweep.spec import Sweep, _display, load_sweep
from sim.sweep.tables import capacity_tables, grid_tasks, sweep_table
from sim.workload import TraceReader

SWEEP_TABLE, CAPACITY_TABLE, CAPACITY_RUNS_TABLE, SWEEP_INFO = (
    "sweep.parquet", "capacity.parquet", "capacity_runs.parquet", SWEEP_MARK)

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
              progress: Progress | None = None, read_trace: TraceReader | None = None) -> SweepResult:
    """Run a loaded sweep on an executor (see :mod:`sim.executors`), storing each task as it finishes
    under ``out_dir/points``; returns the tables (not yet written). ``read_trace``: the trace reader, for
    trace workloads (``sim.workload.load_requests``)."""
    out = Path(out_dir)
    t0 = time.perf_counter()
    tasks = grid_tasks(sweep)
    searches = build_searches(sweep, tasks)
    outcomes = drive(executor, [t for ts in tasks.values() for t in ts], searches, sweep, PointStore(out), resume,
                     progress, read_trace)
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
            # (the point named, as a grid run's is: one line per block size said the same thing three times)
            where = ", ".join(f"{a.column}={r[a.column]}" for a in sweep.axes if a.column in r.index)
            failures.append((f"capacity search for {r['policy']}" + (f" at {where}" if where else ""), r["error"]))
    return SweepResult(sweep, table, capacity, runs, sum(not o.reused for o in outcomes.values()),
                       sum(o.reused for o in outcomes.values()), failures, time.perf_counter() - t0)


def write_sweep(result: SweepResult, out_dir: str | Path, executor_name: str, report: ReportWriter | None = None
                ) -> dict[str, Path]:
    """sweep.parquet/.csv, capacity.parquet/.csv and capacity_runs.parquet (with a capacity search),
    sweep.json (what was swept, the SLO, timings, failures) and report.html (by ``report``, when given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sweep": out / SWEEP_TABLE, "sweep_csv": out / "sweep.csv", "info": out / SWEEP_INFO}
    write_result_table(result.table, paths["sweep"])
    result.table.to_csv(paths["sweep_csv"], index=False)
    for p in (CAPACITY_TABLE, "capacity.csv", CAPACITY_RUNS_TABLE):
        (out / p).unlink(missing_ok=True)  # a sweep without a capacity search leaves none behind
    if result.capacity is not None:
        paths["capacity"] = out / CAPACITY_TABLE
        paths["capacity_csv"] = out / "capacity.csv"
        paths["capacity_runs"] = out / CAPACITY_RUNS_TABLE
        write_result_table(result.capacity, paths["capacity"])
        result.capacity.to_csv(paths["capacity_csv"], index=False)
        write_result_table(result.capacity_runs, paths["capacity_runs"])
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
        paths["report"] = report(out)
    return paths


def sweep_to_dir(sweep_path: str | Path, out_dir: str | Path | None = None, *, executor: str = "local",
                 workers: int | None = None, address: str | None = None, resume: bool = True,
                 report: ReportWriter | None = None, read_trace: TraceReader | None = None,
                 console=None) -> tuple[SweepResult, dict[str, Path]]:
    """``sim sweep``: load, run with a progress bar (ETA), write the tables (and the report, by ``report``)."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from sim.executors import make_executor
    from sim.run import default_out

    sweep = load_sweep(sweep_path)
    out = claim(out_dir_checked(out_dir, "out_dir") if out_dir is not None else default_out(sweep.name, "sweep"),
                "sweep", sweep.name, default=out_dir is None)
    # (the executor first: it checks workers and address before the folder and its lock are made)
    with make_executor(executor, workers=workers, address=address) as ex, folder_lock(out), \
            Bar(TextColumn("{task.description}", markup=False),  # markup=False: the name as written
                BarColumn(), MofNCompleteColumn(), TextColumn("runs"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=console, transient=True) as bar:
        task_id = bar.add_task(f"{sweep.name} ({ex.name}, {ex.slots} workers)", total=0)
        result = run_sweep(sweep, out, ex, resume=resume, progress=_BarProgress(bar, task_id), read_trace=read_trace)
    return result, write_sweep(result, out, executor, report=report)


LOCK_FILE = ".sweep.lock"


@contextmanager
def folder_lock(out: Path):
    """One sweep at a time in a folder: an exclusive lock on ``out/.sweep.lock`` (released by the kernel
    however the holder ends), holding the holder's pid for the message a second sweep gets."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    f = open(out / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            other = f.read().strip() or "another process"
            raise ScenarioError(f"{out}: another sweep is writing to this folder (pid {other}); wait for it, "
                                f"or give another --out") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        f.close()


class _BarProgress(Progress):
    """Advances a rich progress bar; capacity probes count against an upper bound, trimmed at the end."""

    def __init__(self, bar, task_id) -> None:
        self.bar, self.task_id, self.total = bar, task_id, 0

    def add_total(self, n: int) -> None:
        self.total += n
        self.bar.update(self.task_id, total=self.total)

    def advance(self, outcome: Outcome) -> None:
        self.bar.advance(self.task_id)

    def note(self, line: str) -> None:
        self.bar.console.print(line, highlight=False, markup=False, soft_wrap=True)
