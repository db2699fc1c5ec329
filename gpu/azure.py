"""A slice of the Azure LLM inference trace (2023) as a ``sim.workload.RequestTable``.

The device check's own reader (the device image has no pydantic, which the project's trace readers in
``traces/`` need): reads ``TIMESTAMP,ContextTokens,GeneratedTokens`` with pandas (the timestamps carry 7
fractional digits, which ``pd.to_datetime`` parses), keeps the first ``num_requests`` rows, caps the
lengths and optionally compresses time. A missing column or a bad value is a ValueError naming the file,
the line and the column.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sim.workload import RequestTable


def azure_requests(path: str | Path, num_requests: int, *, max_prompt_tokens: int | None = None,
                   max_output_tokens: int | None = None, time_scale: float = 1.0) -> RequestTable:
    """The first ``num_requests`` requests; arrivals in seconds from the first, divided by ``time_scale``
    (> 1 replays the trace faster); lengths clipped to [1, max]."""
    path = Path(path)
    df = pd.read_csv(path, nrows=num_requests, skip_blank_lines=False)  # a row per line: errors name the line
    missing = [c for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens") if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}: expected the Azure LLM inference trace's "
                         f"TIMESTAMP,ContextTokens,GeneratedTokens (the file has {', '.join(map(str, df.columns))})")
    t = pd.to_datetime(df["TIMESTAMP"], errors="coerce")
    _check(path, df["TIMESTAMP"], t.isna().to_numpy(), "a date and time")
    tokens = {}
    for col in ("ContextTokens", "GeneratedTokens"):
        v = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
        _check(path, df[col], ~(v >= 0) | (v != np.floor(v)), "a whole number of tokens >= 0")
        tokens[col] = v.astype(np.int64)
    arrival = (t - t.min()).dt.total_seconds().to_numpy() / time_scale
    prompt = tokens["ContextTokens"].clip(1, max_prompt_tokens)
    output = tokens["GeneratedTokens"].clip(1, max_output_tokens)
    order = np.argsort(arrival, kind="stable")
    caps = f", prompt <= {max_prompt_tokens}, output <= {max_output_tokens}, time / {time_scale:g}"
    return RequestTable(arrival[order], prompt[order], output[order], source=f"{path.name}[:{num_requests}]{caps}")


def _check(path: Path, col: pd.Series, bad: np.ndarray, expected: str) -> None:
    """The first bad row as an error: file, line (the header is line 1), column, value, what was expected."""
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        v = col.iloc[i]
        v = v.item() if isinstance(v, np.generic) else v
        raise ValueError(f"{path}:{i + 2}: {col.name} = {v!r}, expected {expected}")
