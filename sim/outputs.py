"""Where results go: an output folder or file the user named, checked before any work is done, so that a
path that cannot be written is one clear error (naming it and why), not a traceback after the run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from sim.config import ScenarioError

# Writes a result folder's report.html from its files and returns its path (``reports.html.write_report``):
# the report is drawn above the simulator, so whoever writes results passes it in (the CLI, ``kvsim``).
ReportWriter = Callable[[Path], Path]


def out_dir(path: str | Path, what: str = "--out") -> Path:
    """An output folder that exists or can be created (nothing is created here: a run that stops on bad
    input leaves nothing behind); an existing file, or a place that cannot be written, is an error."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ScenarioError(f"{what} {p}: exists and is not a folder (give a folder for the results)")
    base = p
    while not base.exists():  # the nearest existing folder above must be a writable folder
        if base.parent == base:
            break
        base = base.parent
    if base.exists() and not base.is_dir():
        raise ScenarioError(f"{what} {p}: cannot create the folder ({base} is a file)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ScenarioError(f"{what} {p}: cannot create or write the folder ({base} is not writable)")
    return p


def out_file(path: str | Path, what: str = "--out") -> Path:
    """An output file: its folder must exist (or be creatable) and be writable; a folder is not a file."""
    p = Path(path)
    if p.is_dir():
        raise ScenarioError(f"{what} {p}: is a folder (give the name of a file to write)")
    out_dir(p.parent if str(p.parent) else ".", what=f"{what} {p}: its folder")
    if p.exists() and not os.access(p, os.W_OK):
        raise ScenarioError(f"{what} {p}: the file is not writable")
    return p


def write_parquet(df, path: str | Path) -> None:
    """``df.to_parquet(path, index=False)`` (the same schema, pandas metadata included, and the same
    values read back), with dictionary encoding only for the columns that gain from it: categoricals and
    text. NOTE: dictionary-encoding float and count columns, nearly all distinct, was half of writing a
    result table (requests.parquet of the Azure trace: 19 ms -> 7 ms) and made the file larger."""
    numeric = {c for c, t in df.dtypes.items() if t.kind in "iufb"}
    df.to_parquet(path, index=False, use_dictionary=[str(c) for c in df.columns if c not in numeric])
