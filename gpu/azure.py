"""A slice of the Azure LLM inference trace (2023) as a ``sim.workload.RequestTable``.

A stopgap until the project's trace readers land: reads ``TIMESTAMP,ContextTokens,GeneratedTokens``
with pandas (the timestamps carry 7 fractional digits, which ``pd.to_datetime`` parses), keeps the
first ``num_requests`` rows, caps the lengths and optionally compresses time.
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
    df = pd.read_csv(path, nrows=num_requests)
    t = pd.to_datetime(df["TIMESTAMP"])
    arrival = (t - t.min()).dt.total_seconds().to_numpy() / time_scale
    prompt = df["ContextTokens"].to_numpy().clip(1, max_prompt_tokens)
    output = df["GeneratedTokens"].to_numpy().clip(1, max_output_tokens)
    order = np.argsort(arrival, kind="stable")
    caps = f", prompt <= {max_prompt_tokens}, output <= {max_output_tokens}, time / {time_scale:g}"
    return RequestTable(arrival[order], prompt[order], output[order], source=f"{path.name}[:{num_requests}]{caps}")
