"""Trace formats: which column of a file holds which field of a request, and how to tell a format from
its header.

Every format reads into the canonical request table (``sim.workload.RequestTable``): arrival seconds
from the trace's start, prompt tokens, output tokens, and where the file has them, prefix-block hash ids
and session ids. A format is only a column mapping plus a few rules, so one reader (``traces.read``)
serves them all, and a generic table with a user's column mapping is one more ``TraceFormat``.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sim.config import ScenarioError, TraceColumns

Container = Literal["csv", "jsonl", "parquet"]
ArrivalUnit = Literal["s", "ms", "us", "datetime"]
SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class TraceFormat:
    """One trace format: its columns and rules.

    ``hash_ids`` and ``session_id`` are read when the file has them (a generic mapping requires every
    column it names). ``filters`` maps a workload key (``models``) to the column it selects on."""

    name: str
    arrival: str | None
    arrival_unit: ArrivalUnit
    prompt_tokens: str
    output_tokens: str
    hash_ids: str | None = None
    hash_block_size: int | None = None
    session_id: str | None = None
    rebase: bool = True  # arrivals from the first row's time (the canonical table is kept as written)
    zero_output_reason: str = "zero_output_tokens"  # drop reason of a row with 0 output tokens
    filters: dict[str, str] = field(default_factory=dict)
    extras_required: bool = False

    def required(self) -> list[str]:
        cols = [c for c in (self.arrival, self.prompt_tokens, self.output_tokens) if c is not None]
        if self.extras_required:
            cols += [c for c in (self.hash_ids, self.session_id) if c is not None]
        return cols

    def optional(self) -> list[str]:
        return [] if self.extras_required else [c for c in (self.hash_ids, self.session_id) if c is not None]

    def describe(self) -> str:
        return f"{self.name} ({','.join(self.required())})"


# NOTE: detection tries these in order and takes the first whose required columns the header has:
# vidur before lengths (vidur's header is lengths' plus arrived_at).
FORMATS: dict[str, TraceFormat] = {
    "azure": TraceFormat("azure", "TIMESTAMP", "datetime", "ContextTokens", "GeneratedTokens"),
    "burstgpt": TraceFormat("burstgpt", "Timestamp", "s", "Request tokens", "Response tokens",
                            zero_output_reason="failed_request", filters={"models": "Model", "log_types": "Log Type"}),
    "mooncake": TraceFormat("mooncake", "timestamp", "ms", "input_length", "output_length",
                            hash_ids="hash_ids", hash_block_size=512),
    "vidur": TraceFormat("vidur", "arrived_at", "s", "num_prefill_tokens", "num_decode_tokens"),
    "canonical": TraceFormat("canonical", "arrival_s", "s", "prompt_tokens", "output_tokens",
                             hash_ids="hash_ids", session_id="session_id", rebase=False),
    "lengths": TraceFormat("lengths", None, "s", "num_prefill_tokens", "num_decode_tokens"),
}


def generic_format(c: TraceColumns) -> TraceFormat:
    """A user's column mapping as a format."""
    return TraceFormat("generic", c.arrival, c.arrival_unit, c.prompt_tokens, c.output_tokens, c.hash_ids,
                       c.hash_block_size, c.session_id, extras_required=True)


# ---------------------------------------------------------------------------------------------- files


MAX_JSON_DEPTH = 64  # a trace's row nests two deep: an object, and a list of hash ids


def too_deep(line: str) -> bool:
    """Whether a JSON line nests deeper than ``MAX_JSON_DEPTH`` (brackets outside strings), checked before it
    is parsed. NOTE: json met its recursion limit deep in the stack, where any finalizer the garbage collector
    ran then failed too ("Exception ignored", and a test that failed or passed by the collector's timing)."""
    if line.count("[") + line.count("{") <= MAX_JSON_DEPTH:
        return False
    depth, quoted, escaped = 0, False, False
    for ch in line:
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def open_text(path: Path) -> io.TextIOBase:
    """The file as text, decompressed when it is gzip (told by its first bytes, not its name)."""
    # NOTE: utf-8-sig: a byte-order mark (as some Windows tools write) is dropped, not read into a column name
    return gzip.open(path, "rt", encoding="utf-8-sig") if is_gzip(path) else open(path, encoding="utf-8-sig")


def container_of(path: Path) -> Container:
    """parquet (magic bytes), JSONL (first character ``{``) or CSV."""
    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":
            return "parquet"
    if is_gzip(path):
        with gzip.open(path, "rb") as g:
            try:
                magic = g.read(4)
            except (OSError, EOFError, zlib.error):  # a damaged gzip: the text reader names it
                magic = b""
        if magic == b"PAR1":
            raise ScenarioError(f"{path}: gzip holding a parquet file; gzip is read for CSV and JSONL traces only: "
                                "decompress it (parquet compresses its own columns)")
    with open_text(path) as f:
        first = f.read(4096).lstrip()
    return "jsonl" if first.startswith(("{", "[")) else "csv"  # ([: a JSON array, which header() names)


def _unique(path: Path, names: list[str], where: str = "") -> list[str]:
    """Column names, each once: a repeated column would be read as whichever copy the reader keeps."""
    seen = set()
    for n in names:
        if n in seen:
            raise ScenarioError(f"{path}{where}: column {n!r} appears more than once; expected each column once")
        seen.add(n)
    return names


def header(path: Path, container: Container) -> list[str]:
    """Column names: a CSV's first line, a JSONL file's first object's keys, a parquet schema's names."""
    if container == "parquet":
        import pyarrow.parquet as pq

        return _unique(path, list(pq.read_schema(path).names))
    with open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if container == "csv":
                try:
                    return _unique(path, next(csv.reader([line])), f":{line_no}")
                except csv.Error as e:  # a field over the csv module's limit of 131,072 characters
                    raise ScenarioError(f"{path}:{line_no}: not a CSV header ({e}); expected a line naming the "
                                        "columns") from None
            if line.lstrip().startswith("["):  # (read as a CSV: "column ' "input_length": 5' appears more than once")
                raise ScenarioError(f"{path}:{line_no}: a JSON array; expected JSONL, one JSON object per line "
                                    "(jq -c '.[]' turns one into JSONL)")
            try:
                if too_deep(line):
                    raise RecursionError
                # NOTE: the first object's keys are the columns: a key given twice there is an error
                pairs = json.loads(line, object_pairs_hook=lambda kv: kv)
            except json.JSONDecodeError as e:
                raise ScenarioError(f"{path}:{line_no}: not valid JSON ({e.msg}); expected one JSON object "
                                    "per line") from None
            except RecursionError:
                raise ScenarioError(f"{path}:{line_no}: nested too deeply to read; expected one JSON object per "
                                    "line") from None
            if not isinstance(pairs, list) or not line.lstrip().startswith("{"):
                got = type(json.loads(line)).__name__
                raise ScenarioError(f"{path}:{line_no}: expected a JSON object per line, got {got}")
            return _unique(path, [k for k, _ in pairs], f":{line_no}")
    raise ScenarioError(f"{path}: empty file; expected a header line naming the columns")


def csv_fields(line: str) -> int:
    """How many fields a CSV line has, however long they are (the csv module refuses a field of more than
    131,072 characters, which pandas reads, and the reader then checks as a value)."""
    try:
        return len(next(csv.reader([line]), []))
    except csv.Error:
        limit = csv.field_size_limit(len(line) + 1)
        try:
            return len(next(csv.reader([line]), []))
        finally:
            csv.field_size_limit(limit)


def check_readable(path: Path) -> None:
    if not path.exists():
        raise ScenarioError(f"{path}: no such trace file")
    if not path.is_file():
        raise ScenarioError(f"{path}: not a file")
    if path.stat().st_size == 0:
        raise ScenarioError(f"{path}: empty file; expected a header line naming the columns")


@dataclass(frozen=True)
class TraceFile:
    """A trace file whose header fits its format."""

    path: Path
    container: Container
    fmt: TraceFormat
    names: tuple[str, ...]  # the file's columns

    @property
    def source(self) -> str:
        """What a table read from this file says it came from: ``path (format)``, the path as given."""
        return f"{self.path} ({self.fmt.name})"

    def where(self, line: int) -> str:
        """``path:line`` (CSV, JSONL) or ``path: row N`` (parquet)."""
        return f"{self.path}: row {line}" if self.container == "parquet" else f"{self.path}:{line}"


def not_utf8(path: Path) -> str:
    """Where a text trace stops being UTF-8: ``path:line: ...`` with the first such line and byte (a
    decoder's own message names a position in its buffer, not in the file)."""
    with (gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")) as f:
        for line_no, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path}:{line_no}: not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})"
    return f"{path}: not UTF-8 text"


def open_trace(path: Path, name: str = "auto", columns: TraceColumns | None = None) -> TraceFile:
    """The file's format (named, detected from the header, or a generic mapping) and container; raises
    :class:`ScenarioError` naming the missing columns when the header does not fit."""
    check_readable(path)
    container = None
    try:
        container = container_of(path)
        names = header(path, container)
    except ScenarioError:
        raise
    except UnicodeDecodeError:
        raise ScenarioError(not_utf8(path)) from None
    except (OSError, EOFError) as e:
        raise ScenarioError(f"{path}: cannot read ({e.__class__.__name__}: {e})") from None
    except Exception as e:  # pyarrow raises its own types for a damaged parquet file
        raise ScenarioError(f"{path}: cannot read as {container or 'a trace'} ({e.__class__.__name__}: {e})") from None
    if columns is not None:
        fmt = generic_format(columns)
    elif name != "auto":
        fmt = FORMATS[name]
    else:
        found = [f for f in FORMATS.values() if set(f.required()) <= set(names)]
        if not found:
            raise ScenarioError(f"{path}: cannot tell the trace format from its columns ({', '.join(names)}); "
                                f"expected one of: {'; '.join(f.describe() for f in FORMATS.values())}; "
                                "or give 'columns' for a generic table")
        fmt = found[0]
    missing = [c for c in fmt.required() if c not in names]
    if missing:
        where = f"{path}:1" if container == "csv" else str(path)
        raise ScenarioError(f"{where}: missing column(s) {', '.join(missing)}; format {fmt.describe()} "
                            f"(the file has {', '.join(names)})")
    if container == "csv" and fmt.hash_ids is not None and fmt.hash_ids in names:
        raise ScenarioError(f"{path}: column {fmt.hash_ids} holds lists of hash ids, which only JSONL or "
                            "parquet can carry")
    return TraceFile(path, container, fmt, tuple(names))
