"""Per-request results (columnar), step records, the inter-token-latency histogram and the summary.

Metric names follow vLLM's serving benchmark (references.md):
  TTFT = first token - arrival; TPOT = (E2EL - TTFT) / (output - 1); ITL = each gap between consecutive
  output tokens of a request (a preemption stall included); E2EL = finish - arrival;
  normalized latency = E2EL / output tokens (the PagedAttention paper's metric, s/token);
  scheduling delay = first scheduled - arrival (Vidur's metric: the time a request waits before the first
  step that computes any of its tokens).

Three batch measures, one meaning each:
  mean_batch_size         sequences per step, over every step (prefill-only steps included);
  mean_decode_batch_size  sequences decoding (computing one token) per step, over the steps that decode;
  mean_running_requests   requests holding KV cache in GPU memory, averaged over the run's duration
                          (time-weighted; a request's samples or beams count once; a static batch's
                          finished requests count until the batch ends, as they keep their slabs).

Every summary metric is declared once, in ``METRICS`` (``sim.schema``: name, unit, label, which way is
better); the console, the report, sweeps and the decomposition read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from types import FunctionType
from typing import Any, Final

import numpy as np

from sim.buffers import append, extend, vec
from sim.core import Sequence, StepPlan
from sim.kv import breakdown
from sim.outputs import Columns
# The schema (metrics, memory classes, status and reason codes) is declared in sim.schema, shared with the
# reports, and imported from there (this module no longer re-exports it).
from sim.schema import (FINISHED, MEMORY_CLASSES, METRICS, PENDING, REASONS, STATUS_NAMES, UNFINISHED,
                        USED_CLASSES)


class RequestLog:
    """One row per input request, in columns (bounded memory for long traces)."""

    def __init__(self, arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> None:
        n = len(arrival_s)
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.status = np.zeros(n, dtype=np.int8)
        self.reason = np.zeros(n, dtype=np.int8)
        self.first_scheduled_s = np.full(n, np.nan)
        self.first_token_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.num_preemptions = np.zeros(n, dtype=np.int32)
        self.generated_tokens = np.zeros(n, dtype=np.int64)
        self.prefix_hit_tokens = np.zeros(n, dtype=np.int64)  # served from the prefix cache at admission
        # finishes not yet in the columns, flat: request id, first token, finish, preemptions, generated
        # tokens, prefix hits (see flush); and first schedulings: (request id, start) pairs
        self._done = vec[float](capacity=self.FLUSH_ROWS * 6)
        self._scheduled = vec[float](capacity=self.FLUSH_ROWS * 2)

    # NOTE: finishes and first schedulings are buffered as float64 (sim/buffers.py; ids and counts exact) and
    # written to the columns in bulk (a numpy item write costs ~10x an append, and every request does both);
    # readers of the columns call ``flush`` first (``frame``, the recorder's results, the engine's close),
    # and a full buffer flushes itself.
    FLUSH_ROWS = 4096

    def flush(self) -> None:
        """Write the buffered finishes and first schedulings into the columns."""
        if len(self._done):
            d = np.frombuffer(memoryview(self._done), dtype=np.float64).reshape(-1, 6)
            i = d[:, 0].astype(np.int64)
            self.status[i] = FINISHED
            self.first_token_s[i] = d[:, 1]
            self.finish_s[i] = d[:, 2]
            self.num_preemptions[i] = d[:, 3]
            self.generated_tokens[i] = d[:, 4]
            self.prefix_hit_tokens[i] = d[:, 5]
            self._done = vec[float](capacity=self.FLUSH_ROWS * 6)
        if len(self._scheduled):
            d = np.frombuffer(memoryview(self._scheduled), dtype=np.float64).reshape(-1, 2)
            self.first_scheduled_s[d[:, 0].astype(np.int64)] = d[:, 1]
            self._scheduled = vec[float](capacity=self.FLUSH_ROWS * 2)

    def _common(self, seq: Sequence) -> tuple[int, int, int]:
        """Per request: preemptions, generated tokens (a group's: all its samples' or beams'; one done at its
        first token never forked, but sampled that token for each of them), prefix hits."""
        g = seq.group
        if g is None:
            gen = seq.num_output_tokens
        elif len(g.members) == 1:
            gen = g.width * seq.num_output_tokens
        else:
            gen = sum(m.num_output_tokens for m in g.members)
        return seq.num_preemptions, gen, seq.prefix_hit_tokens or 0

    def scheduled(self, request_id: int, start_s: float) -> None:
        """The step starting at ``start_s`` is the first to schedule request ``request_id``."""
        self._scheduled = v = append(append(self._scheduled, request_id), start_s)
        if len(v) >= self.FLUSH_ROWS * 2:
            self.flush()

    def finish(self, seq: Sequence, end_s: float) -> None:
        pre, gen, hit = self._common(seq)
        first = seq.first_token_s
        v = append(self._done, seq.request_id)
        v = append(v, math.nan if first is None else first)
        v = append(v, end_s)
        v = append(v, pre)
        v = append(v, gen)
        self._done = v = append(v, hit)
        if len(v) >= self.FLUSH_ROWS * 6:
            self.flush()

    def unfinished(self, seq: Sequence, reason: int) -> None:
        self.flush()
        i = seq.request_id
        self.status[i] = UNFINISHED
        self.reason[i] = reason
        if seq.first_token_s is not None:
            self.first_token_s[i] = seq.first_token_s
        self.num_preemptions[i], self.generated_tokens[i], self.prefix_hit_tokens[i] = self._common(seq)

    def columns(self) -> Columns:
        """The requests' table (``sim.outputs.Columns``; ``frame()`` for a DataFrame)."""
        self.flush()
        arrival, output = self.arrival_s.copy(), self.output_tokens.copy()
        # NOTE: the log's own columns go into the table uncopied (at 10^6 requests, copying them was ~90
        # MiB on top of everything the run holds, at its peak), so the table is built once the log is
        # final. The request table's columns are copied: every policy's log shares them, and a table
        # written in place must not change the next policy's requests.
        delay = (self.first_scheduled_s - arrival) * 1e3
        ttft = (self.first_token_s - arrival) * 1e3
        e2el = (self.finish_s - arrival) * 1e3
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(output > 1, (e2el - ttft) / (output - 1), np.nan)
        return Columns({
            "request_id": np.arange(len(arrival)), "arrival_s": arrival, "prompt_tokens": self.prompt_tokens.copy(),
            "output_tokens": output, "status": self.status, "reason": self.reason,
            "first_scheduled_s": self.first_scheduled_s, "first_token_s": self.first_token_s,
            "finish_s": self.finish_s, "num_preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens, "prefix_hit_tokens": self.prefix_hit_tokens,
            "scheduling_delay_ms": delay, "ttft_ms": ttft, "e2el_ms": e2el, "tpot_ms": tpot,
            "normalized_latency_s": e2el / 1e3 / output,
        }, {"status": list(STATUS_NAMES.values()), "reason": list(REASONS.values())})

    def frame(self):
        """The requests' table as a pandas DataFrame."""
        return self.columns().frame()


class ItlHistogram:
    """Inter-token latencies in log-spaced bins 0.23 % wide from 0.1 us to 1e5 s, with their exact
    count and sum: percentiles to bin precision, the mean exact, memory independent of run length.
    Values are buffered and binned in bulk (cheap per call)."""

    LO = 1e-7  # (one name per line: mypyc compiles class bodies of plain assignments only)
    PER_DECADE = 1000
    DECADES = 12
    BUFFER = 16384  # values binned at once

    def __init__(self) -> None:
        self.counts = np.zeros(self.PER_DECADE * self.DECADES + 1, dtype=np.float64)
        self.count = 0.0
        self.total = 0.0
        self._values = vec[float](capacity=self.BUFFER)
        # flat (values, times) pairs, as float64 (exact): the weights of the buffered values, run by run.
        # NOTE: a list of ints cost an object per count and a tuple per call, and a fleet's replicas' lists
        # grew side by side (each regrowth a copy to fresh memory); instructions, one server: -4 %
        self._runs = vec[float](capacity=self.BUFFER // 4)  # (a hint: it grows)

    def add(self, value: float, times: int = 1) -> None:
        """``value`` seen ``times`` times."""
        self._values = append(self._values, value)
        self._runs = append(append(self._runs, 1.0), float(times))
        if len(self._values) >= self.BUFFER:
            self.flush()

    def add_gaps(self, ends: list[float], times: int) -> None:
        """Each gap between consecutive ``ends`` (a span's step ends) seen ``times`` times."""
        values = self._values
        if COMPILED:
            prev = ends[0]
            for j in range(1, len(ends)):
                e = ends[j]
                values = append(values, e - prev)
                prev = e
        else:  # (one call, not one per value: see _timeline_step_row)
            values = extend(values, [e - p for p, e in zip(ends, ends[1:])])
        self._values = values
        self._runs = append(append(self._runs, float(len(ends) - 1)), float(times))
        if len(values) >= self.BUFFER:
            self.flush()

    def flush(self) -> None:
        if len(self._values) == 0:
            return
        runs = np.frombuffer(memoryview(self._runs), dtype=np.float64)
        v = np.frombuffer(memoryview(self._values), dtype=np.float64)
        w = np.repeat(runs[1::2], runs[0::2].astype(np.int64))
        with np.errstate(divide="ignore"):
            i = np.floor(np.log10(np.maximum(v, self.LO) / self.LO) * self.PER_DECADE)
        i = np.clip(i, 0, len(self.counts) - 1).astype(np.int64)
        self.counts += np.bincount(i, weights=w, minlength=len(self.counts))
        self.count += float(w.sum())
        # NOTE: an exactly rounded sum, not v @ w: BLAS's dot product rounds differently with the arrays'
        # memory alignment, so the same run gave a different last bit in another process (a sweep's local
        # and Ray executors must give identical tables)
        self.total += math.fsum((v * w).tolist())
        self._values, self._runs = vec[float](capacity=self.BUFFER), vec[float](capacity=self.BUFFER // 4)

    def mean(self) -> float:
        self.flush()
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Value at quantile q (0..1) by numpy's default rule (linear between the values of ranks
        floor and ceil of q (n - 1)), each value the geometric centre of the bin holding it."""
        self.flush()
        if not self.count:
            return math.nan
        cum = np.cumsum(self.counts)
        rank = q * (self.count - 1)
        lo, hi = math.floor(rank), math.ceil(rank)
        # the k-th smallest value (from 0) is in the first bin whose cumulative count exceeds k
        i, j = (min(int(np.searchsorted(cum, k + 1, side="left")), len(cum) - 1) for k in (lo, hi))
        a = self.LO * 10 ** ((i + 0.5) / self.PER_DECADE)
        return a if i == j else a + (rank - lo) * (self.LO * 10 ** ((j + 0.5) / self.PER_DECADE) - a)


# One row per record: a single step, a run of `num_steps` decode steps taken as one span (token counts
# are per step, context tokens at the first step), or an idle gap (num_steps = 0). Memory columns are
# time-weighted token slots over the record.
STEP_COLUMNS = ("step_index", "start_s", "duration_s", "num_steps", "num_seqs", "num_prefill_tokens",
                "num_decode_tokens", "num_sampled", "prefill_attention_pairs", "num_context_tokens", "num_waiting",
                "num_running", "num_swapped", "num_preempted", "num_swap_blocks") + tuple(f"mem_{c}" for c in MEMORY_CLASSES)
STEP_COUNTS = ("step_index", "prefill_attention_pairs")  # integer columns besides the num_* ones


def _nan_to_none(x):  # NOTE: untyped: a compiled build (sim/native.py) would make an int a float
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass(frozen=True)
class SharingCounts:
    """What block sharing counted over a run (the sharing metrics' inputs besides the tables).
    ``paged``: blocks are shared (else contiguous slabs, whose samples and beams are copies);
    ``caching``: the prefix cache is on (the hit rates apply)."""

    paged: bool
    caching: bool
    block_size: int
    prefill_tokens_saved: int = 0
    num_cow_copies: int = 0
    num_evicted_blocks: int = 0
    num_slab_copies: int = 0
    offload: dict | None = None  # the CPU tier's counts (``offload_counts``), when the policy has one


def offload_counts(kv, kv_bytes_per_token: int) -> dict | None:
    """What the CPU tier of a sharing KV manager counted (None without a tier): prompt tokens admitted
    for the first time and found on each tier, the prefill tokens its loads saved, and bytes moved each
    way. Counts only, so a fleet's replicas add up (``offload_metrics`` makes the rates)."""
    tier = getattr(kv, "tier", None)
    if tier is None:
        return None
    block_bytes = kv.block_size * kv_bytes_per_token
    return {"admitted_prompt_tokens": kv.admitted_prompt_tokens, "hit_tokens_gpu": kv.hit_tokens_gpu,
            "hit_tokens_cpu": kv.hit_tokens_cpu,
            "prefill_tokens_saved_cpu": tier.num_loaded * kv.block_size,
            "host_to_device_bytes": tier.num_loaded * block_bytes,
            "device_to_host_bytes": tier.num_stored * block_bytes}


def offload_metrics(counts: dict) -> dict:
    """The CPU tier's metrics (declared in ``METRICS``): hit rates by tier over every request's first
    admission, the prefill tokens its loads saved, and bytes moved each way."""
    admitted = counts["admitted_prompt_tokens"]
    return {"prefix_hit_rate_gpu": counts["hit_tokens_gpu"] / admitted if admitted else None,
            "prefix_hit_rate_cpu": counts["hit_tokens_cpu"] / admitted if admitted else None,
            **{k: counts[k] for k in ("prefill_tokens_saved_cpu", "host_to_device_bytes", "device_to_host_bytes")}}


def _median_p99(v: np.ndarray) -> tuple[float, float]:
    """``np.median(v)`` and ``np.percentile(v, 99)`` of a non-empty array without NaN, to the same bits:
    the mean of the middle pair, and the linear method's interpolation as numpy computes it.
    NOTE: both numpy functions import ``numpy.ma`` for a check (11 ms of a run's start)."""
    n = len(v)
    k = n // 2
    x = (n - 1) * (99 / 100)  # the linear method's virtual index
    i = math.floor(x)
    g = x - i
    j = min(i + 1, n - 1)
    part = np.partition(v, sorted({max(k - 1, 0), k, i, j}))
    median = float(part[k]) if n % 2 else float(np.mean(part[k - 1:k + 1]))
    a, b = float(part[i]), float(part[j])
    d = b - a
    return median, (b - d * (1 - g) if g >= 0.5 else a + d * g)


def summarize(requests: Columns, itl: ItlHistogram, mem_slot_seconds: np.ndarray, duration_s: float,
              capacity_tokens: int, step_seconds: float, num_steps: int, seq_steps: int, num_preemptions: int,
              decode_steps: int = 0, decode_seq_steps: int = 0, running_request_s: float = 0.0,
              sharing: SharingCounts | None = None, shared_slot_s: float = 0.0) -> dict:
    """Every metric of one policy's run, with vLLM's serving-benchmark names (each declared in
    ``METRICS``). ``seq_steps``: sequences summed over steps; ``decode_steps``: steps that decode;
    ``decode_seq_steps``: decoding sequences summed over steps; ``running_request_s``: requests holding
    KV, integrated over time (request-seconds); ``sharing``: block sharing's counts, when the run shares
    (or copies) blocks, with ``shared_slot_s``: the slot-seconds sharing saved."""
    # nothing served (every request rejected, or arriving past the horizon): no time elapsed
    duration_s = max(duration_s, 0.0)
    status = requests["status"]
    finished = status == requests.codes("status", "finished")
    num_finished = int(finished.sum())

    def fin(column: str) -> np.ndarray:
        # NOTE: one column of the finished requests at a time (none copied when all finished), not a
        # copy of their whole table: at 10^6 requests, that was the largest allocation after the run
        values = requests[column]
        return values if num_finished == len(values) else values[finished]

    generated = fin("generated_tokens")
    out: dict[str, float | int | None] = {
        "num_requests": int(len(requests)),
        "num_finished": num_finished,
        "num_rejected": int((status == requests.codes("status", "rejected")).sum()),
        # (no deployment serves these: a plan does not hold them against one)
        "num_rejected_max_model_len": int((requests["reason"] == requests.codes("reason", "exceeds_max_model_len")).sum()),
        "num_unfinished": int((status == requests.codes("status", "unfinished")).sum()),
        "duration_s": duration_s,
        "request_throughput": num_finished / duration_s if duration_s > 0 else math.nan,
        "output_throughput": float(generated.sum()) / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": float((fin("prompt_tokens") + generated).sum()) / duration_s
        if duration_s > 0 else math.nan,
    }
    for name in ("scheduling_delay_ms", "ttft_ms", "tpot_ms", "e2el_ms"):
        v = fin(name)
        v = v[~np.isnan(v)]
        out[f"mean_{name}"] = float(v.mean()) if len(v) else math.nan
        out[f"median_{name}"], out[f"p99_{name}"] = _median_p99(v) if len(v) else (math.nan, math.nan)
    out["mean_itl_ms"] = itl.mean() * 1e3
    out["median_itl_ms"] = itl.quantile(0.5) * 1e3
    out["p99_itl_ms"] = itl.quantile(0.99) * 1e3
    out["mean_normalized_latency_s"] = _skipna_mean(fin("normalized_latency_s")) if num_finished else math.nan
    out["mean_batch_size"] = seq_steps / num_steps if num_steps else 0.0
    out["mean_decode_batch_size"] = decode_seq_steps / decode_steps if decode_steps else 0.0
    out["mean_running_requests"] = running_request_s / duration_s if duration_s > 0 else math.nan
    out["num_steps"] = int(num_steps)
    out["num_preemptions"] = int(num_preemptions)
    out["kv_capacity_tokens"] = int(capacity_tokens)
    total = mem_slot_seconds.sum()
    for name, v in zip(MEMORY_CLASSES, mem_slot_seconds):
        # a run that held no memory for any time (every request rejected, or no time elapsed): the whole
        # pool was free, so the shares still sum to 1 (free = 1, every other class 0)
        out[f"memory.{name}"] = float(v / total) if total > 0 else float(name == "free")
    out["busy_fraction"] = step_seconds / duration_s if duration_s > 0 else math.nan
    out = {k: _nan_to_none(v) for k, v in out.items()}
    if sharing is not None:
        out.update(_sharing_metrics(fin("prompt_tokens"), fin("prefix_hit_tokens"), sharing,
                                    float(mem_slot_seconds[:3].sum()), shared_slot_s))
    assert out.keys() <= METRICS.keys(), f"undeclared metrics {sorted(out.keys() - METRICS.keys())}"
    return out


def _skipna_mean(v: np.ndarray) -> float:
    """The mean of the values that are not NaN, summed as pandas' ``Series.mean`` sums them (missing ones
    as zeros, in place), so that the summary is bit for bit what it was when pandas took it."""
    missing = np.isnan(v)
    n = len(v) - int(missing.sum())
    if not n:
        return math.nan
    return float((np.where(missing, 0.0, v) if n < len(v) else v).sum() / n)


def _sharing_metrics(prompt: np.ndarray, hit: np.ndarray, c: SharingCounts, used: float, shared: float) -> dict:
    """Block sharing's figures: prefix-cache hits (``prompt``, ``hit``: the finished requests' prompt and
    prefix-hit tokens), prefill saved, copies; ``used`` and ``shared``: slot-seconds allocated, and saved
    by sharing."""
    if not c.paged:  # contiguous slabs cannot share: samples and beams are copies
        return {"memory_saved_by_sharing": 0.0, "num_slab_copies": c.num_slab_copies}
    B = c.block_size
    out = {"prefill_tokens_saved": c.prefill_tokens_saved, "num_cow_copies": c.num_cow_copies,
           "num_evicted_blocks": c.num_evicted_blocks,
           # the paper's Fig. 15 measure: 1 - blocks used with sharing / blocks without
           "memory_saved_by_sharing": shared / (used + shared) if used else None}
    if c.caching:
        out["prefix_hit_rate_tokens"] = float(hit.sum() / prompt.sum()) if prompt.sum() else None
        full = (prompt // B).sum()
        out["prefix_hit_rate_blocks"] = float((hit // B).sum() / full) if full else None
    if c.offload is not None:
        out.update(offload_metrics(c.offload))
    return out


TIMELINE_COLUMNS = ("busy_s", "seq_s", "waiting_s", "num_steps", "num_sampled", "num_prefill_tokens",
                    "num_preempted", "num_finished") + tuple(f"mem_{c}_slot_s" for c in MEMORY_CLASSES) + (
                    "num_prompt_tokens_admitted", "num_prefix_hit_tokens", "shared_slot_s",  # block sharing
                    "running_request_s")  # requests holding KV x time


# the timeline's columns that integrate over time (the rest count events)
_TIMED = tuple(i for i, c in enumerate(TIMELINE_COLUMNS) if c.endswith("_s"))


class Timeline:
    """Fixed-width time bins of what happened, in bounded memory: when more than ``max_bins`` are
    needed, neighbouring bins merge and the width doubles. Steps count in the bin where they end; their
    time (busy, batch, waiting and memory slot-seconds) and idle gaps split across bins by time (a decode
    span's steps ending in one bin are one row, whose part before the bin's start is split at the row's
    mean rates: its busy and batch time exactly, its memory to within a step's change).

    NOTE: most records fall inside one bin; they are buffered as flat rows (end time, totals) in a float
    buffer (sim/buffers.py) and binned with numpy in bulk every ``BUFFER_ROWS`` records, which costs a
    fraction of adding each record to its bin in Python. Each bin adds its rows in the order they came
    (the order sets the last bits)."""

    BUFFER_ROWS = 8192

    def __init__(self, bin_s: float = 1.0, max_bins: int = 2048) -> None:
        self.bin_s = bin_s
        self.max_bins = max_bins
        self.data = np.zeros((64, len(TIMELINE_COLUMNS)))  # one row per bin, TIMELINE_COLUMNS (room to grow)
        self.n = 0  # bins in use
        self.col = {c: i for i, c in enumerate(TIMELINE_COLUMNS)}
        self.flush_at = self.BUFFER_ROWS * (len(TIMELINE_COLUMNS) + 1)
        # buffered records: end time, then one total per column (the Recorder writes a single step's row
        # here itself: see ``add``)
        self.rows = vec[float](capacity=self.flush_at)
        self.finishes = vec[float]()  # buffered (end time, requests finished) pairs, flat

    def _index(self, t: float) -> int:
        """The bin holding time ``t``, doubling the width while more than max_bins would be needed."""
        i = int(t // self.bin_s)
        while i >= self.max_bins:
            d = self.data
            if len(d) % 2:
                d = np.vstack([d, np.zeros((1, d.shape[1]))])
            self.data = d[0::2] + d[1::2]  # bin j now covers old bins 2j and 2j+1
            self.n = (self.n + 1) // 2
            self.bin_s *= 2
            i = int(t // self.bin_s)
        if i >= len(self.data):  # grow by doubling: amortized O(1) per bin
            grown = np.zeros((max(2 * len(self.data), i + 1), self.data.shape[1]))
            grown[: len(self.data)] = self.data
            self.data = grown
        if i >= self.n:
            self.n = i + 1
        return i

    def flush(self) -> None:
        if len(self.finishes):
            f = np.frombuffer(memoryview(self.finishes), dtype=np.float64).reshape(-1, 2)
            self._index(float(f[:, 0].max()))  # room (and width) for the latest
            np.add.at(self.data[:, self.col["num_finished"]], (f[:, 0] // self.bin_s).astype(np.int64), f[:, 1])
            self.finishes = vec[float]()
        if len(self.rows) == 0:
            return
        # NOTE: np.add.at column by column, where numpy has a fast path (a 2-D add.at was 6x slower), each
        # column still summed row after row, as before
        rows = np.frombuffer(memoryview(self.rows), dtype=np.float64).reshape(-1, len(TIMELINE_COLUMNS) + 1)
        self._index(float(rows[:, 0].max()))  # room (and width) for the latest
        w = self.bin_s
        end = rows[:, 0]
        idx = (end // w).astype(np.int64)
        data = self.data
        # a row's steps run back to back from ``end - busy_s``: the part of a row's time-weighted columns before
        # its bin goes to the bins it covers there (its counts stay where it ends), so that each bin's memory
        # classes sum to its width (a step across an edge charged to one bin put up to +-60 % in each)
        start = end - rows[:, 1]
        first = np.maximum((start // w).astype(np.int64), 0)
        if (first < idx).any():
            rows = rows.copy()
            timed = np.array(_TIMED) + 1
            one = np.flatnonzero(first == idx - 1)  # across one edge (most): the share before it, in bulk
            part = rows[np.ix_(one, timed)] * ((idx[one] * w - start[one]) / rows[one, 1])[:, None]
            for k, j in enumerate(timed):
                np.add.at(data[:, j - 1], idx[one] - 1, part[:, k])
            rows[np.ix_(one, timed)] -= part
            for r in np.flatnonzero(first < idx - 1).tolist():  # longer than a bin: each bin its overlap
                s, e = float(start[r]), float(end[r])
                share = rows[r, timed] / (e - s)
                for b in range(int(first[r]), int(idx[r])):
                    part = share * (min(e, (b + 1) * w) - max(s, b * w))
                    data[b, timed - 1] += part
                    rows[r, timed] -= part
        for j in range(1, rows.shape[1]):
            np.add.at(data[:, j - 1], idx, rows[:, j])
        self.rows = vec[float](capacity=self.flush_at)

    def add(self, start_s: float, times, totals, by_bin=None) -> None:
        """A record starting at ``start_s`` lasting ``times`` (one duration per step) with ``totals``
        (one per TIMELINE_COLUMNS). Inside one bin, or a single step: the totals go to the bin where it
        ends. An idle gap (``by_bin`` None, several bins) splits by time. A longer span across bin
        edges calls ``by_bin(width)`` for (end, totals) of the steps ending in each bin it touches, and puts
        each in its bin (a wider bin later holds whole narrower ones: the split stays right)."""
        end = start_s + (times[0] if len(times) == 1 else sum(times))
        w = self.bin_s
        if start_s // w == end // w or (len(times) == 1 and totals[3]):  # one bin (at any later width too)
            self.rows = buf = _extend(append(self.rows, end), totals)
            if len(buf) >= self.flush_at:
                self.flush()
        elif by_bin is None:  # an idle gap: every column is time-weighted
            i = self._index(end)
            w = self.bin_s
            span = end - start_s
            for b in range(int(start_s // w), i + 1):
                self.data[b] += np.asarray(totals) * ((min(end, (b + 1) * w) - max(start_s, b * w)) / span)
        else:  # the steps ending in each bin, buffered, go to that bin
            buf = self.rows
            for t, row in by_bin(w):
                buf = _extend(append(buf, t), row)
            self.rows = buf
            if len(buf) >= self.flush_at:
                self.flush()

    def add_finishes(self, t: float, count: int) -> None:
        self.finishes = f = append(append(self.finishes, t), count)  # buffered like the rows
        if len(f) >= self.flush_at:
            self.flush()

    def columns(self, capacity: int, end_s: float, start_s: float = 0.0) -> Columns:
        """One row per bin from the one holding ``start_s`` (the run's first arrival): its start, the
        width of it the run covers (the first from ``start_s``, the last to ``end_s``) and sums; plus the
        time-averaged running batch, waiting queue and memory shares over that width."""
        self.flush()
        first = min(int(start_s // self.bin_s), max(self.n - 1, 0)) if start_s > 0 else 0
        data = self.data[first: self.n]
        start = np.arange(first, self.n) * self.bin_s
        w = np.minimum(self.bin_s, np.maximum(end_s - start, 1e-12))
        if len(w) and start_s > start[0]:  # the first bin from the first arrival on
            w[0] = max(w[0] - (start_s - start[0]), 1e-12)
        c = {"bin_start_s": start, "bin_s": w,
             **{name: np.ascontiguousarray(data[:, j]) for j, name in enumerate(TIMELINE_COLUMNS)}}
        c["mean_running"] = c["seq_s"] / w  # sequences in the steps, time-weighted (the batch over time)
        c["mean_running_requests"] = c["running_request_s"] / w  # requests holding KV
        c["mean_waiting"] = c["waiting_s"] / w
        for k in MEMORY_CLASSES:
            c[f"memory.{k}"] = c[f"mem_{k}_slot_s"] / (w * capacity)
        # block sharing: the share of admitted prompt tokens served by the prefix cache, and the slots
        # the same sequences would hold without sharing (as a share of the pool; may exceed 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            c["prefix_hit_rate"] = np.where(c["num_prompt_tokens_admitted"] > 0,
                                            c["num_prefix_hit_tokens"] / c["num_prompt_tokens_admitted"], np.nan)
        used = sum(c[f"mem_{k}_slot_s"] for k in USED_CLASSES)
        c["memory.used"] = used / (w * capacity)
        c["memory.used_without_sharing"] = (used + c["shared_slot_s"]) / (w * capacity)
        return Columns(c)

    def frame(self, capacity: int, end_s: float, start_s: float = 0.0):
        """``columns`` as a pandas DataFrame."""
        return self.columns(capacity, end_s, start_s).frame()


def _dot(times: list[float], x: list[int], j0: int, j1: int) -> float:
    """The time integral of a per-step count over steps ``j0 .. j1 - 1``: each step's seconds times its
    count, added in step order. NOTE: a typed loop, not ``sum(map(mul, ...))``: compiled, it makes no
    object per step (a fleet's spans have hundreds of thousands of steps)."""
    acc = 0.0
    for j in range(j0, j1):
        acc += times[j] * x[j]
    return acc


# whether this module runs compiled (sim/native.py): its functions are then builtins, not Python functions
COMPILED: Final = not isinstance(_dot, FunctionType)


def _span_rows(start_s: float, times: list[float], ends: list[float], mem, waiting: int, joins: list[int] | tuple,
               shared, holding: int, n: int, num_sampled: int, capacity, w: float) -> list[tuple[float, list]]:
    """A span's (end, TIMELINE_COLUMNS row) per bin of width ``w``, for the steps ending in it (see
    ``Recorder._span``)."""
    filled, alloc, capped, rounding, held, blocked = mem
    out = []
    k = len(times)
    j0 = 0
    while j0 < k:
        b = ends[j0] // w  # (as Timeline bins a time)
        j1 = j0 + 1
        while j1 < k and ends[j1] // w == b:
            j1 += 1
        ts = times[j0:j1]
        t = sum(ts)
        f, a, c = (_dot(times, x, j0, j1) if x.__class__ is list else x * t for x in (filled, alloc, capped))
        w_s = waiting * t
        for x in joins:  # an arrival joining after step x waits from step x on
            x = max(x, j0)
            if x < j1:
                w_s += ends[j1 - 1] - (ends[x - 1] if x else start_s)
        out.append((ends[j1 - 1], [t, n * t, w_s, j1 - j0, num_sampled * (j1 - j0), 0, 0, 0,
                                   *breakdown(capacity * t, f, a, c, rounding * t, held * t, blocked), 0, 0,
                                   _dot(times, shared, j0, j1) if shared.__class__ is list else shared * t,
                                   holding * t]))
        j0 = j1
    return out


def _extend(v: vec[float], values: Any) -> vec[float]:
    """``v`` with ``values`` (ints or floats) appended, as float64."""
    if not COMPILED:
        return extend(v, values)
    for x in values:
        v = append(v, x)
    return v


def _timeline_step_row(v: vec[float], end: float, total: float, n: float, waiting: float, sampled: float,
                       prefill: float, preempted: float, m0: float, m1: float, m2: float, m3: float, m4: float,
                       prompt: float, hit: float, shared: float, holding: float) -> vec[float]:
    """A single step's timeline row (end, then TIMELINE_COLUMNS; ``m0`` .. ``m4``: the memory classes in
    token slots) appended to ``v``. NOTE: a value at a time, with float parameters: compiled, no Python
    object is made per value (sim/buffers.py). Plain Python passes the row in one call instead (a call per
    value would cost it more than the objects it makes anyway)."""
    if not COMPILED:
        return extend(v, (end, total, n * total, waiting * total, 1.0, sampled, prefill, preempted, 0.0, m0 * total,
                          m1 * total, m2 * total, m3 * total, m4 * total, prompt, hit, shared * total, holding * total))
    v = append(v, end)
    v = append(v, total)
    v = append(v, n * total)
    v = append(v, waiting * total)
    v = append(v, 1.0)
    v = append(v, sampled)
    v = append(v, prefill)
    v = append(v, preempted)
    v = append(v, 0.0)
    v = append(v, m0 * total)
    v = append(v, m1 * total)
    v = append(v, m2 * total)
    v = append(v, m3 * total)
    v = append(v, m4 * total)
    v = append(v, prompt)
    v = append(v, hit)
    v = append(v, shared * total)
    return append(v, holding * total)


def _step_table_row(v: vec[float], index: float, start: float, total: float, n: float, prefill: float,
                    decode: float, sampled: float, pairs: float, context: float, waiting: float, running: float,
                    swapped: float, preempted: float, swap_blocks: float, m0: float, m1: float, m2: float,
                    m3: float, m4: float) -> vec[float]:
    """A single step's STEP_COLUMNS row (see ``Recorder._step_row``) appended to ``v``, as above."""
    if not COMPILED:
        return extend(v, (index, start, total, 1.0, n, prefill, decode, sampled, pairs, context, waiting, running,
                          swapped, preempted, swap_blocks, m0 * total, m1 * total, m2 * total, m3 * total,
                          m4 * total))
    v = append(v, index)
    v = append(v, start)
    v = append(v, total)
    v = append(v, 1.0)
    v = append(v, n)
    v = append(v, prefill)
    v = append(v, decode)
    v = append(v, sampled)
    v = append(v, pairs)
    v = append(v, context)
    v = append(v, waiting)
    v = append(v, running)
    v = append(v, swapped)
    v = append(v, preempted)
    v = append(v, swap_blocks)
    v = append(v, m0 * total)
    v = append(v, m1 * total)
    v = append(v, m2 * total)
    v = append(v, m3 * total)
    return append(v, m4 * total)


class Recorder:
    """Everything one policy's run records, in one place: the request log, the inter-token-latency
    histogram, the timeline, the step table and the counters the summary needs. The engine hands it each
    step (or span, or idle gap) as it is taken; the scheduler adds ITL gaps and sharing counts to it.

    Guarantees: ``num_steps`` counts every step a span stands for; a step row covers ``num_steps``
    steps from ``start_s`` for ``duration_s``; the timeline's and the step table's memory columns are
    the same time-weighted token slots."""

    STEP_ROWS = 8192

    def __init__(self, requests, capacity: int, *, timeline_bin_s: float = 1.0, record_steps: bool = True,
                 log: RequestLog | None = None) -> None:
        self.capacity = capacity
        self.record_steps = record_steps
        # ``log``: one request log shared by the replicas of a fleet (each request is served by one of them)
        self.log = log if log is not None else RequestLog(requests.arrival_s, requests.prompt_tokens,
                                                          requests.output_tokens)
        self.itl = ItlHistogram()  # the scheduler adds each gap between a request's output tokens
        self.timeline = Timeline(timeline_bin_s)
        # step records, row after row: a float buffer (sim/buffers.py) taken as a float64 chunk every STEP_ROWS rows
        self.steps = vec[float](capacity=self.STEP_ROWS * len(STEP_COLUMNS) if record_steps else 0)
        self._step_chunks: list[np.ndarray] = []
        self.num_steps = 0
        self.seq_steps = 0  # sequences summed over steps
        self.decode_steps = 0  # steps in which some sequence decodes
        self.decode_seq_steps = 0  # decoding sequences summed over steps
        self.running_request_s = 0.0  # requests holding KV, integrated over time
        # block sharing, counted by the scheduler
        self.prefill_tokens_saved = 0  # prompt tokens served from the prefix cache, over all admissions
        self.num_slab_copies = 0  # contiguous: forks and beam moves copied between slabs
        self.groups: Any = None  # several KV groups: a hybrid.GroupTimeline the engine sets (kv_groups.parquet)

    def idle(self, start_s: float, duration_s: float, mem, *, num_waiting: int, num_running: int,
             num_swapped: int, shared_slots: int, holding: int = 0) -> None:
        """An idle gap: nothing runs; ``mem``: the five memory classes (token slots); ``holding``: requests
        holding KV all the same (a disaggregated replica's, waiting for their transfer)."""
        slot_s = [m * duration_s for m in mem]
        waiting_s = num_waiting * duration_s
        if self.groups is not None:
            self.groups.add(start_s, duration_s)
        self.running_request_s += holding * duration_s
        row = dict.fromkeys(TIMELINE_COLUMNS, 0.0)
        row.update({"waiting_s": waiting_s, "shared_slot_s": shared_slots * duration_s,
                    "running_request_s": holding * duration_s,
                    **{f"mem_{c}_slot_s": v for c, v in zip(MEMORY_CLASSES, slot_s)}})
        self.timeline.add(start_s, [duration_s], list(row.values()))
        if self.record_steps:
            self._step_row(start_s, [duration_s], 0, (0, 0, 0, 0, 0, 0, num_waiting, num_running, num_swapped, 0, 0),
                           slot_s)

    def step(self, start_s: float, times: list[float], plan: StepPlan, mem, num_waiting: int, num_running: int,
             num_swapped: int, shared_slots, holding: int, prompt_tokens: int, hit_tokens: int,
             ends: list[float] | None = None, joins: list[int] | tuple = ()) -> None:
        """One step (``mem``: the five memory classes), or a span of ``len(times)`` decode steps ending at
        ``ends`` (``mem``: what ``Scheduler.complete_span`` returns; ``joins``: the steps after which
        arrivals during the span joined the waiting queue, as stepping would add them). ``holding``:
        requests holding KV; ``prompt_tokens``, ``hit_tokens``: prompts first admitted in the step and
        their prefix-cache hits. NOTE: the engine calls this once per event, positionally (keywords cost)."""
        n = plan.num_seqs
        if ends is None:  # one step: the common event, kept lean
            total = times[0]
            m0, m1, m2, m3, m4 = mem
            # Timeline.add's single-step case, inlined: the row goes to the bin where the step ends
            tl = self.timeline
            tl.rows = rows = _timeline_step_row(
                tl.rows, start_s + total, total, n, num_waiting, plan.num_sampled, plan.num_prefill_tokens,
                plan.num_preempted, m0, m1, m2, m3, m4, prompt_tokens, hit_tokens, shared_slots, holding)
            if len(rows) >= tl.flush_at:
                tl.flush()
            self.num_steps += 1
            self.seq_steps += n
            if plan.num_decode_tokens:
                self.decode_steps += 1
                self.decode_seq_steps += plan.num_decode_tokens
            self.running_request_s += holding * total
            if self.groups is not None:
                self.groups.add(start_s, total)
            if self.record_steps:
                self.steps = steps = _step_table_row(
                    self.steps, self.num_steps - 1, start_s, total, n, plan.num_prefill_tokens,
                    plan.num_decode_tokens, plan.num_sampled, plan.prefill_attention_pairs,
                    plan.decode_context_tokens, num_waiting, num_running, num_swapped, plan.num_preempted,
                    len(plan.swap_in) + len(plan.swap_out), m0, m1, m2, m3, m4)
                if len(steps) >= self.STEP_ROWS * len(STEP_COLUMNS):
                    self._step_chunk()
            return
        k, total, slot_s = self._span(start_s, times, plan, mem, num_waiting, shared_slots, holding, prompt_tokens,
                                      hit_tokens, ends, joins)
        self.num_steps += k
        self.seq_steps += k * n
        if plan.num_decode_tokens:
            self.decode_steps += k
            self.decode_seq_steps += k * plan.num_decode_tokens
        self.running_request_s += holding * total
        if self.groups is not None:
            self.groups.add(start_s, total)
        if self.record_steps:
            self._step_row(start_s, times, k, (
                n, plan.num_prefill_tokens, plan.num_decode_tokens, plan.num_sampled,
                plan.prefill_attention_pairs, plan.decode_context_tokens, num_waiting, num_running, num_swapped,
                plan.num_preempted, len(plan.swap_in) + len(plan.swap_out)), slot_s, total)

    def _span(self, start_s: float, times: list[float], plan: StepPlan, mem, waiting: int, shared_slots, holding: int,
              prompt_tokens: int, hit_tokens: int, ends: list[float], joins: list[int] | tuple) -> tuple:
        """A span's timeline rows (see ``step``); returns (steps, seconds, memory slot-seconds)."""
        k, n = len(times), plan.num_seqs
        total = sum(times)
        filled, alloc, capped, rounding, held, blocked = mem
        # the classes are linear in (filled, alloc, capped): integrate those over the span's steps
        f, a, c = (_dot(times, x, 0, k) if x.__class__ is list else x * total for x in (filled, alloc, capped))
        slot_s = breakdown(self.capacity * total, f, a, c, rounding * total, held * total, blocked)
        waiting_s = waiting * total
        for j in joins:
            waiting_s += ends[-1] - ends[j - 1]
        capacity = self.capacity
        shared = shared_slots  # a list along a span whose shared pages leave windows (sim/hybrid.py)
        shared_s = _dot(times, shared, 0, k) if shared.__class__ is list else shared * total
        # TIMELINE_COLUMNS, in order
        totals = [total, n * total, waiting_s, k, plan.num_sampled * k, plan.num_prefill_tokens * k,
                  plan.num_preempted, 0, *slot_s, prompt_tokens, hit_tokens, shared_s, holding * total]
        # only for a span across a bin edge (Timeline.add calls it): a row per bin. NOTE: a partial, not a
        # closure: a compiled build (sim/native.py) would make each closure a reference cycle
        by_bin = partial(_span_rows, start_s, times, ends, mem, waiting, joins, shared, holding, n, plan.num_sampled,
                         capacity)
        self.timeline.add(start_s, times, totals, by_bin)
        return k, total, slot_s

    def _step_row(self, start_s: float, times: list[float], k: int, shape: tuple, slot_s, total=None) -> None:
        """STEP_COLUMNS, in order: index, start, duration, steps, then ``shape`` (num_seqs .. num_swap_blocks)
        and the memory classes as token slot-seconds (``step_columns`` divides them by the duration)."""
        if total is None:
            total = times[0]
        self.steps = steps = _extend(_extend(_extend(self.steps, (self.num_steps - k, start_s, total, k)), shape), slot_s)
        if len(steps) >= self.STEP_ROWS * len(STEP_COLUMNS):
            self._step_chunk()

    def _step_chunk(self) -> None:
        self._step_chunks.append(np.frombuffer(memoryview(self.steps), dtype=np.float64))
        self.steps = vec[float](capacity=self.STEP_ROWS * len(STEP_COLUMNS))

    def finished(self, end_s: float, done: list[tuple[Sequence, float]]) -> None:
        """Requests that finished at ``end_s`` (each ``(sequence, its own end)``)."""
        self.timeline.add_finishes(end_s, len(done))
        for seq, t in done:
            self.log.finish(seq, t)

    def step_columns(self) -> Columns:
        """One row per step (``STEP_COLUMNS``; the counts as integers)."""
        rows = np.concatenate([*self._step_chunks, np.frombuffer(memoryview(self.steps), dtype=np.float64)])
        rows = rows.reshape(-1, len(STEP_COLUMNS))
        mem, duration = rows[:, -len(MEMORY_CLASSES):], rows[:, 2:3]  # slot-seconds to mean token slots
        with np.errstate(divide="ignore", invalid="ignore"):
            mem[...] = np.where(duration > 0, mem / duration, mem)
        return Columns({c: rows[:, j].astype(np.int64) if c.startswith("num_") or c in STEP_COUNTS
                        else np.ascontiguousarray(rows[:, j]) for j, c in enumerate(STEP_COLUMNS)})

    def results(self, first_arrival_s: float, end_s: float, sharing: SharingCounts | None,
                requests: Any = None) -> tuple[Any, Columns, Columns, dict]:
        """(requests, steps, timeline, summary) of the finished run, as ``Columns``; ``requests``: the rows
        of a shared log that this recorder's server handled (a fleet's replica, a DataFrame), else the
        whole log."""
        self.log.flush()
        lost = int((self.log.status == PENDING).sum())
        if lost:  # the accounting identity is a guarantee: never end a run without it
            raise RuntimeError(f"{lost} requests neither finished, rejected nor unfinished: a bug, please report it")
        req = self.log.columns() if requests is None else requests
        timeline = self.timeline.columns(self.capacity, end_s, first_arrival_s)
        mem_slot_s = np.array([timeline[f"mem_{c}_slot_s"].sum() for c in MEMORY_CLASSES])
        summary = summarize(Columns.of(req), self.itl, mem_slot_s, end_s - first_arrival_s, self.capacity,
                            float(timeline["busy_s"].sum()), self.num_steps, self.seq_steps,
                            int(timeline["num_preempted"].sum()), decode_steps=self.decode_steps,
                            decode_seq_steps=self.decode_seq_steps, running_request_s=self.running_request_s,
                            sharing=sharing, shared_slot_s=float(timeline["shared_slot_s"].sum()))
        return req, self.step_columns(), timeline, summary
