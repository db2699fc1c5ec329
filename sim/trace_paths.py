"""Where real traces are found: one search order for scenarios, tests, benchmarks and the device check.

A trace is named by its path inside a traces folder (``azure_2023/AzureLLMInferenceTrace_conv.csv``, the
layout ``sim trace fetch`` writes). The folders searched, in order:

1. a folder given explicitly (``--dir``, or the tests' ``--traces-dir``);
2. ``$KVSIM_TRACES``;
3. ``../shared/traces`` beside the project's root (where this repository keeps its copy): the source
   checkout's root when kvsim runs from one (``pip install -e``), else the current folder's (``pip
   install .`` puts the package in site-packages; the README's commands run in the project's folder).

In a scenario, ``path: traces:azure_2023/AzureLLMInferenceTrace_conv.csv`` names a trace this way (any
other path is relative to the scenario's file). Only paths here: the catalog of public traces and the
download live in ``traces.catalog`` and ``traces.fetch``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "KVSIM_TRACES"
PREFIX = "traces:"  # a scenario's trace path searched in the traces folders
ROOT = Path(__file__).resolve().parents[1]  # the project's root (in a source checkout)


def project_traces() -> Path:
    """``../shared/traces`` beside the project: the source checkout's, else the current folder's (an
    installed package's folder is site-packages: the traces were looked for inside the venv)."""
    root = ROOT if (ROOT / "pyproject.toml").is_file() else Path.cwd()
    return root.parent / "shared" / "traces"


# An environment switch (KVSIM_NATIVE, KVSIM_TRACE_CACHE) is off for these values, any case, spaces around
OFF, ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes")


def switch(name: str) -> str:
    """``$name`` as a switch reads it: "off" (one of ``OFF``), "on" (unset, empty or one of ``ON``), else the
    value itself (stripped), for the caller to read (a folder) or refuse."""
    v = os.environ.get(name, "").strip()
    return "off" if v.lower() in OFF else "on" if not v or v.lower() in ON else v


def user_cache(name: str) -> Path:
    """kvsim's cache folder ``name`` (the compiled build's ``native``, parsed traces' ``traces``):
    ``$XDG_CACHE_HOME/kvsim/<name>``, ``~/.cache`` when unset. Raises RuntimeError when there is no home
    directory to find."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvsim" / name


def trace_dirs(explicit: str | Path | None = None) -> list[Path]:
    """The folders searched, in order (an unset or empty ``$KVSIM_TRACES`` is left out)."""
    dirs = [Path(explicit).expanduser()] if explicit else []
    env = os.environ.get(ENV, "").strip()
    if env:
        dirs.append(Path(env).expanduser())
    dirs.append(project_traces())
    return dirs


def find_trace(rel: str | Path, explicit: str | Path | None = None) -> Path | None:
    """The first existing ``DIR/rel`` in the search order, or None."""
    for d in trace_dirs(explicit):
        if (d / rel).is_file():
            return d / rel
    return None


def locate(rel: str | Path, explicit: str | Path | None = None) -> Path:
    """``find_trace``, or where the first folder would hold it (for a message naming the file)."""
    return find_trace(rel, explicit) or trace_dirs(explicit)[0] / rel


def inside(rel: str) -> str:
    """``rel`` of ``traces:REL``, which must name a file inside the traces folders: ValueError for an absolute
    path or one with '..' (``traces:../../etc/passwd`` read outside them)."""
    if Path(rel).is_absolute() or ".." in rel.replace("\\", "/").split("/"):
        raise ValueError(f"{PREFIX}REL names a file inside the traces folders; {rel!r} leads out of them (an "
                         f"absolute path, or '..'): give the path without {PREFIX}")
    return rel


def named(p: str | Path) -> Path:
    """A trace named on the command line: ``traces:REL`` is looked for in the traces folders, as in a
    scenario (``locate``); any other path is taken as given. Raises ValueError as ``inside``."""
    s = str(p)
    return locate(inside(s[len(PREFIX):])) if s.startswith(PREFIX) else Path(p)


def searched(explicit: str | Path | None = None) -> str:
    """The search order in words, for a 'not found' message."""
    env = os.environ.get(ENV, "").strip()
    parts = [str(explicit)] if explicit else []
    parts.append(f"${ENV} ({env})" if env else f"${ENV} (unset)")
    parts.append(str(project_traces()))
    return ", ".join(parts)
