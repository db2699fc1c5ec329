"""A trace workload: read the file, then transform its requests. Every row left out is counted by
reason in ``RequestTable.dropped``, so rows in = requests out + dropped after every step.

Transforms, in this order (each optional):

1. ``window``: arrivals in [start_s, end_s) of the trace's clock, re-based to start at 0;
2. ``sample``: a seeded random fraction of the requests (order kept);
3. ``arrival`` (re-time: new Poisson or Gamma arrivals, the trace's lengths in order) or ``rate_scale``
   (×k the request rate: arrival times divided by k);
4. ``duration_s`` then ``num_requests``: the requests arriving before, then the first N;
5. ``cap_lengths: truncate``: prompts cut to max_model_len − 1 tokens (their first tokens kept, with the
   hash ids of the blocks they touch), then outputs to what is left (where a server stops generating);
   ``reject`` leaves them for the engine to reject (``exceeds_max_model_len``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.config import Gamma, Poisson, ScenarioError, TraceWorkload
from sim.workload import RequestTable, arrival_times
from traces.cache import cached
from traces.formats import open_trace


def window(t: RequestTable, start_s: float, end_s: float | None) -> RequestTable:
    lo = int(np.searchsorted(t.arrival_s, start_s, side="left"))
    hi = len(t) if end_s is None else int(np.searchsorted(t.arrival_s, end_s, side="left"))
    t = t.take(np.arange(lo, max(lo, hi)), "outside_window")
    return t.replace(arrival_s=t.arrival_s - start_s)


def sample(t: RequestTable, fraction: float, rng: np.random.Generator) -> RequestTable:
    """round(fraction × n) requests drawn without replacement, in their order."""
    k = round(fraction * len(t))
    return t.take(np.sort(rng.choice(len(t), size=k, replace=False)), "not_sampled")


def retime(t: RequestTable, arrival: Poisson | Gamma, rng: np.random.Generator) -> RequestTable:
    """New arrivals from the process (the first at 0); lengths, hashes and sessions stay in order."""
    return t.replace(arrival_s=arrival_times(arrival, rng, len(t), None)[0] if len(t) else t.arrival_s)


def truncate(t: RequestTable, max_model_len: int) -> RequestTable:
    """Prompt to at most ``max_model_len`` − 1 tokens, then output to at most what is left."""
    prompt = np.minimum(t.prompt_tokens, max_model_len - 1)
    output = np.minimum(t.output_tokens, max_model_len - prompt)
    truncated = dict(t.truncated)
    for name, new, old in (("prompt_tokens", prompt, t.prompt_tokens), ("output_tokens", output, t.output_tokens)):
        truncated[name] = truncated.get(name, 0) + int(np.count_nonzero(new != old))
    hashes = None if t.prefix_hashes is None else t.prefix_hashes.cut(prompt)
    return t.replace(prompt_tokens=prompt, output_tokens=output, prefix_hashes=hashes, truncated=truncated)


def transform(t: RequestTable, w: TraceWorkload, max_model_len: int | None = None) -> RequestTable:
    """The workload's transforms, in the documented order, seeded by ``w.seed``."""
    # NOTE: numpy.random (6 ms to import) only for a transform that draws
    rng = np.random.default_rng(w.seed) if w.sample is not None or w.arrival is not None else None
    if w.window is not None:
        t = window(t, w.window.start_s, w.window.end_s)
    if w.sample is not None:
        t = sample(t, w.sample, rng)
    if w.arrival is not None:
        t = retime(t, w.arrival, rng)
    elif w.rate_scale is not None:
        t = t.replace(arrival_s=t.arrival_s / w.rate_scale)
    t = t.head(w.num_requests, w.duration_s)
    if w.cap_lengths == "truncate":
        if max_model_len is None:
            raise ScenarioError("cap_lengths: truncate needs the model's max length (--max-model-len)")
        t = truncate(t, max_model_len)
    return t


def load_trace(w: TraceWorkload, path: Path, max_model_len: int | None = None, *,
               allow_untimed: bool = False) -> RequestTable:
    """Read ``path`` as the workload says and transform it. A length-only trace needs ``arrival``
    (unless ``allow_untimed``: then its requests all arrive at 0, for statistics)."""
    tf = open_trace(path, w.format, w.columns)
    if tf.fmt.arrival is None:
        if w.window is not None or w.rate_scale is not None:
            raise ScenarioError(f"{path}: format {tf.fmt.name} has no arrival times to window or scale; "
                                "give 'arrival' (a Poisson or Gamma process) and 'num_requests' or 'duration_s'")
        if w.arrival is None and not allow_untimed:
            raise ScenarioError(f"{path}: format {tf.fmt.name} has no arrival times; give 'arrival', "
                                "such as {kind: poisson, rate: 2}")
    filters = {"models": w.models, "log_types": w.log_types}

    def read() -> RequestTable:
        from traces.read import read_trace  # (pandas: imported only when a file is parsed)

        return read_trace(tf, bad_rows=w.bad_rows, filters=filters)

    t = transform(cached(tf, {"bad_rows": w.bad_rows, "filters": filters}, read), w, max_model_len)
    if len(t) == 0:
        reasons = ", ".join(f"{k}: {v:,}" for k, v in t.dropped.items())
        raise ScenarioError(f"{path}: no requests left after the workload's transforms ({reasons})")
    return t
