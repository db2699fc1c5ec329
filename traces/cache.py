"""Parsed traces, kept on disk: a trace read once is read again from a numpy file in milliseconds, without
parsing its text (nor importing pandas, which the readers use).

An entry is the canonical request table that ``traces.read.read_trace`` returned, before the workload's
transforms (which are cheap, seeded and run every time). It is found again only for the same file, unchanged
(resolved path, size, modification and change times, inode, and a hash of its bytes: a rewrite that keeps
the size and the modification time, as ``cp -p`` or ``touch -r`` leave it, is a changed file, by its change
time, which no tool sets back, and by its hash; a link finds it, and the table names the
path this run gave), read the same way (format, columns, ``bad_rows``, filters), by the same reader code (a hash of
``traces/read.py`` and ``traces/formats.py``). A file that fails to read is never cached: its error is
raised every time. One entry per file and way of reading (a changed file
replaces its entry), in ``$KVSIM_TRACE_CACHE`` (0, false, off or no turn the cache off; 1, true, on, yes or
nothing mean the default, ``$XDG_CACHE_HOME/kvsim/traces``; anything else is the folder). An entry that cannot be read or written is ignored: the file is parsed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np

from sim.trace_paths import switch, user_cache
from sim.userfile import file_digest
from sim.workload import PrefixHashes, RequestTable
from traces.formats import TraceFile

_HERE = Path(__file__).resolve().parent
VERSION = 1  # the entry layout below


def cache_dir() -> Path | None:
    """Where entries go; None when ``KVSIM_TRACE_CACHE`` is off (0, false, off, no: ``trace_paths.switch``; only
    "0" was, and "false" made a cache folder named false)."""
    where = switch("KVSIM_TRACE_CACHE")
    if where == "off":
        return None
    if where != "on":
        return Path(where)
    try:
        return user_cache("traces")
    except RuntimeError:  # no home directory to find: no cache
        return None


def _code_hash() -> str:
    h = hashlib.sha256()
    for name in ("read.py", "formats.py"):
        h.update((_HERE / name).read_bytes())
    return h.hexdigest()


def _keys(tf: TraceFile, how: dict) -> tuple[str, str]:
    """(the entry's file name: which file and way of reading; its key: that and the file's state)."""
    path = tf.path.resolve()
    st = path.stat()
    which = json.dumps({"path": str(path), "fmt": repr(tf.fmt), "container": tf.container, "names": tf.names,
                        **how}, sort_keys=True)
    state = json.dumps({"which": which, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                        "device": st.st_dev, "ctime_ns": st.st_ctime_ns, "content": file_digest(path), "code": _code_hash(), "version": VERSION},
                       sort_keys=True)
    return hashlib.sha256(which.encode()).hexdigest()[:32], hashlib.sha256(state.encode()).hexdigest()


def cached(tf: TraceFile, how: dict, read: Callable[[], RequestTable]) -> RequestTable:
    """``read()``'s table for trace ``tf`` read as ``how`` says, from the cache when it holds it (else
    read, then kept)."""
    folder = cache_dir()
    if folder is None:
        return read()
    try:
        name, key = _keys(tf, how)
    except OSError:
        return read()
    entry = folder / f"{name}.npz"
    table = _load(entry, key, tf.source)
    if table is None:
        table = read()
        _save(entry, key, table)
    return table


def _load(entry: Path, key: str, source: str) -> RequestTable | None:
    """The entry's table, as read through ``source`` (the entry is keyed on the resolved path: a link or
    another spelling of the same file finds it, and its table names the path this run gave)."""
    try:
        with np.load(entry, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta["key"] != key:
                return None
            hashes = (PrefixHashes(z["hash_ids"], z["hash_offsets"], meta["hash_block_size"])
                      if "hash_ids" in z else None)
            return RequestTable(z["arrival_s"], z["prompt_tokens"], z["output_tokens"], source=source,
                                dropped=meta["dropped"], prefix_hashes=hashes,
                                session_id=z["session_id"] if "session_id" in z else None,
                                truncated=meta["truncated"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError):  # none yet, or unreadable: parse
        return None


def _save(entry: Path, key: str, t: RequestTable) -> None:
    if t.session_id is not None and t.session_id.dtype.kind == "O":  # (the reader gives text: not expected)
        return
    arrays = {"arrival_s": t.arrival_s, "prompt_tokens": t.prompt_tokens, "output_tokens": t.output_tokens}
    meta = {"key": key, "source": t.source, "dropped": t.dropped, "truncated": t.truncated}
    if t.prefix_hashes is not None:
        arrays.update(hash_ids=t.prefix_hashes.ids, hash_offsets=t.prefix_hashes.offsets)
        meta["hash_block_size"] = t.prefix_hashes.block_size
    if t.session_id is not None:
        arrays["session_id"] = t.session_id
    tmp = entry.with_name(f"{entry.stem}.{os.getpid()}.tmp.npz")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, entry)  # whole or not at all: a reader never sees half an entry
    except OSError:  # a cache that cannot be written: the next run parses again
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # (no folder to hold it at all)
            pass
