"""Result folders, read back for a report: the tables ``sim run`` writes, and a sweep's tidy tables.

A run folder holds ``summary.json``, ``requests.parquet``, ``timeline.parquet`` and (when a step ran)
``kv_snapshots.parquet``; ``steps.parquet`` is not needed here (it can be large). A sweep folder holds
``sweep.parquet`` (one row per point x policy: scenario fields as columns, e.g. ``workload.arrival.rate``,
next to the summary metrics), optionally ``capacity.parquet`` (one row per policy: its sustainable
request rate) and ``sweep.json`` (what ``sim sweep`` swept: name, axes, SLO, failures). A folder may
hold a run and a sweep.

Several folders compare side by side: every policy is then labelled ``<folder name> / <policy>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from reports import ResultsError  # noqa: F401 (declared where the command line finds it cheaply)
from sim.schema import MEMORY_CLASSES, METRICS, PLAN_MARK, REASONS, RUN_MARK, STATUS_NAMES, SWEEP_MARK

RUN_FILES = (RUN_MARK, "requests.parquet", "timeline.parquet")
SNAPSHOT_FILE = "kv_snapshots.parquet"
GROUPS_FILE = "kv_groups.parquet"  # policies of several KV groups (sim/hybrid.py): slots per group over time
REPLICAS_FILE = "replicas.parquet"  # a fleet's policies (sim/cluster): one row per replica
SWEEP_FILE = "sweep.parquet"
CAPACITY_FILE = "capacity.parquet"
SWEEP_INFO_FILE = SWEEP_MARK


@dataclass(frozen=True)
class RunTables:
    """One result folder's tables, with policies already labelled for the page.

    ``policies`` has one row per policy (index: its label), the summary metrics as columns plus ``run``,
    ``policy`` (the name in the scenario), ``preset`` and the KV pool's geometry. The other tables carry
    the same labels in their ``policy`` column. A sweep-only folder has ``summary`` None and no run tables.
    """

    label: str
    path: Path
    summary: dict | None
    policies: pd.DataFrame
    requests: pd.DataFrame | None
    timeline: pd.DataFrame | None
    snapshots: pd.DataFrame | None
    sweep: pd.DataFrame | None
    capacity: pd.DataFrame | None
    sweep_info: dict | None = None  # sweep.json, when `sim sweep` wrote the folder
    groups: pd.DataFrame | None = None  # kv_groups.parquet, when some policy has several KV groups
    replicas: pd.DataFrame | None = None  # replicas.parquet, when the scenario is a fleet

    @property
    def scenario(self) -> dict:
        return (self.summary or {}).get("scenario", {})


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        first = str(e).splitlines()[0] if str(e) else ""
        why = first.split(". ")[0].rstrip(".") if len(first) > 120 else first  # a whole sentence, never cut
        raise ResultsError(f"{path}: cannot read as parquet ({e.__class__.__name__}: {why[:200]})") from None


def _read_json(path: Path) -> object:
    """A JSON file of a result folder; unreadable, malformed or nested too deeply to parse: ResultsError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: "[[[[...": json recurses per level)
        why = "nested too deeply to read" if isinstance(e, RecursionError) else e.__class__.__name__
        raise ResultsError(f"{path}: cannot read ({why})") from None


def _read_summary(path: Path) -> dict:
    summary = _read_json(path)
    if not isinstance(summary, dict) or not isinstance(summary.get("policies"), dict) or "scenario" not in summary:
        raise ResultsError(f"{path}: not a sim run summary (no 'scenario' and 'policies')")
    scenario = summary["scenario"]
    if not isinstance(scenario, dict):
        raise ResultsError(f"{path}: 'scenario' is not an object")
    if not summary["policies"]:
        raise ResultsError(f"{path}: 'policies' is empty (a run summary has one object of metrics per policy)")
    for key, kind in (("policies", list), ("resolved", dict)):  # what the page reads of the scenario
        if key in scenario and not isinstance(scenario[key], kind):
            raise ResultsError(f"{path}: scenario.{key} is not {'a list' if kind is list else 'an object'}")
    pools = scenario.get("resolved", {}).get("kv_pools", {})
    if not isinstance(pools, dict) or not all(isinstance(v, dict) for v in pools.values()):
        raise ResultsError(f"{path}: scenario.resolved.kv_pools is not an object of pools")
    for name, metrics in summary["policies"].items():
        if not isinstance(metrics, dict):
            raise ResultsError(f"{path}: policies.{name} is not an object of metrics")
        for key, v in metrics.items():  # a metric is a number or null; nested groups (memory, pool) are objects
            if isinstance(v, str) and key in TEXT_KEYS or v is None or isinstance(v, dict):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ResultsError(f"{path}: policies.{name}.{key} = {v!r:.80}, expected a number or null")
    _shaped(path, summary, {"decomposition": dict, "fleet": dict})
    lacks = [k for k in ("name", "model", "gpu", "policies") if k not in scenario]
    if lacks:  # (a page was drawn of no model on no GPU)
        raise ResultsError(f"{path}: 'scenario' lacks {', '.join(lacks)} (as sim run writes it)")
    return summary


TEXT_KEYS = {"preset", "policy", "name", "status", "allocator", "batching", "prefill", "preemption", "kind"}


# the named categories of a run's tables (sim.schema): a column of other values (codes, other names) was drawn
# as if no request had finished, or no slot were of any memory class
CATEGORY_COLUMNS = {"status": tuple(STATUS_NAMES.values()), "reason": tuple(REASONS.values()),
                    "memory_class": MEMORY_CLASSES}


def _categories(df: pd.DataFrame | None, where: Path) -> pd.DataFrame | None:
    """A run table (requests, kv_snapshots) whose category columns hold only the names sim run writes."""
    for column, names in CATEGORY_COLUMNS.items():
        if df is not None and column in df.columns:
            other = sorted(set(df[column].astype(str).unique()) - set(names))
            if other:
                raise ResultsError(f"{where}: column {column!r} holds {', '.join(map(repr, other[:3]))}; expected "
                                   f"one of {', '.join(repr(n) for n in names if n)}")
    return df


def _relabel(df: pd.DataFrame | None, labels: dict[str, str], where: Path) -> pd.DataFrame | None:
    """The table with its ``policy`` column mapped to page labels (plain strings)."""
    if df is None:
        return None
    if "policy" not in df.columns:
        raise ResultsError(f"{where}: no 'policy' column")
    out = df.copy()
    policy = out["policy"].astype(str)
    unknown = sorted(set(policy.unique()) - set(labels)) if labels else []
    if unknown:  # (drawn as a policy of its own, which no table of the page listed)
        raise ResultsError(f"{where}: rows of policy {', '.join(map(repr, unknown[:3]))}, which summary.json does not "
                           f"list (it has {', '.join(map(repr, list(labels)[:5]))})")
    out["policy"] = policy.map(lambda p: labels.get(p, p))
    return out


def _policy_table(summary: dict, labels: dict[str, str], run_label: str) -> pd.DataFrame:
    """One row per policy: its summary metrics, preset and KV pool (from summary.json)."""
    scenario = summary.get("scenario", {})
    presets = {p.get("name"): p.get("preset") for p in scenario.get("policies", []) if isinstance(p, dict)}
    pools = scenario.get("resolved", {}).get("kv_pools", {})
    rows = []
    for name, metrics in summary["policies"].items():
        pool = {f"pool.{k}": v for k, v in pools.get(name, {}).items()}
        rows.append({"label": labels[name], "run": run_label, "policy": name, "preset": presets.get(name),
                     **pool, **metrics})
    return pd.DataFrame(rows).set_index("label")


def load_run(path: str | Path, label: str | None = None) -> RunTables:
    """Read one result folder. With ``label``, policies are labelled ``<label> / <policy>``."""
    d = Path(path)
    if not d.is_dir():
        raise ResultsError(f"{d}: not a folder (give the result folder that `sim run` wrote)" if d.exists() else
                           f"{d}: no such result folder")
    if (d / PLAN_MARK).is_file():  # (was "not a result folder")
        raise ResultsError(f"{d}: a `sim plan` folder: its report is a page of its own (sim report {d}), not "
                           f"compared with other folders")
    has_run = (d / RUN_MARK).exists()
    sweep = _read_parquet(d / SWEEP_FILE) if (d / SWEEP_FILE).exists() else None
    capacity = _read_parquet(d / CAPACITY_FILE) if (d / CAPACITY_FILE).exists() else None
    if not has_run and sweep is None:
        raise ResultsError(f"{d}: not a result folder (no summary.json or {SWEEP_FILE}; write one with `sim run`)")
    missing = [f for f in RUN_FILES if not (d / f).exists()] if has_run else []
    if missing:
        raise ResultsError(f"{d}: incomplete run, missing {', '.join(missing)} (re-run `sim run` to write it)")
    run_label = label or d.resolve().name
    summary = _read_summary(d / RUN_MARK) if has_run else None
    names = list(summary["policies"]) if summary else []
    for table in (sweep, capacity):
        if table is not None and "policy" in table.columns:
            names += [str(p) for p in pd.unique(table["policy"].astype(str)) if str(p) not in names]
    labels = {n: (f"{label} / {n}" if label else n) for n in names}
    snapshots = _read_parquet(d / SNAPSHOT_FILE) if has_run and (d / SNAPSHOT_FILE).exists() else None
    groups = _read_parquet(d / GROUPS_FILE) if has_run and (d / GROUPS_FILE).exists() else None
    replicas = _read_parquet(d / REPLICAS_FILE) if has_run and (d / REPLICAS_FILE).exists() else None
    requests = _read_parquet(d / "requests.parquet") if has_run else None
    if summary:  # (each was drawn around without a word: a policy without its requests, address space, replicas)
        stepped = [n for n, p in summary["policies"].items() if (p.get("num_steps") or 0) > 0]
        _holds(d, "requests.parquet", requests, stepped)  # a step ran requests, whose rows the log holds
        _holds(d, SNAPSHOT_FILE, snapshots, stepped)  # a step captured its address space (sim.engine: the first)
        _holds(d, REPLICAS_FILE, replicas, list(summary.get("fleet") or {}))  # a fleet's rows per replica
    for table, file in ((sweep, SWEEP_FILE), (capacity, CAPACITY_FILE)):
        _numeric(table, d / file)
    sweep_info = None
    if sweep is not None and (d / SWEEP_INFO_FILE).exists():
        sweep_info = _read_json(d / SWEEP_INFO_FILE)
        if not isinstance(sweep_info, dict):  # (was drawn without the sweep's facts)
            raise ResultsError(f"{d / SWEEP_INFO_FILE}: not an object of the sweep's facts (as sim sweep writes it)")
        _shaped(d / SWEEP_INFO_FILE, sweep_info, {"axes": list, "failures": list, "capacity": dict})
    return RunTables(
        label=run_label, path=d, summary=summary,
        policies=_policy_table(summary, labels, run_label) if summary else pd.DataFrame(),
        requests=_relabel(_categories(requests, d / "requests.parquet"), labels,
                          d / "requests.parquet") if has_run else None,
        timeline=_relabel(_read_parquet(d / "timeline.parquet"), labels, d / "timeline.parquet") if has_run else None,
        snapshots=_relabel(_categories(snapshots, d / SNAPSHOT_FILE), labels, d / SNAPSHOT_FILE),
        sweep=_relabel(sweep, labels, d / SWEEP_FILE), capacity=_relabel(capacity, labels, d / CAPACITY_FILE),
        sweep_info=sweep_info,
        groups=_relabel(groups, labels, d / GROUPS_FILE), replicas=_relabel(replicas, labels, d / REPLICAS_FILE))


def _shaped(path: Path, data: dict, kinds: dict[str, type]) -> None:
    """Each of ``kinds``' keys that ``data`` gives (not null) is of its type and, a list, of objects (an
    AttributeError naming no key, and a message about "sim run" for a sweep's file)."""
    for key, kind in kinds.items():
        v = data.get(key)
        if v is not None and (not isinstance(v, kind) or (kind is list and not all(isinstance(x, dict) for x in v))):
            raise ResultsError(f"{path}: {key!r} is {v!r:.40}; expected {'a list of objects' if kind is list else 'an object'}")


def _holds(d: Path, file: str, table: pd.DataFrame | None, policies: list[str]) -> None:
    """``table`` (``d/file``) has rows of each of ``policies``, as sim run writes them."""
    held = set() if table is None or "policy" not in table.columns else set(table["policy"].astype(str))
    lost = [n for n in policies if n not in held]
    if lost:
        raise ResultsError(f"{d}: incomplete run, {file} " + ("is missing" if table is None else
                           f"has no rows of {', '.join(lost[:3])}") + " (re-run `sim run` to write it)")


def _numeric(table: pd.DataFrame | None, where: Path) -> None:
    """A sweep table's metric columns hold numbers (text was drawn as a category axis)."""
    for column in [] if table is None else [c for c in table.columns if c in METRICS]:
        if not pd.api.types.is_numeric_dtype(table[column]):
            raise ResultsError(f"{where}: column {column!r} holds {table[column].dtype} values; expected numbers")


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Labels for compared folders: their names, made unique with ``#2``, ``#3``... where they repeat."""
    labels: list[str] = []
    for p in paths:
        base = Path(p).resolve().name or str(p)
        label, k = base, 2
        while label in labels:
            label, k = f"{base}#{k}", k + 1
        labels.append(label)
    return labels


def load_runs(paths: Sequence[str | Path]) -> list[RunTables]:
    """Read one folder (policies keep their names) or several (policies labelled by folder)."""
    if not paths:
        raise ResultsError("no result folder given")
    ps = [Path(p) for p in paths]
    seen: dict[Path, Path] = {}
    for p in ps:  # (a folder compared with itself drew every chart twice)
        if p.resolve() in seen:
            raise ResultsError(f"{p}: given twice (as {seen[p.resolve()]}); compare different result folders")
        seen[p.resolve()] = p
    if len(ps) == 1:
        return [load_run(ps[0])]
    return [load_run(p, label) for p, label in zip(ps, run_labels(ps))]


def concat(tables: Sequence[pd.DataFrame | None]) -> pd.DataFrame | None:
    """The non-empty tables stacked (``policy`` labels are already unique across runs), or None."""
    present = [t for t in tables if t is not None and len(t)]
    return pd.concat(present, ignore_index=True) if present else None
