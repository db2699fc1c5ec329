"""Where results go: an output folder or file the user named, checked before any work is done, so that a
path that cannot be written is one clear error (naming it and why), not a traceback after the run."""

from __future__ import annotations

import os
from pathlib import Path

from sim.config import ScenarioError


def _why(e: OSError) -> str:
    return e.strerror or e.__class__.__name__


def out_dir(path: str | Path, what: str = "--out") -> Path:
    """An output folder: created if missing; an existing file, or a place that cannot be written, is an error."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ScenarioError(f"{what} {p}: exists and is not a folder (give a folder for the results)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScenarioError(f"{what} {p}: cannot create the folder ({_why(e)})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ScenarioError(f"{what} {p}: the folder is not writable")
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
