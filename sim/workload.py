"""Requests: the canonical request table, seeded generators, and the seam where real traces plug in.

The simulator never imports the trace readers (the ``traces`` package reads files into this module's
``RequestTable``): a caller that runs trace workloads passes the reader in (``read_trace``), as the
command line and the ``kvsim`` facade do."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from sim import trace_paths
from sim.config import (Fixed, Gamma, LogNormal, Poisson, Scenario, ScenarioError, SyntheticWorkload, TraceWorkload,
                        Uniform)


def _gather(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the runs ``[starts[i], starts[i] + lengths[i])`` laid end to end, and their offsets."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return positions, offsets


@dataclass(frozen=True)
class PrefixHashes:
    """Each request's prompt as hash ids of ``block_size``-token blocks (equal ids at equal positions: a
    shared prefix, as in Mooncake's traces). Stored flat, as Arrow stores a list column::

        ids      [a0 a1 a2 | b0 b1 | c0 ...]
        offsets  [0,        3,      5, ...]      request i: ids[offsets[i]:offsets[i + 1]]
    """

    ids: np.ndarray
    offsets: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def of(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    def take(self, index: np.ndarray) -> "PrefixHashes":
        positions, offsets = _gather(self.offsets[:-1][index], np.diff(self.offsets)[index])
        return PrefixHashes(self.ids[positions], offsets, self.block_size)

    def cut(self, prompt_tokens: np.ndarray) -> "PrefixHashes":
        """Keep only the blocks that the first ``prompt_tokens`` tokens of each prompt touch."""
        num_blocks = np.minimum(np.diff(self.offsets), -(-prompt_tokens // self.block_size))
        positions, offsets = _gather(self.offsets[:-1], num_blocks)
        return PrefixHashes(self.ids[positions], offsets, self.block_size)

    def seen_fraction(self) -> float:
        """Share of all prompt blocks whose hash id appeared earlier in the trace (a prefix-cache hit
        with an unbounded cache)."""
        return 1.0 - len(np.unique(self.ids)) / len(self.ids) if len(self.ids) else 0.0


@dataclass
class RequestTable:
    """Requests sorted by arrival: seconds from the trace's start, prompt and output tokens (>= 1).

    Optional: each prompt's prefix-block hashes, each request's session id. The engine reads only the
    three arrays. ``dropped`` counts input rows left out, by reason, so that rows in = requests +
    dropped; ``truncated`` counts requests whose prompt or output was cut to the model's max length."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    source: str = "generated"
    dropped: dict[str, int] = field(default_factory=dict)
    prefix_hashes: PrefixHashes | None = None
    session_id: np.ndarray | None = None
    truncated: dict[str, int] = field(default_factory=dict)
    beyond_horizon: int = 0  # generated workloads: requests arriving at or after the horizon, not materialised

    def __post_init__(self) -> None:
        self.arrival_s = np.ascontiguousarray(self.arrival_s, dtype=np.float64)
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.ascontiguousarray(self.output_tokens, dtype=np.int64)
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise ValueError("request table columns differ in length")
        for extra in (self.prefix_hashes, self.session_id):
            if extra is not None and len(extra) != n:
                raise ValueError("request table columns differ in length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def num_rows_read(self) -> int:
        """Input rows this table came from: its requests and every dropped row."""
        return len(self) + sum(self.dropped.values())

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                             "output_tokens": self.output_tokens})

    def replace(self, **changes) -> "RequestTable":
        """A copy with some fields replaced (the counts are copied, never shared)."""
        changes.setdefault("dropped", dict(self.dropped))
        changes.setdefault("truncated", dict(self.truncated))
        return dataclasses.replace(self, **changes)

    def take(self, index: np.ndarray, reason: str) -> "RequestTable":
        """The requests at ``index`` (increasing); the others are counted as dropped for ``reason``."""
        index = np.asarray(index, dtype=np.int64)
        dropped = dict(self.dropped)
        if len(index) < len(self):
            dropped[reason] = dropped.get(reason, 0) + len(self) - len(index)
        return self.replace(arrival_s=self.arrival_s[index], prompt_tokens=self.prompt_tokens[index],
                            output_tokens=self.output_tokens[index], dropped=dropped,
                            prefix_hashes=None if self.prefix_hashes is None else self.prefix_hashes.take(index),
                            session_id=None if self.session_id is None else self.session_id[index])

    def head(self, n: int | None = None, duration_s: float | None = None) -> "RequestTable":
        """The requests arriving before ``duration_s``, then the first ``n`` of them (the rest counted
        as dropped: ``beyond_duration_s``, ``beyond_num_requests``)."""
        t = self
        if duration_s is not None:
            t = t.take(np.arange(np.searchsorted(t.arrival_s, duration_s, side="left")), "beyond_duration_s")
        if n is not None:
            t = t.take(np.arange(min(n, len(t))), "beyond_num_requests")
        return t


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


_CHUNK = 1 << 20  # draws per chunk: generating holds O(requests kept + one chunk), never the whole stream
MAX_GENERATED = 10**8  # the bound on num_requests, and on the expected count of a duration_s workload
# NOTE: what a run holds per request, measured: `sim run` of one policy (vllm, opt-13b on h100, alpaca lengths)
# peaked at 0.77 GB for 1e6 generated requests and 1.39 GB for 2e6 (/usr/bin/time), 640 bytes a request more.
# More policies hold more (three: 1.68 GB for 1e6): a count this figure says cannot fit surely cannot.
BYTES_PER_REQUEST = 640


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_count(expected: float, what: str, fix: str) -> None:
    """Refuse a generated workload of about ``expected`` requests (``what``: the key and the count in words)
    that no run can hold: past MAX_GENERATED, or needing more memory than the machine has (a run of 1e7
    requests took 5.4 GB, 1e8 exhausted the machine's memory)."""
    if expected > MAX_GENERATED:
        raise ScenarioError(f"{what}, more than the {MAX_GENERATED:.0e} a run can hold; {fix}")
    memory = physical_memory()
    if memory and expected * BYTES_PER_REQUEST > memory:
        raise ScenarioError(f"{what}, which need about {expected * BYTES_PER_REQUEST / 1e9:,.1f} GB to simulate (at "
                            f"least {BYTES_PER_REQUEST} bytes a request), more than this machine's "
                            f"{memory / 1e9:,.1f} GB of memory; {fix}")


def _skip_lengths(dist: Fixed | Uniform | LogNormal, n: int, rng: np.random.Generator) -> None:
    """Advance ``rng`` past ``n`` draws of ``dist`` without keeping them (chunk by chunk)."""
    while n > 0:
        k = min(n, _CHUNK)
        sample_lengths(dist, k, rng)
        n -= k


def arrival_times(arrival: Poisson | Gamma, rng: np.random.Generator, num_requests: int | None,
                  duration_s: float | None, horizon_s: float | None = None) -> tuple[np.ndarray, int, int]:
    """Arrival times starting at 0: the first request arrives at t = 0, then gaps of the process.

    Returns (the arrivals before ``horizon_s``, the workload's request count, how many of them arrive at
    or after the horizon). Those are never materialised: with ``num_requests`` every gap is still drawn
    (chunk by chunk, so the random stream -- and every kept request -- is the same as without a
    horizon) and counted; with ``duration_s`` alone the workload ends at the horizon."""
    horizon = math.inf if horizon_s is None else horizon_s
    if num_requests is not None:
        end = math.inf if duration_s is None else duration_s
        if num_requests > arrival.rate * min(end, horizon):  # (the arrivals' count is near its expectation)
            _check_count(arrival.rate * min(end, horizon), *_about(arrival, duration_s, horizon))
        else:
            _check_count(num_requests, f"workload.num_requests: {num_requests:,} requests", "lower it")
        kept: list[np.ndarray] = [np.zeros(1)] if 0.0 < horizon else []
        total, beyond, t0, left = 1, 0 if 0.0 < horizon else 1, 0.0, num_requests - 1
        while left > 0:
            k = min(left, _CHUNK)
            # prepending t0 keeps the sums sequential: the same bits as one cumsum over every gap
            c = np.cumsum(np.concatenate(([t0], _gaps(arrival, k, rng))))[1:]
            t0, left = float(c[-1]), left - k
            if c[0] >= end:
                continue  # past duration_s: not part of the workload (but the stream is drawn on)
            c = c[c < end]
            total += len(c)
            n_kept = int(np.searchsorted(c, horizon, side="left"))
            beyond += len(c) - n_kept
            if n_kept:
                kept.append(c[:n_kept])
        return np.concatenate(kept) if kept else np.zeros(0), total, beyond
    stop = min(duration_s, horizon)
    _check_count(arrival.rate * stop, *_about(arrival, duration_s, horizon))
    chunks, t0 = [np.zeros(1)], 0.0
    chunk = min(_CHUNK, max(16, int(arrival.rate * stop * 1.1) + 16))
    while t0 < stop:
        c = t0 + np.cumsum(_gaps(arrival, chunk, rng))
        chunks.append(c[c < stop])
        t0 = float(c[-1])
    t = np.concatenate(chunks)
    t = t[t < stop]
    return t, len(t), 0


def _about(arrival: Poisson | Gamma, duration_s: float | None, horizon: float) -> tuple[str, str]:
    """A duration's (or the horizon's, where it comes first) expected request count in words, naming the key,
    and what to do about it."""
    if duration_s is None or horizon < duration_s:
        return (f"horizon_s: {horizon:g} s at {arrival.rate:g} requests/s is about {arrival.rate * horizon:.3g} "
                "requests", "shorten it")
    return (f"workload.duration_s: {duration_s:g} s at {arrival.rate:g} requests/s is about "
            f"{arrival.rate * duration_s:.3g} requests", "shorten it or set horizon_s")


def generate(w: SyntheticWorkload, horizon_s: float | None = None, max_model_len: int | None = None) -> RequestTable:
    """Same workload and seed, same requests: arrivals are drawn first, then prompts, then outputs,
    then (with shared prefixes) each request's system prompt. Requests arriving at or after
    ``horizon_s`` are not generated: the table counts them (``beyond_horizon``) and a run reports them
    unfinished; the requests kept are the same as without a horizon. ``max_model_len``: content is named
    (hash ids) only up to it, since a longer request is rejected."""
    rng = np.random.default_rng(w.seed)
    t, total, beyond = arrival_times(w.arrival, rng, w.num_requests, w.duration_s, horizon_s)
    n = len(t)
    prompt = sample_lengths(w.prompt, n, rng)
    _skip_lengths(w.prompt, total - n, rng)
    output = sample_lengths(w.output, n, rng)
    _skip_lengths(w.output, total - n, rng)
    hashes = None
    if w.shared_prefixes is not None:
        prompt, hashes = with_shared_prefixes(w.shared_prefixes, prompt, rng, max_model_len)
    return RequestTable(t, prompt, output, source=f"synthetic(seed={w.seed})", prefix_hashes=hashes,
                        beyond_horizon=beyond)


def with_shared_prefixes(sp, prompt: np.ndarray, rng: np.random.Generator,
                         limit: int | None = None) -> tuple[np.ndarray, PrefixHashes]:
    """Put a system prompt before each prompt and name the content: a system prompt's whole
    ``hash_block``-token segments get ids shared by every request that uses it; every other segment
    (the request's own tokens, and a segment where the system prompt ends mid-way) gets an id of its own.
    Only the first ``limit`` tokens are named (a request longer than the model is rejected; a prompt of
    2^31 tokens named in 16-token segments took 11 GB)."""
    H = sp.hash_block
    weights = np.asarray(sp.popularity if sp.popularity is not None else [1.0] * len(sp.lengths), dtype=float)
    choice = rng.choice(len(sp.lengths), size=len(prompt), p=weights / weights.sum())
    sys_len = np.asarray(sp.lengths, dtype=np.int64)[choice]
    total = prompt + sys_len
    shared = sys_len // H  # whole segments of the system prompt
    segs = -(-(total if limit is None else np.minimum(total, limit)) // H)
    offsets = np.concatenate(([0], np.cumsum(segs)))
    pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1], segs)  # segment index within its request
    owner = np.repeat(np.arange(len(prompt)), segs)
    ids = np.where(pos < shared[owner], choice[owner] * 1_000_000 + pos, 10**12 + np.arange(offsets[-1]))
    return total, PrefixHashes(ids.astype(np.int64), offsets.astype(np.int64), H)


# Reads a trace workload's file and applies its transforms: (workload, path, the model's max length when the
# workload truncates) -> requests. ``traces.workload.load_trace`` is the one the project has.
TraceReader = Callable[[TraceWorkload, Path, int | None], RequestTable]


def load_requests(s: Scenario, read_trace: TraceReader | None = None) -> RequestTable:
    """The scenario's requests: generated, or read from a trace file (by ``read_trace``) and transformed."""
    w = s.workload
    if isinstance(w, SyntheticWorkload):
        return generate(w, s.horizon_s, s.model_spec().max_model_len)
    path = s.resolve_path(w.path)
    if not path.is_file():  # (a folder too: traces: with no file, a path to a directory)
        if path.exists() and not w.path.startswith(trace_paths.PREFIX):  # (/dev/null was "no such trace file")
            raise ScenarioError(f"workload.path: {path}: not a regular file (a folder or a device); expected a "
                                "trace file")
        if w.path.startswith(trace_paths.PREFIX):
            raise ScenarioError(f"workload.path: {w.path}: not found in the traces folders "
                                f"({trace_paths.searched()}); `sim trace fetch --list` names the public traces "
                                "and the file each writes")
        raise ScenarioError(f"workload.path: {path}: no such trace file (relative paths start at the scenario's "
                            "folder; real traces are not part of the project: see the README's Traces section)")
    if read_trace is None:
        raise ScenarioError(f"workload.path: {w.path}: a trace workload needs the trace readers, which the caller "
                            "passes in: `sim run` does; from Python, use kvsim.run (or pass "
                            "read_trace=traces.workload.load_trace)")
    max_model_len = s.model_spec().max_model_len if w.cap_lengths == "truncate" else None
    return read_trace(w, path, max_model_len)
