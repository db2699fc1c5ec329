"""The result files' schema, shared by the simulator (which writes them) and the reports (which read them):
the summary metrics (name, unit, label, which way is better), the KV memory classes, the request status
and reason codes, and the labels of the other columns a report draws (per-request latencies, sweep axes,
capacity). Declared once here; nothing here imports anything of the simulator, so ``reports`` can read it
without loading the simulator (see the README's Architecture section).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# ------------------------------------------------------------------------------------------ result folders

# The file that marks a result folder as a command's (``sim.outputs.claim``; the report tells them apart by it)
RUN_MARK, SWEEP_MARK, PLAN_MARK = "summary.json", "sweep.json", "plan.json"
FOLDER_MARKS = {"run": RUN_MARK, "sweep": SWEEP_MARK, "plan": PLAN_MARK, "validate": "validation.json"}

# ------------------------------------------------------------------------------------------ KV memory

# what each KV slot holds at an instant (kv_snapshots.parquet ``memory_class``; summary ``memory.<class>``)
MEMORY_CLASSES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
# the slots a sequence holds (KV in use: what a router's least-kv reads, a replica's "memory.used")
USED_CLASSES = MEMORY_CLASSES[:3]

# ------------------------------------------------------------------------------------------ requests

# a request's status and reason codes (int8 columns while running; named categories in requests.parquet)
PENDING, FINISHED, REJECTED, UNFINISHED = 0, 1, 2, 3
STATUS_NAMES = {PENDING: "pending", FINISHED: "finished", REJECTED: "rejected", UNFINISHED: "unfinished"}
NO_REASON, EXCEEDS_MAX_MODEL_LEN, EXCEEDS_KV_POOL, PREFILL_EXCEEDS_TOKEN_BUDGET, HORIZON = 0, 1, 2, 3, 4
REASONS = {
    NO_REASON: "",
    EXCEEDS_MAX_MODEL_LEN: "exceeds_max_model_len",
    EXCEEDS_KV_POOL: "exceeds_kv_pool",
    PREFILL_EXCEEDS_TOKEN_BUDGET: "prefill_exceeds_token_budget",
    HORIZON: "horizon",
}

# ------------------------------------------------------------------------------------------ metrics


@dataclass(frozen=True)
class Metric:
    """One column or summary metric: its name, its unit ("" for a count of nothing in particular), a label,
    which way is better (``max``, ``min``, or None where neither is), and for a narrow table (the console)
    a shorter label and unit (a line break allowed), where they differ."""

    name: str
    unit: str
    label: str
    better: Literal["max", "min"] | None = None
    short: str | None = None
    short_unit: str | None = None

    @property
    def title(self) -> str:
        """``label (unit)``; the label alone without a unit."""
        return f"{self.label} ({self.unit})" if self.unit else self.label


def _declare(*metrics: Metric) -> dict[str, Metric]:
    return {m.name: m for m in metrics}


_LATENCIES = (("scheduling_delay_ms", "scheduling delay"), ("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"),
              ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))

# Every summary metric (summary.json ``policies.<name>``), in the order a summary lists them; a sweep's
# columns and SLO keys, the console, the report and the decomposition read it.
METRICS: dict[str, Metric] = _declare(
    Metric("num_requests", "requests", "requests"),
    Metric("num_finished", "requests", "finished", "max"),
    Metric("num_rejected", "requests", "rejected", "min"),
    Metric("num_rejected_max_model_len", "requests", "rejected: longer than the model's max length", "min"),
    Metric("num_unfinished", "requests", "unfinished", "min"),
    Metric("duration_s", "s", "duration"),
    Metric("request_throughput", "req/s", "request throughput", "max", short="throughput"),
    Metric("output_throughput", "tok/s", "output throughput", "max", short="output"),
    Metric("total_token_throughput", "tok/s", "total token throughput", "max"),
    *(Metric(f"{stat}_{key}", "ms", f"{stat} {label}", "min", short=f"{stat}\n{label}")
      for key, label in _LATENCIES for stat in ("mean", "median", "p99")),
    Metric("mean_normalized_latency_s", "s/token", "mean normalized latency", "min", short="mean norm.\nlatency"),
    Metric("mean_batch_size", "sequences", "mean batch", "max", short="mean\nbatch", short_unit="seqs"),
    Metric("mean_decode_batch_size", "sequences", "mean decode batch", "max"),
    Metric("mean_running_requests", "requests", "mean running requests"),
    Metric("num_steps", "steps", "steps"),
    Metric("num_preemptions", "preemptions", "preemptions", "min", short="preempt-\nions", short_unit="count"),
    Metric("kv_capacity_tokens", "tokens", "KV capacity"),
    *(Metric(f"memory.{c}", "share", f"KV in {c.replace('_', ' ')}", "max" if c == "token_states" else None,
             short="KV in\ntokens" if c == "token_states" else None, short_unit="mean %")
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
    # the prefix cache's CPU tier (kv_offload; sim/offload.py): hits over every request's first admission
    Metric("prefix_hit_rate_gpu", "share", "prefix hits on the GPU (tokens)", "max"),
    Metric("prefix_hit_rate_cpu", "share", "prefix hits on the CPU tier (tokens)", "max"),
    Metric("prefill_tokens_saved_cpu", "tokens", "prefill tokens the CPU tier saved", "max"),
    Metric("host_to_device_bytes", "bytes", "CPU tier loads (host to device)"),
    Metric("device_to_host_bytes", "bytes", "CPU tier stores (device to host)"),
)

# ------------------------------------------------------------------------------------------ other columns

# A sweep's (and a plan's) request-rate axis: a generated workload's rate, or a trace's scaling of its own
RATE_AXIS, RATE_SCALE_AXIS = "workload.arrival.rate", "workload.rate_scale"

# Per-request columns a report draws (requests.parquet), sweep axes (scenario fields, by their last dotted
# part too: ``policies.*.block_size`` is a block size) and capacity results (capacity.parquet).
TABLE_COLUMNS: dict[str, Metric] = _declare(
    Metric("ttft_ms", "ms", "time to first token", "min", short="TTFT"),
    Metric("tpot_ms", "ms", "time per output token", "min", short="TPOT"),
    Metric("e2el_ms", "ms", "end-to-end latency", "min", short="E2E latency"),
    Metric("normalized_latency_s", "s/token", "normalized latency", "min", short="normalized latency"),
    Metric(RATE_AXIS, "req/s", "request rate"),
    Metric("block_size", "tokens", "block size"),
    Metric("max_num_seqs", "", "max sequences per step"),
    Metric("max_num_batched_tokens", "tokens", "token budget per step"),
    Metric("gpu_memory_utilization", "share", "GPU memory utilization"),
    Metric("tensor_parallel", "", "tensor-parallel GPUs"),
    Metric("swap_space_gib", "GiB", "swap space"),
    Metric("sustainable_request_rate", "req/s", "sustainable request rate", "max", short="sustainable"),
)

# The columns of sweep.parquet, capacity.parquet and capacity_runs.parquet that are results, not axes
# (every summary metric is one too): the other columns are the swept scenario fields and ``seed``.
SWEEP_RESULT_COLUMNS = ("policy", "offered_request_rate", "point_key", "error")
CAPACITY_RESULT_COLUMNS = ("policy", "axis", "sustainable_request_rate", "sustainable_value", "met", "status", "slo",
                           "tolerance", "relative_tolerance", "lowest_rate_tried", "highest_rate_tried",
                           "lowest_failing_rate", "num_runs", "error", "value", "offered_request_rate", "point_key")


def column(name: str) -> Metric | None:
    """The declaration of a summary metric or a column, by its name or (an axis path) its last dotted part."""
    return METRICS.get(name) or TABLE_COLUMNS.get(name) or TABLE_COLUMNS.get(str(name).split(".")[-1])


def title(name: str) -> str:
    """An axis or column title with its unit, from the declarations; an undeclared column by its name."""
    m = column(name)
    return m.title if m is not None else str(name)


def is_result_column(name: str) -> bool:
    """A column of a sweep or capacity table that holds a result (not a swept scenario field or the seed)."""
    return name in METRICS or name in SWEEP_RESULT_COLUMNS or name in CAPACITY_RESULT_COLUMNS


def varying_axes(table) -> list[str]:
    """The columns of a sweep or capacity table (pandas) that are swept scenario fields or the seed, and
    vary. A ``policies`` axis (which policies run) counts only where it tells apart rows of the same
    ``policy`` (e.g. ``vllm`` at two block sizes): when each policy runs under one value of it, the
    ``policy`` column already says it."""
    cols = [c for c in table.columns if not is_result_column(str(c)) and table[c].nunique(dropna=False) > 1]
    if "policies" in cols and "policy" in table.columns and (
            table.groupby("policy", dropna=False)["policies"].nunique(dropna=False) <= 1).all():
        cols.remove("policies")
    return cols


def plan_label(row) -> str:
    """A configuration of a plan table (plan.parquet, best.csv; a row as a mapping) in words:
    ``2 x h100 tp1 vllm``, or ``1+3 x h100 tp1 vllm`` for 1 prefill and 3 decode replicas, then the plan's
    knobs where it has them (``max_num_seqs=128``): two rows differing only in them read apart."""
    pre = row.get("prefill_replicas")
    count = f"{int(pre)}+{int(row['decode_replicas'])}" if pre is not None and pre == pre else f"{row['replicas']}"
    knobs = "".join(f" {k}={int(v)}" for k in ("max_num_seqs", "block_size")
                    if (v := row.get(k)) is not None and v == v)  # a plan's knobs, where it has them
    return f"{count} x {row['gpu']} tp{row['tensor_parallel']} {row['policy']}{knobs}"


def sig4(v: float, signed: bool = False) -> str:
    """A value in 4 significant digits that keeps them (1.000245 reads 1.000, not 1), thousands separated
    (6,949), whole from 10,000 up; ``signed``: with its sign."""
    if not math.isfinite(v):
        return "-"
    sign = "+" if signed else ""
    a = abs(v)
    if a >= 1e4 or a == 0:
        return f"{v:{sign},.0f}"
    if a < 1e-3:
        return f"{v:{sign}.4g}"
    digits = max(0, 3 - math.floor(math.log10(a)))
    if abs(round(v, digits)) >= 10 ** (4 - digits):  # rounding carried into a new digit: 9.99996 -> 10.00
        digits = max(0, digits - 1)
    return f"{v:{sign},.{digits}f}"


def plural(n: int, word: str) -> str:
    """``1 request``, ``2 requests``, ``1,000 requests``: a count and its noun, for what is printed."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


# The Arrow type of every result column of sweep.parquet, capacity.parquet, capacity_runs.parquet and
# plan.parquet, whatever the rows hold (a metric no row has is a column of nulls of its type, not of
# Arrow's ``null`` type): counts int64, other metrics float64. Axis columns (scenario fields) keep the
# type of their values.
COUNT_METRICS = frozenset({n for n in METRICS if n.startswith("num_")} | {
    "kv_capacity_tokens", "prefill_tokens_saved", "prefill_tokens_saved_cpu", "host_to_device_bytes",
    "device_to_host_bytes"})
RESULT_COLUMN_TYPES: dict[str, str] = {
    **{n: "int64" if n in COUNT_METRICS else "float64" for n in METRICS},
    "policy": "string", "offered_request_rate": "float64", "point_key": "string", "error": "string",
    # capacity.parquet, capacity_runs.parquet
    "axis": "string", "sustainable_request_rate": "float64", "sustainable_value": "float64", "met": "bool",
    "status": "string", "slo": "string", "tolerance": "float64", "relative_tolerance": "float64",
    "lowest_rate_tried": "float64", "highest_rate_tried": "float64", "lowest_failing_rate": "float64",
    "num_runs": "int64", "value": "float64",
    # plan.parquet
    "replicas": "int64", "prefill_replicas": "int64", "decode_replicas": "int64", "num_gpus": "int64",
    "usd_per_gpu_hour": "float64", "usd_per_hour": "float64", "usd_per_million_tokens": "float64",
    "goodput_request_rate": "float64", "passed": "bool", "ran": "bool", "pruned_by": "string",
}
