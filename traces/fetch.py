"""``sim trace fetch``: download public traces from their publishers into a traces folder, checked.

Each file is streamed to a temporary file beside its destination while its SHA-256 is computed, then
checked against the catalog and moved into place in one rename: an interrupted or corrupted download
never leaves a file under the trace's name. A file already there is hashed instead of downloaded again.
Network failures (offline, a refused connection, an HTTP error) are user errors: one line, exit code 2.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sim import trace_paths
from sim.config import ScenarioError
from traces.catalog import CATALOG, GROUPS, PublicTrace

CHUNK = 1 << 16
TIMEOUT_S = 30


@dataclass
class Fetched:
    trace: PublicTrace
    path: Path
    sha256: str
    verified: bool  # False: the catalog has no checksum for this file
    downloaded: bool  # False: already there


def resolve_names(names: list[str]) -> list[PublicTrace]:
    """Catalog entries for names and group names (``tests``, ``all``), in order, each once."""
    out: dict[str, PublicTrace] = {}
    for name in names:
        if name in GROUPS:
            out.update((n, CATALOG[n]) for n in GROUPS[name])
        elif name in CATALOG:
            out[name] = CATALOG[name]
        else:
            raise ScenarioError(f"unknown trace {name!r}; expected one of {', '.join(CATALOG)} "
                                f"or a group ({', '.join(GROUPS)}); `sim trace fetch --list` describes them")
    return list(out.values())


def destination(explicit: str | Path | None) -> Path:
    """``--dir``, else ``$KVSIM_TRACES``, else ``../shared/traces`` beside the project, where runs look
    (``trace_paths.project_traces``)."""
    return trace_paths.trace_dirs(explicit)[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def url_of(trace: PublicTrace, mirror: str | None) -> str:
    """The publisher's URL, or ``MIRROR/FILE`` for a mirror with the traces folder's layout."""
    return f"{mirror.rstrip('/')}/{trace.file}" if mirror else trace.url


def _network_error(url: str, e: BaseException) -> ScenarioError:
    if isinstance(e, urllib.error.HTTPError):
        return ScenarioError(f"{url}: download failed (HTTP {e.code} {e.reason}); nothing was written")
    reason = getattr(e, "reason", e)
    why = f"{reason.__class__.__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
    # (a file: mirror's missing folder was "offline, or the host unreachable?")
    hint = "; offline, or the host unreachable?" if isinstance(e, urllib.error.URLError) and "://" in url \
        and not url.startswith("file:") else "."
    return ScenarioError(f"{url}: download failed ({why}){hint} Nothing was written")


def download(url: str, dest: Path, progress: Callable[[int, int | None], None] | None = None) -> tuple[str, str]:
    """Stream ``url`` into a temporary file beside ``dest``; return (temporary path, SHA-256). The caller
    renames or deletes it."""
    try:
        req = urllib.request.Request(url, headers={"User-Agent": "kvsim-trace-fetch"})
    except ValueError as e:
        raise ScenarioError(f"{url}: not a URL ({e})") from None
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]  # removed again on a failure
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # (mkstemp's 0600 made a shared traces folder's file unreadable to others)
    except OSError as e:
        raise ScenarioError(f"{dest.parent}: cannot write there ({e.strerror or e})") from None
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                    length = resp.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                    done = 0
                    while True:
                        block = resp.read(CHUNK)
                        if not block:
                            break
                        out.write(block)
                        h.update(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, total)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                raise _network_error(url, e) from None
            if total is not None and done != total:
                raise ScenarioError(f"{url}: the connection closed after {done:,} of {total:,} bytes; "
                                    "nothing was written (try again)")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        _remove_empty(made)
        raise
    return tmp, h.hexdigest()


def _remove_empty(dirs: list[Path]) -> None:
    """The folders a failed download made, innermost first, if nothing else was put in them."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def fetch(trace: PublicTrace, folder: Path, *, mirror: str | None = None, force: bool = False,
          progress: Callable[[int, int | None], None] | None = None) -> Fetched:
    """Make ``folder/trace.file`` the verified upstream file (downloaded unless already there)."""
    dest = folder / trace.file
    if dest.is_file() and not force:
        digest = sha256_of(dest)
        if trace.sha256 is not None and digest != trace.sha256:
            raise ScenarioError(f"{dest}: already there but its SHA-256 is {digest}, not the catalog's "
                                f"{trace.sha256}; remove it or give --force to download it again")
        return Fetched(trace, dest, digest, trace.sha256 is not None, downloaded=False)
    url = url_of(trace, mirror)
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
    tmp, digest = download(url, dest, progress)
    if trace.sha256 is not None and digest != trace.sha256:
        Path(tmp).unlink(missing_ok=True)
        _remove_empty(made)
        raise ScenarioError(f"{trace.name}: {url}: SHA-256 {digest} does not match the catalog's {trace.sha256}; "
                            "the download was deleted, nothing was written")
    os.replace(tmp, dest)  # atomic: the name appears only with the whole, checked file
    return Fetched(trace, dest, digest, trace.sha256 is not None, downloaded=True)


def catalog_lines(explicit: str | Path | None = None) -> list[str]:
    """``sim trace fetch --list``: each trace, its file, size, licence, citation, and whether it is found."""
    lines = []
    for t in CATALOG.values():
        found = trace_paths.find_trace(t.file, explicit)
        size = f"{t.size_bytes / 1e6:.1f} MB" if t.size_bytes else "size unknown"
        check = "SHA-256 known" if t.sha256 else "no checksum"
        lines.append(f"{t.name}: {t.file} ({size}, {check}), {t.license}; cite {t.cite}")
        lines.append(f"    from {t.source}" + (f"; here: {found}" if found else ""))
    for g, names in GROUPS.items():
        lines.append(f"group {g}: {', '.join(names) if g != 'all' else 'every trace above'}")
    lines.append(f"searched: {trace_paths.searched(explicit)}")
    return lines


def fetch_command(names: list[str], folder: str | Path | None, *, mirror: str | None = None, force: bool = False,
                  console=None) -> list[str]:
    """``sim trace fetch NAME...``: fetch each trace with a progress bar on ``console`` (a rich Console,
    stderr in the CLI); one line per trace: where it is, its SHA-256, whether it was verified."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    if not names:
        raise ScenarioError("name the traces to fetch (or a group: tests, all); `sim trace fetch --list` lists them")
    for flag, value in (("--dir", folder), ("--mirror", mirror)):  # (--dir "" wrote into the current folder,
        if value is not None and not str(value).strip():  # --mirror "" used the publisher's URL)
            raise ScenarioError(f"{flag}: an empty {'path' if flag == '--dir' else 'URL'}")
    traces = resolve_names(names)
    dest = destination(folder)
    lines = []
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
                  disable=console is None or not console.is_terminal) as bar:  # a bar in a terminal only
        for t in traces:
            task = bar.add_task(t.name, total=t.size_bytes)
            r = fetch(t, dest, mirror=mirror, force=force,
                      progress=lambda done, total, task=task: bar.update(task, completed=done, total=total))
            bar.remove_task(task)
            what = "downloaded" if r.downloaded else "already there"
            check = ("SHA-256 verified" if r.verified else
                     f"SHA-256 {r.sha256}: not verified (the catalog has no checksum for this file)")
            lines.append(f"{t.name}: {r.path} ({what}, {r.path.stat().st_size:,} bytes; {check}); "
                         f"{t.license}, cite {t.cite}")
    if dest not in trace_paths.trace_dirs()[-2:]:  # neither $KVSIM_TRACES nor ../shared/traces
        lines.append(f"scenarios (path: traces:FILE) and tests find these with {trace_paths.ENV}={dest}")
    return lines
