"""``sim trace info`` and ``sim trace convert``: a trace's statistics, and its canonical table.

Both take the workload keys of a scenario's ``kind: trace`` workload as ``-w KEY=VALUE`` (YAML values,
dotted keys for nested ones), so a transform reads the same on the command line and in a scenario::

    sim trace info trace.csv -w window.end_s=600 -w rate_scale=2
    sim trace convert lengths.csv out.parquet -w "arrival={kind: poisson, rate: 4}" -w num_requests=1000
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from pydantic import ValidationError

from sim import trace_paths
from sim.config import YAML_LOADER, ScenarioError, TraceWorkload, format_validation_error
from sim.schema import plural
from sim.workload import RequestTable
from traces.formats import open_trace
from traces.read import write_table
from traces.workload import load_trace

PERCENTILES = (50, 90, 99)


def workload_from_options(path: Path, settings: list[str]) -> TraceWorkload:
    """A trace workload for ``path`` from ``KEY=VALUE`` settings (``window.start_s=600``)."""
    data: dict = {"kind": "trace", "path": str(path)}
    given: dict[tuple[str, ...], str] = {}
    for item in settings:
        key, sep, text = item.partition("=")
        keys = key.strip().split(".")
        if not sep or not all(keys):
            raise ScenarioError(f"-w {item!r}: expected KEY=VALUE, such as sample=0.5 or window.end_s=600")
        if keys[0] in ("kind", "path"):
            raise ScenarioError(f"-w {item!r}: the trace file is the FILE argument")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ScenarioError(f"-w {item!r}: {k} is not a mapping")
        if keys[-1] in node:  # (the last one was kept, silently)
            first = next((it for k, it in given.items() if k[:len(keys)] == tuple(keys) or tuple(keys[:len(k)]) == k), "")
            raise ScenarioError(f"-w {item!r}: {key.strip()} is already set (by -w {first!r}); give each key once")
        given[tuple(keys)] = item
        try:
            node[keys[-1]] = yaml.load(text, Loader=YAML_LOADER)  # (numbers as in a scenario file: 010 is 10)
        except yaml.YAMLError as e:
            raise ScenarioError(f"-w {item!r}: not a YAML value ({getattr(e, 'problem', None) or e})") from None
    try:
        return TraceWorkload.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(format_validation_error(e, "-w", model=TraceWorkload)) from None


def token_stats(x: np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99 (numpy's default, linear interpolation) and max."""
    p = np.percentile(x, PERCENTILES)
    return {"mean": float(x.mean()), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, p)}, "max": float(x.max())}


def trace_stats(t: RequestTable, timed: bool) -> dict:
    """The figures ``sim trace info`` prints. Rates are over the span from the first to the last arrival:
    mean = (n − 1) / span (one over the mean gap); peak = the most arrivals in a minute from the first."""
    s: dict = {"num_requests": len(t), "num_rows_read": t.num_rows_read, "dropped": dict(t.dropped),
               "truncated": dict(t.truncated), "prompt_tokens": token_stats(t.prompt_tokens),
               "output_tokens": token_stats(t.output_tokens)}
    if timed:
        gaps = np.diff(t.arrival_s)
        span = float(t.arrival_s[-1] - t.arrival_s[0])
        s["span_s"] = span
        s["mean_rate_per_min"] = 60 * (len(t) - 1) / span if span > 0 else None
        # NOTE: the arrivals are sorted, so each minute's are one run: counted without a bin per minute of
        # the span (rate_scale can stretch it far past the reader's bound)
        minute = (t.arrival_s - t.arrival_s[0]) // 60
        starts = np.flatnonzero(np.diff(minute, prepend=-1))
        s["peak_rate_per_min"] = int(np.diff(starts, append=len(minute)).max())
        s["burstiness_cv"] = float(gaps.std() / gaps.mean()) if len(gaps) > 1 and gaps.mean() > 0 else None
    h = t.prefix_hashes
    if h is not None:
        s["prefix_blocks"] = len(h.ids)
        s["prefix_block_size"] = h.block_size
        s["prefix_seen_fraction"] = h.seen_fraction()
    return s


def _num(x: float) -> str:
    return f"{x:.1f}".removesuffix(".0")


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items())


def format_stats(path: Path, fmt_name: str, s: dict) -> list[str]:
    lines = [f"{path}: format {fmt_name}, {plural(s['num_requests'], 'request')} from "
             f"{plural(s['num_rows_read'], 'row')}"]
    if "span_s" in s:
        mean = s["mean_rate_per_min"]
        lines += [f"span            {s['span_s']:,.1f} s",
                  f"request rate    mean {_num(mean)} /min ({mean / 60:.2f} /s), peak {s['peak_rate_per_min']:,} /min"
                  if mean is not None else "request rate    - (fewer than two distinct arrival times)",
                  f"burstiness      {s['burstiness_cv']:.2f} (CV of inter-arrival times; Poisson = 1)"
                  if s["burstiness_cv"] is not None else "burstiness      -"]
    else:
        lines.append("arrivals        none in this trace (give -w arrival=... to add a process)")
    cols = ("mean", *(f"p{q}" for q in PERCENTILES), "max")
    cells = {key: [_num(s[key][c]) for c in cols] for key in ("prompt_tokens", "output_tokens")}
    width = max(10, 2 + max(len(c) for row in cells.values() for c in row))  # two spaces at least between columns
    lines.append(f"{'tokens':<14}" + "".join(f"{c:>{width}}" for c in cols))
    for key, row in cells.items():
        lines.append(f"{key.replace('_tokens', ''):<14}" + "".join(f"{c:>{width}}" for c in row))
    if "prefix_blocks" in s:
        lines.append(f"prefix blocks   {s['prefix_blocks']:,} of {s['prefix_block_size']} tokens, "
                     f"{100 * s['prefix_seen_fraction']:.1f} % seen earlier in the trace")
    if s["dropped"]:
        lines.append(f"dropped rows    {_counts(s['dropped'])}")
    if s["truncated"]:
        lines.append(f"truncated       {_counts(s['truncated'])}")
    return lines


def _read_max_model_len(w: TraceWorkload, max_model_len: int | None) -> None:
    """--max-model-len is for cap_lengths=truncate (the model's max length, to cut requests to); with the
    default (reject) the lengths are kept as they are, and the option would be ignored."""
    if max_model_len is not None and w.cap_lengths != "truncate":
        raise ScenarioError(f"--max-model-len {max_model_len}: read only with -w cap_lengths=truncate (which cuts "
                            f"longer requests to it); without it the trace's lengths are kept as they are")


def _named(path: Path) -> Path:
    """FILE of ``sim trace``: a path, or ``traces:REL`` in the traces folders (``trace_paths.named``)."""
    try:
        return trace_paths.named(path)
    except ValueError as e:
        raise ScenarioError(f"{path}: {e}") from None


def trace_info(path: Path, settings: list[str], max_model_len: int | None = None) -> list[str]:
    """``sim trace info``: the trace's statistics, after the transforms in ``settings``."""
    path = _named(path)
    w = workload_from_options(path, settings)
    _read_max_model_len(w, max_model_len)
    t = load_trace(w, path, max_model_len, allow_untimed=True)
    fmt = open_trace(path, w.format, w.columns).fmt
    return format_stats(path, fmt.name, trace_stats(t, timed=fmt.arrival is not None or w.arrival is not None))


def trace_convert(path: Path, out: Path, settings: list[str], max_model_len: int | None = None) -> list[str]:
    """``sim trace convert``: write the (transformed) canonical table as parquet."""
    path = _named(path)
    if out.suffix != ".parquet":
        raise ScenarioError(f"{out}: the canonical table is written as parquet; name it *.parquet")
    if out.exists() and path.exists() and out.resolve() == path.resolve():  # (-w sample=0.5 halved the input)
        raise ScenarioError(f"{out}: is the trace being converted; write the table to another file")
    w = workload_from_options(path, settings)
    _read_max_model_len(w, max_model_len)
    t = load_trace(w, path, max_model_len)
    write_table(t, out)
    line = f"wrote {out}: {plural(len(t), 'request')} from {plural(t.num_rows_read, 'row')} of {t.source}"
    return [line] + ([f"dropped rows: {_counts(t.dropped)}"] if t.dropped else [])
