"""Running tasks on an executor: outcomes, the point store (resume), progress, and the drive loop that
interleaves grid tasks and capacity searches."""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sim.config import ScenarioError
from sim.schema import METRICS
from sim.sweep.capacity import Search, max_probes, next_probe, probe_task
from sim.sweep.spec import Sweep
from sim.sweep.tasks import Task
from sim.workload import TraceReader

POINTS_DIR = "points"

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
        if self.dir.exists() and not self.dir.is_dir():  # (was "points: File exists", at the first run stored)
            raise ScenarioError(f"{self.dir}: a file where the folder of stored runs belongs; remove it")

    def get(self, key: str, note: Callable[[str], None] | None = None) -> Outcome | None:
        """The stored outcome of task ``key``; None when there is none, or it cannot be trusted (``damaged``:
        then the task runs again, and ``note`` is told why)."""
        p = self._file(key)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # (a file cut short by a crash before the rename existed: run again)
            data = None
        why = damaged(data, key)
        if why is not None:
            if note is not None:
                note(f"{p}: {why}; running it again")
            return None
        return Outcome.from_json(data, reused=True)

    def put(self, outcome: Outcome, task: Task) -> None:
        if outcome.error:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{outcome.key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # unique: no two writers share it
        target = self._file(outcome.key)
        tmp.write_text(json.dumps({**outcome.to_json(), "scenario": task.scenario}, allow_nan=False))
        tmp.replace(target)

    def _file(self, key: str) -> Path:
        p = self.dir / f"{key}.json"
        if p.is_dir():  # (storing the run failed, naming a temporary file)
            raise ScenarioError(f"{p}: a folder where a stored run belongs; remove it")
        return p


# what every policy summary holds (``sim.metrics``): a stored point without them was not written by a run
STORED_METRICS = ("num_requests", "num_finished", "num_rejected", "num_unfinished", "duration_s", "request_throughput",
                  "num_steps")


def damaged(data: Any, key: str) -> str | None:
    """Why a stored point cannot be reused as task ``key``'s outcome (None: it can). NOTE: a point that read
    back as JSON but not as a run wrote it was a traceback (null, a list, no "policy"), or worse was reused:
    an empty summary counted as a run that failed its SLO, which moved a capacity and a plan's winner."""
    if not isinstance(data, dict):
        return "not a stored run (cannot read it as a JSON object)"
    if data.get("key") != key:
        return f"holds the run of another task ({str(data.get('key'))[:40]!r})"
    if data.get("error"):
        return "a failed run (failures are tried again)"
    if not isinstance(data.get("policy"), str):
        return "no policy name"
    summary, workload, wall = data.get("summary"), data.get("workload"), data.get("wall_s", 0.0)
    if not isinstance(summary, dict):
        return "no summary of metrics"
    if workload is not None and not isinstance(workload, dict):
        return "its workload is not an object"
    if isinstance(wall, bool) or not isinstance(wall, (int, float)):
        return f"wall_s is {wall!r:.40}, expected seconds"
    missing = [m for m in STORED_METRICS if m not in summary]
    if missing:
        return f"its summary lacks {', '.join(missing)}"
    for name, v in summary.items():
        if name in METRICS and v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                  or not v >= 0 or v == math.inf):
            return f"summary.{name} is {v!r:.40}, expected a number of 0 or more, or null"
    return None


class Progress:
    """What the driver reports while it runs. This base reports nowhere (the Python API's default);
    ``sim sweep`` passes one that draws a progress bar."""

    def add_total(self, n: int) -> None:
        """``n`` more runs are expected (negative: fewer, when a search ends before its bound)."""

    def advance(self, outcome: Outcome) -> None:
        """One run finished (or was read back from an earlier run)."""

    def note(self, line: str) -> None:
        """A milestone in words (a plan's rate searched), for a log that outlives the bar."""


class SweepInterrupted(Exception):
    """Stopped by the user; every finished task is stored."""


def drive(executor, tasks: list[Task], searches: list[Search], sweep: Sweep | None, store: PointStore, resume: bool,
          progress: Progress | None = None, read_trace: TraceReader | None = None) -> dict[str, Outcome]:
    """Run every grid task and every capacity search on ``executor`` (``submit(payload)``, ``wait_one()
    -> outcome dict``, ``slots``), storing each outcome as it arrives; returns outcomes by task key.
    ``read_trace`` travels with each task to its worker (trace workloads).

    Grid tasks go first, at most ``slots`` in flight. A search starts once the grid runs along its axis
    are done, keeps one probe in flight, and stops when :func:`next_probe` says so or a run fails (its
    error is kept). Without searches ``sweep`` may be None (``sim plan`` runs its waves of tasks here)."""
    cap = sweep.capacity if sweep is not None else None
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
        stored = store.get(task.key, progress.note) if resume else None
        if stored is not None:
            outcomes[task.key] = stored
            progress.advance(stored)
            return True
        if task.key not in in_flight:
            executor.submit(task.payload(read_trace))
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
