"""Where results go: an output folder or file the user named, checked before any work is done, so that a
path that cannot be written is one clear error (naming it and why), not a traceback after the run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from sim.config import ScenarioError
from sim.schema import FOLDER_MARKS

# Writes a result folder's report.html from its files and returns its path (``reports.html.write_report``):
# the report is drawn above the simulator, so whoever writes results passes it in (the CLI, ``kvsim``).
ReportWriter = Callable[[Path], Path]


MAX_NEW_FOLDERS = 100  # folders an output path may create, one inside the other


def out_dir(path: str | Path, what: str = "--out") -> Path:
    """An output folder that exists or can be created (nothing is created here: a run that stops on bad
    input leaves nothing behind); an existing file, or a place that cannot be written, is an error. An empty
    path (an unset shell variable: ``--out "$OUT"``) is an error, not the current folder."""
    if not str(path).strip():
        raise ScenarioError(f"{what}: an empty path (give a folder for the results)")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ScenarioError(f"{what} {p}: exists and is not a folder (give a folder for the results)")
    base, missing = p, 0
    while not base.exists():  # the nearest existing folder above must be a writable folder
        if base.parent == base:
            break
        base, missing = base.parent, missing + 1
    if missing > MAX_NEW_FOLDERS:  # (pathlib's mkdir recurses once per folder: a RecursionError at about 1,000)
        raise ScenarioError(f"{what} {p}: {missing:,} nested folders to create; expected at most {MAX_NEW_FOLDERS}")
    if base.exists() and not base.is_dir():
        raise ScenarioError(f"{what} {p}: cannot create the folder ({base} is a file)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ScenarioError(f"{what} {p}: cannot create or write the folder ({base} is not writable)")
    return p


def claim(out: Path, kind: str, name: str, default: bool = False) -> Path:
    """``out``, refused when it holds another command's results (``FOLDER_MARKS``): a plan written over a run's
    folder left the run's files beside it, and the report drew the stale one as this one. A folder of the same
    kind is rewritten (a run) or resumed (a sweep, a plan), as before; and a run and a sweep of the same
    ``name`` share one (a paper setup's scenario and its sweep: the page draws both), a run and a sweep of
    different names do not. ``default``: ``out`` is the command's default folder (no --out was given); there a
    folder of the same kind is this name's only (names made safe as folder names can meet: ``default_out``)."""
    for other, mark in FOLDER_MARKS.items():
        if other == kind or not (out / mark).is_file():
            continue
        if {kind, other} == {"run", "sweep"} and _named(out / mark, other) == name:
            continue
        named = " of another name" if {kind, other} == {"run", "sweep"} else ""
        raise ScenarioError(f"{out}{' (the default folder of this name)' if default else ''}: holds the results of a "
                            f"`sim {other}`{named} ({mark}); writing a {kind}'s there would mix the two: give "
                            f"another folder (--out), or remove that one")
    mine = out / FOLDER_MARKS[kind]
    held = _named(mine, kind) if default and mine.is_file() else None
    if held is not None and held != name:  # two names that make one folder name ("x/y", "x y"): one replaced the other
        raise ScenarioError(f"{out} (the default folder of this name): holds the results of {held!r}, another name "
                            f"that makes the same folder name; writing {name!r}'s there would replace them: give "
                            f"another folder (--out), or remove that one")
    return out


def _named(mark: Path, kind: str) -> str | None:
    """The name a folder's mark gives: a run's summary.json (its scenario's), validation.json (its scenario's
    name), a sweep's or a plan's own; None if unreadable."""
    try:
        data = json.loads(mark.read_text(encoding="utf-8"))
        name = data["scenario"] if kind == "validate" else data["scenario"]["name"] if kind == "run" else data["name"]
        return str(name)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def out_file(path: str | Path, what: str = "--out") -> Path:
    """An output file: its folder must exist (or be creatable) and be writable; a folder is not a file."""
    if not str(path).strip():
        raise ScenarioError(f"{what}: an empty path (give the name of a file to write)")
    p = Path(path)
    if p.is_dir():
        raise ScenarioError(f"{what} {p}: is a folder (give the name of a file to write)")
    out_dir(p.parent if str(p.parent) else ".", what=f"{what} {p}: its folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise ScenarioError(f"{what} {p}: the file is not writable")
    return p


class Columns:
    """A result table as numpy columns, in order; a categorical column is its integer codes here, with its
    ``categories``. A run's tables stay in this form until someone asks for a DataFrame (``frame``): a
    ``sim run`` that only writes its files never imports pandas (a quarter of a second)."""

    def __init__(self, data: dict[str, np.ndarray], categories: dict[str, list[str]] | None = None) -> None:
        self.data = data
        self.categories = categories or {}

    @classmethod
    def of(cls, table) -> "Columns":
        """``table`` as columns: a DataFrame's (its categoricals as codes), or a ``Columns`` as it is."""
        if isinstance(table, Columns):
            return table
        data, cats = {}, {}
        for name, col in table.items():
            if isinstance(col.dtype, _pandas().CategoricalDtype):
                data[name], cats[name] = col.cat.codes.to_numpy(), list(col.cat.categories)
            else:
                data[name] = col.to_numpy()
        return cls(data, cats)

    def __len__(self) -> int:
        return len(next(iter(self.data.values()))) if self.data else 0

    def __getitem__(self, name: str) -> np.ndarray:
        return self.data[name]

    def take(self, rows: np.ndarray) -> "Columns":
        """Rows ``rows`` of the table (numpy indexing: a fleet's replica's requests)."""
        return Columns({k: v[rows] for k, v in self.data.items()}, self.categories)

    def codes(self, name: str, category: str) -> int:
        """The code of ``category`` in categorical column ``name``."""
        return self.categories[name].index(category)

    def frame(self):
        """The table as a pandas DataFrame (the columns uncopied; categoricals as ``pd.Categorical``)."""
        pd = _pandas()
        return pd.DataFrame({k: pd.Categorical.from_codes(v, pd.Index(self.categories[k], dtype="str"))
                             if k in self.categories else v for k, v in self.data.items()}, copy=False)


def _pandas():
    import pandas as pd

    return pd


def concat_columns(parts: list[Columns], key: str, codes: np.ndarray, names: list[str], first: bool) -> Columns:
    """Tables laid end to end (the same columns and categories), with a categorical column ``key`` (its
    ``codes`` over ``names``), first or last."""
    data = {k: np.concatenate([p.data[k] for p in parts]) for k in parts[0].data}
    cats = {**parts[0].categories, key: list(names)}
    return Columns({key: codes, **data} if first else {**data, key: codes}, cats)


def write_parquet(table, path: str | Path) -> None:
    """A result table as parquet, read back by ``pd.read_parquet`` as the same DataFrame (categoricals
    as categoricals, no index column). A DataFrame is written by pandas (its metadata included); a
    ``Columns`` by pyarrow alone, so that writing a run's files does not import pandas. Dictionary
    encoding only for the columns that gain from it, categoricals and text. NOTE: dictionary-encoding
    float and count columns, nearly all distinct, was half of writing a result table (requests.parquet of
    the Azure trace: 19 ms -> 7 ms) and made the file larger."""
    if not isinstance(table, Columns):
        numeric = {c for c, t in table.dtypes.items() if t.kind in "iufb"}
        table.to_parquet(path, index=False, use_dictionary=[str(c) for c in table.columns if c not in numeric])
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {k: _dictionary(v, table.categories[k]) if k in table.categories else _arrow(v) for k, v in table.data.items()}
    pq.write_table(pa.table(arrays), path, use_dictionary=[k for k in table.categories])


# NOTE: pyarrow's ``pa.array`` imports pandas on every call (to ask whether its input is a pandas
# object); these build the same arrays from the numpy buffers, which does not.

def _arrow(v: np.ndarray):
    """A numeric (or bool) numpy column as an Arrow array; NaN as null, as ``DataFrame.to_parquet`` writes it."""
    import pyarrow as pa

    v = np.ascontiguousarray(v)
    if v.dtype == np.bool_:
        return pa.Array.from_buffers(pa.bool_(), len(v), [None, pa.py_buffer(np.packbits(v, bitorder="little"))])
    valid = None
    if v.dtype.kind == "f":
        nan = np.isnan(v)
        if nan.any():
            valid = pa.py_buffer(np.packbits(~nan, bitorder="little"))
    return pa.Array.from_buffers(pa.from_numpy_dtype(v.dtype), len(v), [valid, pa.py_buffer(v)])


def _dictionary(codes: np.ndarray, categories: list[str]):
    """A categorical column (codes, categories) as an Arrow dictionary array, its codes as pandas keeps
    them (the narrowest integer that holds them)."""
    import pyarrow as pa

    text = [c.encode() for c in categories]
    offsets = np.zeros(len(text) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in text], out=offsets[1:])
    values = pa.Array.from_buffers(pa.large_string(), len(text),
                                   [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(text))])
    return pa.DictionaryArray.from_arrays(_arrow(codes.astype(np.int8 if len(categories) < 128 else np.int32)), values)


def write_result_table(df, path: str | Path) -> None:
    """A sweep's or a plan's table (sweep.parquet, capacity.parquet, capacity_runs.parquet, plan.parquet)
    as parquet with every declared result column of its declared Arrow type
    (``sim.schema.RESULT_COLUMN_TYPES``), whatever its rows hold: a metric that no row has is a column of
    float64 nulls, not of Arrow's ``null`` type, so that the tables of two sweeps read (and concatenate)
    alike. The other columns (the swept scenario fields) keep the type pandas gives their values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sim.schema import RESULT_COLUMN_TYPES

    for c in df.columns:  # a swept field whose values mix kinds (a count, a list of groups): all as JSON text
        if df[c].dtype == object and c not in RESULT_COLUMN_TYPES:
            kinds = {type(v) for v in df[c] if v is not None and v == v}
            if len(kinds) > 1:
                df = df.assign(**{c: [v if v is None or v != v or isinstance(v, str)
                                      else json.dumps(v.item() if hasattr(v, "item") else v) for v in df[c]]})
    schema = pa.Schema.from_pandas(df, preserve_index=False)
    for i, name in enumerate(schema.names):
        declared = RESULT_COLUMN_TYPES.get(name)
        if declared is not None:
            schema = schema.set(i, pa.field(name, pa.type_for_alias(declared)))
    pq.write_table(pa.Table.from_pandas(df, schema=schema, preserve_index=False), path)
