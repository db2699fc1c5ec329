"""Tasks: one point and one policy as a resolved scenario mapping, keyed by a hash of what decides its
results (so a second run finds finished tasks again)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from sim.catalog import MODELS
from sim.config import Scenario
from sim.userfile import file_digest


@dataclass(frozen=True)
class Task:
    """One simulation: a scenario with a single policy, resolved (absolute paths), and its key."""

    key: str
    policy: str
    scenario: dict  # the resolved scenario mapping, as a worker parses it

    def payload(self, read_trace=None) -> dict:
        """What a worker runs (``sim.executors.simulate_task``); ``read_trace``, the trace reader, goes by
        reference (a module-level function: the worker imports it)."""
        out = {"key": self.key, "policy": self.policy, "scenario": self.scenario}
        if read_trace is not None:
            out["read_trace"] = read_trace
        return out


@functools.lru_cache(maxsize=1)
def _kvsim_version() -> str:
    """The package version and a digest of the code that decides a run's results (the simulator, ``sim/``,
    and the trace readers, ``traces/``): a rerun into an old folder reuses a stored run only when both are
    the same, so a change in the engine (or a new summary metric) never leaves a stale run in a table."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("kvsim")
    except PackageNotFoundError:
        v = "source"
    sim = Path(__file__).resolve().parents[1]
    return f"{v}+{code_digest(sim, sim.parent / 'traces')}"  # (the trace readers: a package beside sim/)


def code_digest(*packages: Path) -> str:
    """A digest of every ``.py`` file under the given package folders (names and bytes; a missing folder
    adds nothing)."""
    h = hashlib.sha256()
    for pkg in packages:
        for f in sorted(pkg.rglob("*.py")):
            h.update(f"{pkg.name}/{f.relative_to(pkg).as_posix()}".encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _file_stamp(path: Path) -> list:
    """What identifies an input file's contents: its absolute path, size, modification and change times, and a
    hash of its bytes (``userfile.file_digest``: a same-size rewrite that kept the modification time reused the
    old file's points; its change time moves, which no tool sets back)."""
    p = path.resolve()
    try:
        st = p.stat()
        return [str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, file_digest(p)]
    except OSError:
        return [str(p), None, None, None, None]


def resolved_mapping(scenario: Scenario) -> tuple[dict, list]:
    """The scenario as a mapping a worker anywhere can parse back to the same scenario: relative paths
    made absolute, a length preset kept by name (not also as its distributions), per-step records off
    (a sweep keeps summaries only). Also the stamps of the files it reads."""
    data = scenario.model_dump(mode="json", exclude={"cluster"} if scenario.cluster is None else None)  # keys as before fleets
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
    if data["model"] not in MODELS:  # a config.json, or a folder holding one
        path = scenario.resolve_path(data["model"]).resolve()
        data["model"] = str(path)
        files.append(_file_stamp(path / "config.json" if path.is_dir() else path))
    st = data.get("step_time")
    if isinstance(st, dict) and st.get("kind") == "profile":  # a calibration profile
        path = scenario.resolve_path(st["path"]).resolve()
        st["path"] = str(path)
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
