"""Requests: the canonical request table, seeded generators, and the seam where real traces plug in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sim.config import Fixed, Gamma, LogNormal, Poisson, Scenario, ScenarioError, SyntheticWorkload, TableWorkload, Uniform

CANONICAL_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass
class RequestTable:
    """Requests sorted by arrival: seconds from the trace's start, prompt and output tokens (>= 1).

    ``dropped`` counts input rows a reader skipped, by reason (rows in = requests + dropped)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str = "generated"
    dropped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrival_s = np.ascontiguousarray(self.arrival_s, dtype=np.float64)
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.ascontiguousarray(self.output_tokens, dtype=np.int64)
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise ValueError("request table columns differ in length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                             "output_tokens": self.output_tokens})

    def head(self, n: int | None = None, duration_s: float | None = None) -> "RequestTable":
        """The first ``n`` requests and/or those arriving before ``duration_s``."""
        keep = len(self)
        if duration_s is not None:
            keep = int(np.searchsorted(self.arrival_s, duration_s, side="left"))
        if n is not None:
            keep = min(keep, n)
        return RequestTable(self.arrival_s[:keep], self.prompt_tokens[:keep], self.output_tokens[:keep],
                            self.source, dict(self.dropped))


def _norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def lognormal_mu(mean: float, cv: float, cap: float | None) -> tuple[float, float]:
    """(mu, sigma) of a log-normal whose values clipped at ``cap`` have the given mean."""
    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    if cap is None:
        return mu, sigma
    log_cap = math.log(cap)

    def clipped_mean(m: float) -> float:
        return (math.exp(m + sigma * sigma / 2) * _norm_cdf((log_cap - m - sigma * sigma) / sigma)
                + cap * (1 - _norm_cdf((log_cap - m) / sigma)))

    lo, hi = mu - 1.0, mu + 10.0  # clipped mean rises monotonically in mu, from ~0 to cap
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2, sigma


def sample_lengths(dist: Fixed | Uniform | LogNormal, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(dist, Fixed):
        return np.full(n, dist.tokens, dtype=np.int64)
    if isinstance(dist, Uniform):
        return rng.integers(dist.low, dist.high + 1, size=n, dtype=np.int64)
    mu, sigma = lognormal_mu(dist.mean, dist.cv, dist.max)
    x = np.rint(rng.lognormal(mu, sigma, size=n))
    return np.clip(x, 1, dist.max if dist.max is not None else np.inf).astype(np.int64)


def _gaps(arrival: Poisson | Gamma, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(arrival, Poisson):
        return rng.exponential(1.0 / arrival.rate, size=n)
    shape = 1.0 / (arrival.cv * arrival.cv)
    return rng.gamma(shape, 1.0 / (arrival.rate * shape), size=n)


def arrival_times(arrival: Poisson | Gamma, rng: np.random.Generator, num_requests: int | None,
                  duration_s: float | None) -> np.ndarray:
    """Arrival times starting at 0: the first request arrives at t = 0, then gaps of the process."""
    if num_requests is not None:
        t = np.concatenate(([0.0], np.cumsum(_gaps(arrival, num_requests - 1, rng))))
        return t if duration_s is None else t[t < duration_s]
    chunks, t0 = [np.zeros(1)], 0.0
    chunk = max(16, int(arrival.rate * duration_s * 1.1) + 16)
    while t0 < duration_s:
        c = t0 + np.cumsum(_gaps(arrival, chunk, rng))
        chunks.append(c)
        t0 = float(c[-1])
    t = np.concatenate(chunks)
    return t[t < duration_s]


def generate(w: SyntheticWorkload) -> RequestTable:
    """Same workload and seed, same requests: arrivals are drawn first, then prompts, then outputs."""
    rng = np.random.default_rng(w.seed)
    t = arrival_times(w.arrival, rng, w.num_requests, w.duration_s)
    n = len(t)
    return RequestTable(t, sample_lengths(w.prompt, n, rng), sample_lengths(w.output, n, rng),
                        source=f"synthetic(seed={w.seed})")


def _where(path: Path, i: int) -> str:
    """Row ``i`` (0-based) of a table: its line in a CSV (after the header), else its row number."""
    return f"line {i + 2}" if path.suffix != ".parquet" else f"row {i + 1}"


def _show(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def read_table(path: Path) -> RequestTable:
    """A canonical request table (CSV or parquet). Real trace formats are read by ``traces``."""
    try:
        df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such request table") from None
    except Exception as e:  # pandas raises many types for unreadable files
        raise ScenarioError(f"{path}: cannot read as a table ({e.__class__.__name__}: {e})") from None
    missing = [c for c in CANONICAL_COLUMNS if c not in df.columns]
    if missing:
        raise ScenarioError(f"{path}: missing column(s) {', '.join(missing)}; expected {', '.join(CANONICAL_COLUMNS)}")
    if len(df) == 0:
        raise ScenarioError(f"{path}: no requests")
    for c in CANONICAL_COLUMNS:
        col = pd.to_numeric(df[c], errors="coerce")
        bad = col.isna() | (col < (0 if c == "arrival_s" else 1))
        if c != "arrival_s":
            bad |= col != np.floor(col)
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            want = "a number >= 0" if c == "arrival_s" else "an integer >= 1"
            raise ScenarioError(f"{path}: {_where(path, i)}: {c} = {_show(df[c].iloc[i])}, expected {want}")
        df[c] = col
    arr = df["arrival_s"].to_numpy(dtype=np.float64)
    if np.any(np.diff(arr) < 0):
        i = int(np.flatnonzero(np.diff(arr) < 0)[0]) + 1
        raise ScenarioError(f"{path}: {_where(path, i)}: arrival_s goes backwards ({arr[i - 1]} then {arr[i]}); "
                            "sort the table")
    return RequestTable(arr, df["prompt_tokens"].to_numpy(), df["output_tokens"].to_numpy(), source=str(path))


def load_requests(s: Scenario) -> RequestTable:
    w = s.workload
    if isinstance(w, SyntheticWorkload):
        return generate(w)
    assert isinstance(w, TableWorkload)
    return read_table(s.resolve_path(w.path)).head(w.num_requests, w.duration_s)
