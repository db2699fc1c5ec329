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

Every summary metric is declared once, in ``METRICS`` (name, unit, label, which way is better); the
console, the report, sweeps and the decomposition read it.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

from sim.kv import MEMORY_CLASSES

PENDING, FINISHED, REJECTED, UNFINISHED = 0, 1, 2, 3
STATUS_NAMES = {PENDING: "pending", FINISHED: "finished", REJECTED: "rejected", UNFINISHED: "unfinished"}
REASONS = {
    0: "",
    1: "exceeds_max_model_len",
    2: "exceeds_kv_pool",
    3: "prefill_exceeds_token_budget",
    4: "horizon",
}


@dataclass(frozen=True)
class Metric:
    """One summary metric: its key in ``summary.json``, its unit, a short label, and which way is better
    (``max``, ``min``, or None where neither is)."""

    name: str
    unit: str
    label: str
    better: Literal["max", "min"] | None = None


def _declare(*metrics: Metric) -> dict[str, Metric]:
    return {m.name: m for m in metrics}


_LATENCIES = (("scheduling_delay_ms", "scheduling delay"), ("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
              ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))

METRICS: dict[str, Metric] = _declare(
    Metric("num_requests", "requests", "requests"),
    Metric("num_finished", "requests", "finished", "max"),
    Metric("num_rejected", "requests", "rejected", "min"),
    Metric("num_unfinished", "requests", "unfinished", "min"),
    Metric("duration_s", "s", "duration"),
    Metric("request_throughput", "req/s", "request throughput", "max"),
    Metric("output_throughput", "tok/s", "output throughput", "max"),
    Metric("total_token_throughput", "tok/s", "total token throughput", "max"),
    *(Metric(f"{stat}_{key}", "ms", f"{stat} {label}", "min")
      for key, label in _LATENCIES for stat in ("mean", "median", "p99")),
    Metric("mean_normalized_latency_s", "s/token", "mean normalized latency", "min"),
    Metric("mean_batch_size", "sequences", "mean batch", "max"),
    Metric("mean_decode_batch_size", "sequences", "mean decode batch", "max"),
    Metric("mean_running_requests", "requests", "mean running requests"),
    Metric("num_steps", "steps", "steps"),
    Metric("num_preemptions", "preemptions", "preemptions", "min"),
    Metric("kv_capacity_tokens", "tokens", "KV capacity"),
    *(Metric(f"memory.{c}", "share", f"KV in {c.replace('_', ' ')}", "max" if c == "token_states" else None)
      for c in MEMORY_CLASSES),
    Metric("busy_fraction", "share", "busy fraction"),
    # block sharing (paged policies that share blocks; contiguous ones with samples or beams)
    Metric("prefill_tokens_saved", "tokens", "prefill tokens saved", "max"),
    Metric("num_cow_copies", "blocks", "copy-on-write block copies", "min"),
    Metric("num_evicted_blocks", "blocks", "evicted cached blocks"),
    Metric("memory_saved_by_sharing", "share", "memory saved by sharing", "max"),
    Metric("prefix_hit_rate_tokens", "share", "prefix hit rate (tokens)", "max"),
    Metric("prefix_hit_rate_blocks", "share", "prefix hit rate (blocks)", "max"),
    Metric("num_slab_copies", "copies", "slab copies (contiguous forks)", "min"),
)


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

    def _common(self, seq) -> None:
        """Per request: a group's tokens are all its samples' or beams' tokens."""
        i = seq.request_id
        self.num_preemptions[i] = seq.num_preemptions
        g = seq.group
        self.generated_tokens[i] = sum(m.num_output_tokens for m in g.members) if g else seq.num_output_tokens
        self.prefix_hit_tokens[i] = seq.prefix_hit_tokens or 0

    def scheduled(self, request_id: int, start_s: float) -> None:
        """The step starting at ``start_s`` is the first to schedule request ``request_id``."""
        self.first_scheduled_s[request_id] = start_s

    def finish(self, seq, end_s: float) -> None:
        i = seq.request_id
        self.status[i] = FINISHED
        self.first_token_s[i] = seq.first_token_s
        self.finish_s[i] = end_s
        self._common(seq)

    def unfinished(self, seq, reason: int) -> None:
        i = seq.request_id
        self.status[i] = UNFINISHED
        self.reason[i] = reason
        if seq.first_token_s is not None:
            self.first_token_s[i] = seq.first_token_s
        self._common(seq)

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame({
            "request_id": np.arange(len(self.arrival_s)),
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "status": pd.Categorical.from_codes(self.status, list(STATUS_NAMES.values())),
            "reason": pd.Categorical.from_codes(self.reason, list(REASONS.values())),
            "first_scheduled_s": self.first_scheduled_s,
            "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
            "num_preemptions": self.num_preemptions,
            "generated_tokens": self.generated_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        })
        df["scheduling_delay_ms"] = (df.first_scheduled_s - df.arrival_s) * 1e3
        df["ttft_ms"] = (df.first_token_s - df.arrival_s) * 1e3
        df["e2el_ms"] = (df.finish_s - df.arrival_s) * 1e3
        with np.errstate(divide="ignore", invalid="ignore"):
            df["tpot_ms"] = np.where(df.output_tokens > 1, (df.e2el_ms - df.ttft_ms) / (df.output_tokens - 1), np.nan)
        df["normalized_latency_s"] = df.e2el_ms / 1e3 / df.output_tokens
        return df


class ItlHistogram:
    """Inter-token latencies in log-spaced bins 0.23 % wide from 0.1 us to 1e5 s, with their exact
    count and sum: percentiles to bin precision, the mean exact, memory independent of run length.
    Values are buffered and binned in bulk (cheap per call)."""

    LO, PER_DECADE, DECADES = 1e-7, 1000, 12

    def __init__(self) -> None:
        self.counts = np.zeros(self.PER_DECADE * self.DECADES + 1, dtype=np.float64)
        self.count = 0.0
        self.total = 0.0
        self._values: list[float] = []
        self._weights: list[int] = []

    def add(self, value: float, times: int = 1) -> None:
        """``value`` seen ``times`` times."""
        self._values.append(value)
        self._weights.append(times)
        if len(self._values) >= 16384:
            self._flush()

    def add_each(self, values: list[float], times: int) -> None:
        """Each of ``values`` seen ``times`` times."""
        self._values.extend(values)
        self._weights.extend([times] * len(values))
        if len(self._values) >= 16384:
            self._flush()

    def _flush(self) -> None:
        if not self._values:
            return
        v, w = np.asarray(self._values), np.asarray(self._weights, dtype=np.float64)
        with np.errstate(divide="ignore"):
            i = np.floor(np.log10(np.maximum(v, self.LO) / self.LO) * self.PER_DECADE)
        i = np.clip(i, 0, len(self.counts) - 1).astype(np.int64)
        self.counts += np.bincount(i, weights=w, minlength=len(self.counts))
        self.count += float(w.sum())
        # NOTE: an exactly rounded sum, not v @ w: BLAS's dot product rounds differently with the arrays'
        # memory alignment, so the same run gave a different last bit in another process (a sweep's local
        # and Ray executors must give identical tables)
        self.total += math.fsum((v * w).tolist())
        self._values, self._weights = [], []

    def mean(self) -> float:
        self._flush()
        return self.total / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Value at quantile q (0..1): the geometric centre of the bin holding it."""
        self._flush()
        if not self.count:
            return math.nan
        i = int(np.searchsorted(np.cumsum(self.counts), q * self.count, side="left"))
        return self.LO * 10 ** ((min(i, len(self.counts) - 1) + 0.5) / self.PER_DECADE)


# One row per record: a single step, a run of `num_steps` decode steps taken as one span (token counts
# are per step, context tokens at the first step), or an idle gap (num_steps = 0). Memory columns are
# time-weighted token slots over the record.
STEP_COLUMNS = ("step_index", "start_s", "duration_s", "num_steps", "num_seqs", "num_prefill_tokens",
                "num_decode_tokens", "num_sampled", "prefill_attention_pairs", "num_context_tokens", "num_waiting",
                "num_running", "num_swapped", "num_preempted", "num_swap_blocks") + tuple(f"mem_{c}" for c in MEMORY_CLASSES)


def _nan_to_none(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def summarize(requests: pd.DataFrame, itl: ItlHistogram, mem_slot_seconds: np.ndarray, duration_s: float,
              capacity_tokens: int, step_seconds: float, num_steps: int, seq_steps: int, num_preemptions: int,
              decode_steps: int = 0, decode_seq_steps: int = 0, running_request_s: float = 0.0) -> dict:
    """The headline metrics of one policy's run, with vLLM's serving-benchmark names (declared in
    ``METRICS``). ``seq_steps``: sequences summed over steps; ``decode_steps``: steps that decode;
    ``decode_seq_steps``: decoding sequences summed over steps; ``running_request_s``: requests holding
    KV, integrated over time (request-seconds)."""
    fin = requests[requests.status == "finished"]
    out: dict[str, float | int | None] = {
        "num_requests": int(len(requests)),
        "num_finished": int(len(fin)),
        "num_rejected": int((requests.status == "rejected").sum()),
        "num_unfinished": int((requests.status == "unfinished").sum()),
        "duration_s": duration_s,
        "request_throughput": len(fin) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": float(fin.generated_tokens.sum()) / duration_s if duration_s > 0 else math.nan,
        "total_token_throughput": float((fin.prompt_tokens + fin.generated_tokens).sum()) / duration_s
        if duration_s > 0 else math.nan,
    }
    for name in ("scheduling_delay_ms", "ttft_ms", "tpot_ms", "e2el_ms"):
        v = fin[name].dropna().to_numpy()
        out[f"mean_{name}"] = float(v.mean()) if len(v) else math.nan
        out[f"median_{name}"] = float(np.median(v)) if len(v) else math.nan
        out[f"p99_{name}"] = float(np.percentile(v, 99)) if len(v) else math.nan
    out["mean_itl_ms"] = itl.mean() * 1e3
    out["median_itl_ms"] = itl.quantile(0.5) * 1e3
    out["p99_itl_ms"] = itl.quantile(0.99) * 1e3
    out["mean_normalized_latency_s"] = float(fin.normalized_latency_s.mean()) if len(fin) else math.nan
    out["mean_batch_size"] = seq_steps / num_steps if num_steps else 0.0
    out["mean_decode_batch_size"] = decode_seq_steps / decode_steps if decode_steps else 0.0
    out["mean_running_requests"] = running_request_s / duration_s if duration_s > 0 else math.nan
    out["num_steps"] = int(num_steps)
    out["num_preemptions"] = int(num_preemptions)
    out["kv_capacity_tokens"] = int(capacity_tokens)
    total = mem_slot_seconds.sum()
    for name, v in zip(MEMORY_CLASSES, mem_slot_seconds):
        out[f"memory.{name}"] = float(v / total) if total > 0 else math.nan
    out["busy_fraction"] = step_seconds / duration_s if duration_s > 0 else math.nan
    return {k: _nan_to_none(v) for k, v in out.items()}


TIMELINE_COLUMNS = ("busy_s", "seq_s", "waiting_s", "num_steps", "num_sampled", "num_prefill_tokens",
                    "num_preempted", "num_finished") + tuple(f"mem_{c}_slot_s" for c in MEMORY_CLASSES) + (
                    "num_prompt_tokens_admitted", "num_prefix_hit_tokens", "shared_slot_s",  # block sharing
                    "running_request_s")  # requests holding KV x time


class Timeline:
    """Fixed-width time bins of what happened, in bounded memory: when more than ``max_bins`` are
    needed, neighbouring bins merge and the width doubles. Steps count in the bin where they end;
    idle gaps split across bins by time.

    NOTE: most records fall inside one bin; they are buffered as flat rows (end time, totals) and
    binned with numpy in bulk every ``BUFFER_ROWS`` records, which costs a fraction of adding each
    record to its bin in Python. Bins are sums, so the order of adding does not matter."""

    BUFFER_ROWS = 65536

    def __init__(self, bin_s: float = 1.0, max_bins: int = 2048) -> None:
        self.bin_s = bin_s
        self.max_bins = max_bins
        self.data = np.zeros((64, len(TIMELINE_COLUMNS)))  # one row per bin, TIMELINE_COLUMNS (room to grow)
        self.n = 0  # bins in use
        self.col = {c: i for i, c in enumerate(TIMELINE_COLUMNS)}
        self._buf = array("d")  # buffered records: end time, then one total per column
        self._flush_at = self.BUFFER_ROWS * (len(TIMELINE_COLUMNS) + 1)

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

    def _flush(self) -> None:
        if not self._buf:
            return
        rows = np.frombuffer(self._buf, dtype=np.float64).reshape(-1, len(TIMELINE_COLUMNS) + 1)
        self._index(float(rows[:, 0].max()))  # room (and width) for the latest
        idx = (rows[:, 0] // self.bin_s).astype(np.int64)
        np.add.at(self.data, idx, rows[:, 1:])
        self._buf = array("d")

    def add(self, start_s: float, times: list[float], totals: list[float], per_step=None) -> None:
        """A record starting at ``start_s`` lasting ``times`` (one duration per step) with ``totals``
        (one per TIMELINE_COLUMNS). Inside one bin, or a single step: the totals go to the bin where it
        ends. An idle gap (``per_step`` None, several bins) splits by time. A longer span across bin
        edges calls ``per_step()`` for its per-step rows and puts each in the bin where it ends."""
        end = start_s + (times[0] if len(times) == 1 else sum(times))
        w = self.bin_s
        if start_s // w == end // w or (len(times) == 1 and totals[3]):  # one bin (at any later width too)
            buf = self._buf
            buf.append(end)
            buf.extend(totals)
            if len(buf) >= self._flush_at:
                self._flush()
        elif per_step is None:  # an idle gap: every column is time-weighted
            i = self._index(end)
            w = self.bin_s
            span = end - start_s
            for b in range(int(start_s // w), i + 1):
                self.data[b] += np.asarray(totals) * ((min(end, (b + 1) * w) - max(start_s, b * w)) / span)
        else:  # each step, buffered, goes to the bin where it ends
            t, buf = start_s, self._buf
            for dt, step in zip(times, per_step()):
                t += dt
                buf.append(t)
                buf.extend(step)
            if len(buf) >= self._flush_at:
                self._flush()

    def add_finishes(self, t: float, count: int) -> None:
        i = self._index(t)  # first: it may replace self.data
        self.data[i, self.col["num_finished"]] += count

    def frame(self, capacity: int, end_s: float) -> pd.DataFrame:
        """One row per bin: its start, width (the last one ends at ``end_s``) and sums; plus the
        time-averaged running batch, waiting queue and memory shares."""
        self._flush()
        df = pd.DataFrame(self.data[: self.n], columns=list(TIMELINE_COLUMNS))
        start = np.arange(self.n) * self.bin_s
        df.insert(0, "bin_start_s", start)
        w = np.minimum(self.bin_s, np.maximum(end_s - start, 1e-12))
        df.insert(1, "bin_s", w)
        df["mean_running"] = df.seq_s / w  # sequences in the steps, time-weighted (the batch over time)
        df["mean_running_requests"] = df.running_request_s / w  # requests holding KV
        df["mean_waiting"] = df.waiting_s / w
        for k in MEMORY_CLASSES:
            df[f"memory.{k}"] = df[f"mem_{k}_slot_s"] / (w * capacity)
        # block sharing: the share of admitted prompt tokens served by the prefix cache, and the slots
        # the same sequences would hold without sharing (as a share of the pool; may exceed 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            df["prefix_hit_rate"] = np.where(df.num_prompt_tokens_admitted > 0,
                                             df.num_prefix_hit_tokens / df.num_prompt_tokens_admitted, np.nan)
        used = sum(df[f"mem_{k}_slot_s"] for k in MEMORY_CLASSES[:3])
        df["memory.used"] = used / (w * capacity)
        df["memory.used_without_sharing"] = (used + df.shared_slot_s) / (w * capacity)
        return df
