"""Reading a trace file into the canonical request table, in chunks, and writing that table.

Memory stays bounded by the chunk size plus the result: a chunk of ``chunk_rows`` rows is read, checked
and reduced to three numeric arrays (plus hash ids and session ids where the file has them) before the
next is read. A 16.8M-row Azure file needs about 0.4 GB for its result (``benchmarks/bench_traces.py``).

Every row ends as a request or as a count in ``RequestTable.dropped`` (rows in = requests + dropped):

- structural problems (missing column, empty file, arrivals out of order) stop with an error;
- a bad value (empty, not a number, negative, fractional tokens, unreadable timestamp, an arrival more
  than ``MAX_SECONDS`` after the trace's start, invalid JSON, malformed hash ids, more hash ids than the
  prompt has blocks, a session id that is a list or a mapping) stops with an error naming file, line, column and what was expected, or with
  ``bad_rows="drop"`` is dropped and counted by reason;
- a CSV line with more fields than the header stops with an error naming the line, or with
  ``bad_rows="drop"`` is dropped and counted (``too_many_fields``);
- always dropped and counted: blank lines, rows that a filter (``models``, ``log_types``) leaves out,
  rows with 0 prompt tokens or 0 output tokens (BurstGPT's failed requests).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from sim.config import MAX_HASH_BLOCK_SIZE, MAX_SECONDS, MAX_TOKENS, ScenarioError  # (above MAX_TOKENS: no request)
from sim.workload import PrefixHashes, RequestTable
from traces.formats import (SECONDS_PER_UNIT, TraceFile, TraceFormat, csv_fields, is_gzip, not_utf8, open_text,
                            too_deep)

CHUNK_ROWS = 1 << 20
BLOCK_SIZE_KEY = b"kvsim.hash_block_size"  # parquet metadata of the canonical table

# Row problems: code -> reason counted in RequestTable.dropped (code 0: none).
PROBLEMS = ("", "missing_value", "not_a_number", "negative_value", "not_an_integer", "unreadable_timestamp",
            "bad_hash_ids", "too_large", "too_many_hash_ids", "bad_session_id")
MISSING, NOT_A_NUMBER, NEGATIVE, NOT_INTEGER, BAD_TIME, BAD_HASHES, TOO_LARGE, TOO_MANY_HASHES, BAD_SESSION = range(1, 10)
BAD_ROWS_HINT = " (or set bad_rows: drop to skip such rows)"


@dataclass(frozen=True)
class JsonConstant:
    """NaN, Infinity or -Infinity in a JSON line (Python reads them; JSON has no such values), kept as
    written: read as a float, a NaN would pass for an empty value."""

    text: str

    def __str__(self) -> str:
        return self.text

    def __float__(self) -> float:
        return float(self.text)


@dataclass
class Chunk:
    frame: pd.DataFrame  # the columns to read, as found in the file
    lines: np.ndarray  # 1-based line (CSV, JSONL) or row (parquet) of each row


# ---------------------------------------------------------------------------------------------- chunks


def _first_rows(tf: TraceFile) -> tuple[int, list[tuple[int, int]]]:
    """(the header's line, (line, fields) of each data line right after it with more fields than the
    header): a CSV may start with blank lines."""
    with open_text(tf.path) as f:
        for head, line in enumerate(f, 1):
            if line.strip():
                break
        else:
            return 1, []
        long = []
        for line_no, line in enumerate(f, head + 1):
            n = csv_fields(line)
            if n <= len(tf.names):
                break
            long.append((line_no, n))
    return head, long


def _csv_chunks(tf: TraceFile, columns: list[str], text_columns: list[str], chunk_rows: int,
                rows: "_Collector") -> Iterator[Chunk]:
    """With ``bad_rows: drop``, a line with more fields than the header is dropped and counted
    (``too_many_fields``), and bytes that are not UTF-8 read as U+FFFD, so that their row fails its checks
    and is dropped and counted; else each is an error naming the line."""
    drop = rows.bad_rows == "drop"
    head, long = _first_rows(tf)
    skipped: list[int] = []  # lines with too many fields, in file order
    for line_no, n in long:
        # NOTE: pandas reads the first data row with more fields than the header as an index column, or
        # with index_col=False silently cuts it (and the next, once that one is skipped); later ones it reports
        rows.bad_line(f"{tf.path}:{line_no}", "too_many_fields", f"{n} fields, expected {len(tf.names)} as in the header")
        skipped.append(line_no)
    # NOTE: skip_blank_lines=False keeps one row per line: a row's line is its index + head + 1, plus the
    # lines skipped before it
    try:
        with pd.read_csv(tf.path, dtype={c: str for c in text_columns}, chunksize=chunk_rows,
                         skip_blank_lines=False, keep_default_na=False, na_values=[""], index_col=False,
                         header=head - 1, skiprows=[n - 1 for n in skipped] or None,
                         on_bad_lines="warn" if drop else "error",
                         compression="gzip" if is_gzip(tf.path) else None, encoding="utf-8-sig",
                         encoding_errors="replace" if drop else "strict") as reader:
            while True:
                with warnings.catch_warnings(record=True) as caught:  # "Skipping line 7: expected 3 fields, saw 4"
                    warnings.simplefilter("always", pd.errors.ParserWarning)
                    frame = next(reader, None)  # NOTE: every column is read, so that pandas checks each row's field count
                for w in caught:
                    found = re.findall(r"Skipping line (\d+)", str(w.message))
                    for n in found:
                        skipped.append(int(n))
                        rows.count("too_many_fields")
                    if not found:  # any other warning, as it would have been shown
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                if frame is None:
                    break
                ids = frame.index.to_numpy() + head + 1
                if skipped:  # the k-th skipped line s has s - 1 - k lines that are rows or the header before it
                    gaps = np.array(skipped) - np.arange(len(skipped))
                    ids = ids + np.searchsorted(gaps, ids, side="right")
                yield Chunk(frame[columns], ids)
    except pd.errors.ParserError as e:  # "Expected 3 fields in line 7, saw 4": pandas names the line
        why = str(e).strip().removeprefix("Error tokenizing data. C error: ")
        raise ScenarioError(f"{tf.path}: not a valid CSV ({why}){BAD_ROWS_HINT}") from None
    except UnicodeDecodeError:
        raise ScenarioError(not_utf8(tf.path) + BAD_ROWS_HINT) from None
    except (OSError, EOFError) as e:
        raise ScenarioError(f"{tf.path}: cannot read ({e.__class__.__name__}: {e})") from None


def _jsonl_chunks(tf: TraceFile, columns: list[str], chunk_rows: int, rows: "_Collector") -> Iterator[Chunk]:
    records: list[dict] = []
    lines: list[int] = []
    try:
        with open_text(tf.path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    rows.count("blank_line")
                    continue
                try:
                    if too_deep(line):
                        raise RecursionError
                    obj = json.loads(line, parse_constant=JsonConstant)
                    problem = None if isinstance(obj, dict) else f"expected a JSON object, got {type(obj).__name__}"
                except json.JSONDecodeError as e:
                    problem = f"not valid JSON ({e.msg}), expected one JSON object per line"
                except RecursionError:
                    problem = "nested too deeply to read, expected one JSON object per line"
                if problem is not None:
                    rows.bad_line(tf.where(line_no), "invalid_json", problem)
                    continue
                records.append(obj)
                lines.append(line_no)
                if len(records) == chunk_rows:
                    yield Chunk(pd.DataFrame.from_records(records, columns=columns), np.array(lines))
                    records, lines = [], []
    except UnicodeDecodeError:  # (bad_rows: drop cannot skip it: the line cannot be read as text at all)
        raise ScenarioError(not_utf8(tf.path)) from None
    except (OSError, EOFError) as e:
        raise ScenarioError(f"{tf.path}: cannot read ({e.__class__.__name__}: {e})") from None
    if records:
        yield Chunk(pd.DataFrame.from_records(records, columns=columns), np.array(lines))


def _parquet_chunks(tf: TraceFile, columns: list[str], chunk_rows: int) -> Iterator[Chunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # NOTE: floats as Arrow-backed columns, where an empty cell (null) is not a NaN; numpy's has only NaN
    def floats(t: pa.DataType) -> pd.ArrowDtype | None:
        return pd.ArrowDtype(t) if pa.types.is_floating(t) else None

    done = 0
    try:
        for batch in pq.ParquetFile(tf.path).iter_batches(batch_size=chunk_rows, columns=columns):
            yield Chunk(batch.to_pandas(types_mapper=floats), np.arange(done + 1, done + batch.num_rows + 1))
            done += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise ScenarioError(f"{tf.path}: cannot read as parquet ({e.__class__.__name__}: {e})") from None


# ---------------------------------------------------------------------------------------------- values


def _to_float(v: Any) -> float:
    """A JSON scalar as a float; anything else (a list, an object, true) is not a number."""
    if isinstance(v, (int, float, str)) and not isinstance(v, bool):
        try:
            return float(v)
        except ValueError:
            pass
    return np.nan


def _numbers(col: pd.Series, integer: bool) -> tuple[np.ndarray, np.ndarray]:
    """(values as float64, problem code per row): empty, not a number (true/false included), negative,
    not an integer, or (token counts) above MAX_TOKENS."""
    if col.dtype.kind == "b":  # a boolean column (parquet, JSON): not counts
        codes = np.full(len(col), NOT_A_NUMBER, dtype=np.int8)
        codes[col.isna().to_numpy()] = MISSING
        return np.full(len(col), np.nan), codes
    if col.dtype.kind in "iuf":
        values = col.to_numpy(dtype=np.float64, na_value=np.nan)
    else:
        try:
            values = pd.to_numeric(col, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        except TypeError:  # JSON values that are lists or objects
            values = np.fromiter((_to_float(v) for v in col), dtype=np.float64, count=len(col))
    codes = np.zeros(len(col), dtype=np.int8)
    with np.errstate(invalid="ignore"):
        codes[values < 0] = NEGATIVE
        if integer:
            codes[(codes == 0) & (values != np.floor(values))] = NOT_INTEGER
            codes[(codes == 0) & (values > MAX_TOKENS)] = TOO_LARGE
        codes[~np.isfinite(values)] = NOT_A_NUMBER
    if col.dtype.kind == "O":  # JSON true/false mixed with numbers: pandas would read them as 1 and 0
        codes[np.fromiter((isinstance(v, bool) for v in col), dtype=bool, count=len(col))] = NOT_A_NUMBER
    codes[col.isna().to_numpy()] = MISSING
    return values, codes


def _timestamps(col: pd.Series) -> tuple[pd.Series, np.ndarray]:
    """Date-times (ISO 8601, any number of fractional digits, naive read as UTC) and problem codes."""
    # NOTE: pandas reads at most 9 fractional digits (ns); the rest is below a ns
    if isinstance(col.dtype, pd.StringDtype):  # a CSV's text: strings or missing, trimmed as they are
        col = col.str.replace(r"(\.\d{9})\d+", r"\1", regex=True)
    elif col.dtype.kind == "O":  # JSON values: only the strings are trimmed (a per-value check)
        col = col.where(~col.map(lambda v: isinstance(v, str)), col.astype(str).str.replace(
            r"(\.\d{9})\d+", r"\1", regex=True))
    ts = pd.to_datetime(col, format="ISO8601", utc=True, errors="coerce")
    codes = np.where(ts.isna().to_numpy(), BAD_TIME, 0).astype(np.int8)
    codes[col.isna().to_numpy()] = MISSING
    return ts, codes


def _hash_lists(col: pd.Series, blocks: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """Each row's hash ids as an int64 array, and problem codes: not a list of integers, or more ids than
    ``blocks``, the row's prompt blocks (fewer name a prefix: the rest of the prompt matches no other's)."""
    arrays, codes = [], np.zeros(len(col), dtype=np.int8)
    for i, v in enumerate(col):
        a = _ids(v)
        if a is None:
            codes[i] = MISSING if v is None or (isinstance(v, float) and np.isnan(v)) else BAD_HASHES
            arrays.append(np.zeros(0, dtype=np.int64))
        else:
            codes[i] = TOO_MANY_HASHES if a.size > blocks[i] else 0
            arrays.append(a.astype(np.int64))
    return arrays, codes


def _blank_rows(frame: pd.DataFrame) -> np.ndarray:
    """Rows read from a line of nothing, or of only blanks and separators (cells of spaces or tabs).
    NOTE: text cells are checked only on rows whose other cells are empty, one column after another on the
    rows still in question: checking every text cell of every row made a first read of a 1.2M-row CSV 80 %
    slower (a review's measurement)."""
    empty = frame.isna().to_numpy()
    text = [j for j, c in enumerate(frame.columns)
            if frame[c].dtype.kind == "O" or isinstance(frame[c].dtype, pd.StringDtype)]
    other = [j for j in range(frame.shape[1]) if j not in text]
    rows = empty[:, other].all(axis=1) if other else np.ones(len(frame), dtype=bool)
    for j in text:
        ask = np.flatnonzero(rows & ~empty[:, j])
        if len(ask):
            col = frame.iloc[ask, j]
            rows[ask] = col.map(lambda v: isinstance(v, str) and not v.strip()).to_numpy(dtype=bool)
    return rows


def _ids(v) -> np.ndarray | None:
    """A row's hash ids as a 1-D integer array, or None when ``v`` is not a flat list of integers: JSON's
    ``true`` is not an id (numpy would read ``[true, 5]`` as ``[1, 5]``), nor is a nested or ragged list."""
    if isinstance(v, np.ndarray):  # parquet: a list column's cell
        return v if v.ndim == 1 and (not v.size or v.dtype.kind in "iu") else None
    if not isinstance(v, list) or not all(type(x) is int or isinstance(x, np.integer) for x in v):
        return None
    try:
        return np.asarray(v, dtype=np.int64)
    except OverflowError:  # beyond 64 bits
        return None


def _nans(col: pd.Series) -> np.ndarray:
    """Cells that are NaN or infinite floats (parquet) or JSON constants: values, not empty cells."""
    if col.dtype.kind == "f":
        return ~np.isfinite(col.to_numpy(dtype=np.float64, na_value=0.0))
    if col.dtype == object:
        return col.map(lambda v: isinstance(v, (float, JsonConstant)) and not np.isfinite(float(v))).to_numpy(dtype=bool)
    return np.zeros(len(col), dtype=bool)


def _nested(col: pd.Series) -> np.ndarray:
    """Cells that are lists or mappings (JSON, parquet list and struct columns): not a session id."""
    if col.dtype != object:
        return np.zeros(len(col), dtype=bool)
    return col.map(lambda v: isinstance(v, (list, dict, np.ndarray))).to_numpy(dtype=bool)


def _show(v: Any) -> str:
    """A cell as the user wrote it: strings quoted, numbers plain, a float NaN as NaN."""
    v = v.item() if isinstance(v, np.generic) else v
    if isinstance(v, float) and np.isnan(v):
        return "NaN"
    text = repr(v) if isinstance(v, str) else str(v)
    # (a value of 140,000 digits was echoed whole: a message of 140 KB)
    return text if len(text) <= 60 else f"{text[:40]}… ({len(text):,} characters)"


def _expected(fmt: TraceFormat, column: str, code: int) -> str:
    if column == fmt.arrival:
        if code == TOO_LARGE:
            finer = "" if fmt.arrival_unit == "datetime" else f" (are the times in a finer unit than {fmt.arrival_unit}?)"
            return f"an arrival at most {MAX_SECONDS:,.0f} s (about 32 years) after the trace's start{finer}"
        if fmt.arrival_unit == "datetime":
            return "a date and time such as 2023-11-16 18:15:46.6805900"
        return f"a number of {fmt.arrival_unit} >= 0"
    if column == fmt.hash_ids:
        return "a list of integer hash ids"
    if column == fmt.session_id:
        return "a session id"
    return f"a whole number of tokens from 0 to {MAX_TOKENS:,}"


# ---------------------------------------------------------------------------------------------- rows


@dataclass
class _Collector:
    """Checks chunks and keeps their good rows; counts or reports the rest."""

    tf: TraceFile
    bad_rows: Literal["error", "drop"]
    filters: dict[str, list[str]]
    block_size: int | None
    dropped: dict[str, int] = field(default_factory=dict)
    num_rows: int = 0
    t0: Any = None  # the first readable arrival: the trace's start
    start_s: float = 0.0  # the trace's start in the seconds it reads (not 0 for absolute times kept as they are)
    last_arrival_s: float = -np.inf
    parts: dict[str, list] = field(default_factory=lambda: {"arrival": [], "prompt": [], "output": [], "hash_ids": [],
                                                             "hash_lens": [], "session": []})

    def count(self, reason: str, n: int = 1) -> None:
        self.num_rows += n
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n

    def bad_line(self, where: str, reason: str, message: str) -> None:
        """A row that cannot be read at all (invalid JSON)."""
        if self.bad_rows == "error":
            raise ScenarioError(f"{where}: {message}{BAD_ROWS_HINT}")
        self.count(reason)

    def _arrivals(self, col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
        """Seconds from the trace's start, and problem codes: an arrival more than MAX_SECONDS (about 32
        years) after the start is too large (times in a finer unit than the format's, as a rule)."""
        fmt = self.tf.fmt
        if fmt.arrival_unit == "datetime":
            ts, codes = _timestamps(col)
            if self.t0 is None and (codes == 0).any():
                self.t0 = ts[codes == 0].iloc[0]
            seconds = ((ts - self.t0).dt.total_seconds().to_numpy(dtype=np.float64, na_value=np.nan)
                       if self.t0 is not None else np.full(len(col), np.nan))
        else:
            if col.dtype.kind == "M":  # a timestamp column (parquet) is not seconds since 1970
                raise ScenarioError(f"{self.tf.path}: column {fmt.arrival!r} holds date-times, but the format reads "
                                    f"it as a number in {fmt.arrival_unit}; set columns.arrival_unit: datetime")
            values, codes = _numbers(col, integer=False)
            if self.t0 is None and (codes == 0).any():
                self.t0 = values[codes == 0][0] if fmt.rebase else 0.0
                # the trace's start, from which the bound counts (a table of absolute times, epoch seconds,
                # keeps them: its start is its first arrival, not 0)
                self.start_s = (values[codes == 0][0] - self.t0) * SECONDS_PER_UNIT[fmt.arrival_unit]
            seconds = (values - (self.t0 or 0.0)) * SECONDS_PER_UNIT[fmt.arrival_unit]
        codes[(codes == 0) & (seconds - self.start_s > MAX_SECONDS)] = TOO_LARGE
        return seconds, codes

    def add(self, chunk: Chunk) -> None:
        fmt, frame, n = self.tf.fmt, chunk.frame, len(chunk.frame)
        self.num_rows += n
        drop = np.zeros(n, dtype=object)  # reason per row, 0 = kept

        if self.tf.container == "csv":  # an empty line reads as a row of empty cells (JSONL skips it)
            drop[_blank_rows(frame)] = "blank_line"
        for key, allowed in self.filters.items():
            out = ~frame[fmt.filters[key]].isin(allowed).to_numpy()
            drop[(drop == 0) & out] = f"not_in_{key}"

        checks: list[tuple[str, np.ndarray]] = []  # (column, problem code per row)
        prompt, c = _numbers(frame[fmt.prompt_tokens], integer=True)
        checks.append((fmt.prompt_tokens, c))
        output, c = _numbers(frame[fmt.output_tokens], integer=True)
        checks.append((fmt.output_tokens, c))
        if fmt.arrival is not None:
            arrival, c = self._arrivals(frame[fmt.arrival])
            checks.insert(0, (fmt.arrival, c))
        else:
            arrival = np.zeros(n)  # a length-only trace: an offline batch until re-timed
        hashes = None
        if fmt.hash_ids in frame:
            blocks = np.full(n, np.inf)  # (a bad or 0-token prompt is its own problem; with no block size, table() stops)
            if self.block_size is not None:
                sized = prompt > 0
                blocks[sized] = np.ceil(prompt[sized] / self.block_size)
            hashes, c = _hash_lists(frame[fmt.hash_ids], blocks)
            checks.append((fmt.hash_ids, c))
        if fmt.session_id in frame:
            sessions = frame[fmt.session_id]
            checks.append((fmt.session_id, np.select([sessions.isna().to_numpy(), _nans(sessions), _nested(sessions)],
                                                     [MISSING, NOT_A_NUMBER, BAD_SESSION]).astype(np.int8)))

        self._problems(chunk, checks, drop)
        ok = drop == 0
        if fmt.zero_output_reason != "zero_output_tokens":  # no output marks a failure (BurstGPT): that first
            drop[ok & (output == 0)] = fmt.zero_output_reason
        drop[(drop == 0) & (prompt == 0)] = "zero_prompt_tokens"
        drop[(drop == 0) & (output == 0)] = fmt.zero_output_reason
        for reason, k in zip(*np.unique(drop[drop != 0].astype(str), return_counts=True)):
            self.dropped[str(reason)] = self.dropped.get(str(reason), 0) + int(k)
        keep = np.flatnonzero(drop == 0)
        self._check_order(chunk, arrival, keep)
        self.parts["arrival"].append(arrival[keep])
        self.parts["prompt"].append(prompt[keep].astype(np.int64))
        self.parts["output"].append(output[keep].astype(np.int64))
        if hashes is not None:
            kept = [hashes[i] for i in keep]
            self.parts["hash_lens"].append(np.array([len(h) for h in kept], dtype=np.int64))
            self.parts["hash_ids"].append(np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64))
        if fmt.session_id in frame:
            self.parts["session"].append(frame[fmt.session_id].to_numpy()[keep].astype(str))

    def _problems(self, chunk: Chunk, checks: list[tuple[str, np.ndarray]], drop: np.ndarray) -> None:
        """Report the first bad value (``bad_rows: error``) or mark each bad row with its first problem."""
        live = drop == 0
        if self.bad_rows == "error":
            bad = [(int(np.flatnonzero(live & (c != 0))[0]), col) for col, c in checks if (live & (c != 0)).any()]
            if bad:
                i, col = min(bad, key=lambda b: b[0])
                code = dict(checks)[col][i]
                value = chunk.frame[col].iloc[i]
                if code == TOO_MANY_HASHES:
                    prompt = int(float(chunk.frame[self.tf.fmt.prompt_tokens].iloc[i]))
                    got, expected = f"has {len(value):,} ids", (
                        f"at most {-(-prompt // self.block_size):,}, one per {self.block_size}-token block of "
                        f"the {prompt:,}-token prompt")
                else:
                    got = "is empty" if code == MISSING else f"= {_show(value)}"
                    expected = _expected(self.tf.fmt, col, code)
                raise ScenarioError(f"{self.tf.where(int(chunk.lines[i]))}: {col} {got}, expected {expected}"
                                    f"{BAD_ROWS_HINT}")
            return
        for _, c in checks:
            mark = (drop == 0) & (c != 0)
            drop[mark] = np.asarray(PROBLEMS, dtype=object)[c[mark]]

    def _check_order(self, chunk: Chunk, arrival: np.ndarray, keep: np.ndarray) -> None:
        if self.tf.fmt.arrival is None or not len(keep):
            return
        a = arrival[keep]
        back = np.diff(a, prepend=self.last_arrival_s) < 0
        if back.any():
            j = int(np.flatnonzero(back)[0])
            before = self.last_arrival_s if j == 0 else a[j - 1]
            col = self.tf.fmt.arrival
            raise ScenarioError(f"{self.tf.where(int(chunk.lines[keep[j]]))}: {col} = {_show(chunk.frame[col].iloc[keep[j]])} "
                                f"is {before - a[j]:.6g} s before the previous request; expected rows in arrival order "
                                "(sort the file)")
        self.last_arrival_s = float(a[-1])

    def table(self) -> RequestTable:
        path, p = self.tf.path, self.parts
        if self.num_rows == 0:
            raise ScenarioError(f"{path}: no requests (the file has a header but no rows)")
        prompt = np.concatenate(p["prompt"]) if p["prompt"] else np.zeros(0, dtype=np.int64)
        if len(prompt) == 0:
            reasons = ", ".join(f"{k}: {v:,}" for k, v in sorted(self.dropped.items()))
            raise ScenarioError(f"{path}: no requests left: all {self.num_rows:,} rows were dropped ({reasons})")
        hashes = None
        if p["hash_ids"]:
            if self.block_size is None:
                raise ScenarioError(f"{path}: column {self.tf.fmt.hash_ids} has no block size (a parquet table "
                                    f"needs the metadata key {BLOCK_SIZE_KEY.decode()}; or use a generic mapping)")
            offsets = np.zeros(len(prompt) + 1, dtype=np.int64)
            np.cumsum(np.concatenate(p["hash_lens"]), out=offsets[1:])
            hashes = PrefixHashes(np.concatenate(p["hash_ids"]), offsets, self.block_size)
        return RequestTable(np.concatenate(p["arrival"]), prompt, np.concatenate(p["output"]),
                            source=self.tf.source, dropped=dict(self.dropped), prefix_hashes=hashes,
                            session_id=np.concatenate(p["session"]) if p["session"] else None)


# ---------------------------------------------------------------------------------------------- API


def _block_size(tf: TraceFile, raw: bytes) -> int:
    """A parquet table's hash block size, from its metadata: a whole number of tokens, bounded as in a
    column mapping."""
    text = raw.decode(errors="replace")
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not 0 < size <= MAX_HASH_BLOCK_SIZE:
        raise ScenarioError(f"{tf.path}: metadata {BLOCK_SIZE_KEY.decode()} = {text!r}, expected a whole number of "
                            f"tokens per hashed block from 1 to {MAX_HASH_BLOCK_SIZE:,}")
    return size


def read_trace(tf: TraceFile, *, bad_rows: Literal["error", "drop"] = "error",
               filters: dict[str, list[str]] | None = None, chunk_rows: int = CHUNK_ROWS) -> RequestTable:
    """Read a trace file (see :func:`traces.formats.open_trace`) into the canonical request table.

    A length-only trace has no arrival times: its requests all arrive at t = 0 until re-timed."""
    fmt = tf.fmt
    filters = {k: v for k, v in (filters or {}).items() if v is not None}
    for key in filters:
        if key not in fmt.filters:
            raise ScenarioError(f"{tf.path}: '{key}' selects rows of burstgpt traces; this is format {fmt.name}")
    columns = fmt.required() + [c for c in fmt.optional() if c in tf.names] + [fmt.filters[k] for k in filters]
    missing = [c for c in columns if c not in tf.names]
    if missing:
        raise ScenarioError(f"{tf.path}: missing column(s) {', '.join(missing)} (the file has {', '.join(tf.names)})")
    block_size = fmt.hash_block_size
    if tf.container == "parquet" and fmt.hash_ids in tf.names and block_size is None:
        import pyarrow.parquet as pq

        meta = pq.read_schema(tf.path).metadata or {}
        block_size = _block_size(tf, meta[BLOCK_SIZE_KEY]) if BLOCK_SIZE_KEY in meta else None
    rows = _Collector(tf, bad_rows, filters, block_size)
    if tf.container == "csv":
        text = [c for c in (fmt.session_id, *(fmt.filters[k] for k in filters)) if c in columns]
        if fmt.arrival_unit == "datetime":
            text.append(fmt.arrival)
        chunks = _csv_chunks(tf, columns, text, chunk_rows, rows)
    elif tf.container == "jsonl":
        chunks = _jsonl_chunks(tf, columns, chunk_rows, rows)
    else:
        chunks = _parquet_chunks(tf, columns, chunk_rows)
    for chunk in chunks:
        rows.add(chunk)
    return rows.table()


def write_table(t: RequestTable, out: Path) -> None:
    """The canonical table as parquet: arrival_s, prompt_tokens, output_tokens, and where present
    hash_ids (a list column; the block size in the schema metadata) and session_id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"arrival_s": pa.array(t.arrival_s), "prompt_tokens": pa.array(t.prompt_tokens),
            "output_tokens": pa.array(t.output_tokens)}
    meta = {}
    if t.prefix_hashes is not None:
        h = t.prefix_hashes
        lists = pa.ListArray if h.offsets[-1] < 2**31 else pa.LargeListArray  # 32-bit offsets when they fit
        cols["hash_ids"] = lists.from_arrays(h.offsets.astype(np.int32 if lists is pa.ListArray else np.int64), h.ids)
        meta[BLOCK_SIZE_KEY] = str(h.block_size).encode()
    if t.session_id is not None:
        cols["session_id"] = pa.array(t.session_id.astype(str))
    table = pa.table(cols).replace_schema_metadata(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
