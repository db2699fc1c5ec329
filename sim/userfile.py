"""A file the user named, read whole: the one place that says what can go wrong with it (missing, a folder
or a device, unreadable, not UTF-8 text, not valid JSON), in one line naming the file. Scenario and sweep
files (YAML), model configs and step-time profiles (JSON) are read here; trace files, which are streamed,
have their own checks (``traces.formats``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def user_path(path: str | Path, what: str, error: type[Exception]) -> Path:
    """``path`` as a Path; an empty one is an error (``Path("")`` is ".", which read as the current folder:
    ".: not a regular file")."""
    if not str(path).strip():
        raise error(f"an empty path (expected a {what})")
    return Path(path)


def read_text(path: str | Path, what: str, error: type[Exception], hint: str = "") -> str:
    """The file's text (UTF-8; a byte-order mark dropped). ``what`` names the kind of file in the message
    (``scenario file``), ``hint`` follows a missing file's (`` (write one with sim calibrate)``); ``error``
    is the exception raised (the caller's user-error type)."""
    path = user_path(path, what, error)
    try:
        if path.exists() and not path.is_file():  # a folder, a FIFO (would block), a device
            raise error(f"{path}: not a regular file (expected a {what})")
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise error(f"{path}: no such {what}{hint}") from None
    except UnicodeDecodeError as e:  # binary content: where, as the trace reader says it (traces.formats.not_utf8)
        data = bytes(e.object)
        line, start = data.count(b"\n", 0, e.start) + 1, data.rfind(b"\n", 0, e.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {e.start - start + 1}; "
                    f"expected a {what})") from None
    except OSError as e:  # permission, a symlink loop
        raise error(f"{path}: cannot read as text ({e.__class__.__name__}: "
                    f"{getattr(e, 'strerror', None) or e.__class__.__name__})") from None


def read_json(path: str | Path, what: str, error: type[Exception], hint: str = "") -> Any:
    """The file's JSON value; as :func:`read_text`, and invalid JSON said with its line."""
    text = read_text(path, what, error, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except ValueError as e:  # a number of more than 4,300 digits (Python's limit on int conversion)
        raise error(f"{path}: cannot read a value ({str(e).split(';')[0]})") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply to read") from None


FULL_DIGEST_BYTES = 64 << 20  # files up to this size are hashed whole (about 40 ms); larger ones by samples


def file_digest(path: str | Path) -> str:
    """A hash of a file's bytes: what says an input file is unchanged (a trace's parsed copy, a sweep's
    stored points), since a same-size rewrite can keep the file's time (``cp -p``, ``touch -r``). About
    0.6 ms per MB. A file over ``FULL_DIGEST_BYTES`` is hashed by 16 evenly spaced MiB and its last one,
    with its size (a sweep asks once per task: a week-long trace of 580 MB would have cost a third of a
    second each); a rewrite elsewhere in it still moves its change time, which the callers keep beside the
    hash. Raises OSError as reading does."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size <= FULL_DIGEST_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            for k in range(16):
                f.seek(k * (size // 16))
                h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return h.hexdigest()
