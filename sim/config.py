"""Scenario files: pydantic models (``extra="forbid"``), policy presets and error messages that name
the file, the line, the key path and what was expected.

A scenario is one model on one GPU type serving one workload under several policies::

    name: quickstart
    model: opt-13b                 # catalog name, or a path to a Hugging Face config.json
    gpu: a100-40gb                 # catalog name, or an inline GPU spec
    workload: {arrival: {kind: poisson, rate: 1.5}, lengths: sharegpt, num_requests: 1000}
    policies: [fastertransformer, orca-max, orca-pow2, orca-oracle, vllm]
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from sim.catalog import (GIB, GPUS, LINKS, MAX_TOKENS, MODELS, SERVER_GPUS, CatalogError, GpuSpec, LinkSpec,
                         ModelSpec, _did_you_mean, model_from_hf_config)
from sim.trace_paths import PREFIX as TRACE_PREFIX
from sim.trace_paths import inside as trace_inside
from sim.trace_paths import locate as locate_trace
from sim.userfile import read_text, user_path


class ScenarioError(ValueError):
    """A user mistake in a scenario: the message is meant to be printed as is (one line each)."""


class Strict(BaseModel):
    # NOTE: allow_inf_nan=False: every float of a scenario is finite (.inf, .nan are errors)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _number(v: Any) -> Any:
    """YAML's true/false are not numbers (pydantic would read them as 1 and 0)."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, not {str(v).lower()}")
    return v


# Numbers: never a boolean, always finite, and bounded so that no value overflows what is computed from
# it (token counts fit in 32 bits; rates, times and sizes in ranges no real deployment leaves).
# (MAX_TOKENS: int32's largest, sim.catalog's)
MAX_COUNT = 10**9  # requests, sequences, blocks
MAX_SECONDS = 1e9  # about 32 years
MAX_HASH_BLOCK_SIZE = 1 << 20  # tokens per hashed prompt block of a trace (Mooncake: 512)
MAX_REPLICAS = 1024  # a fleet's replicas: every one's state is held, and stepped, on one core
MAX_BLOCK_SIZE = 1 << 16  # tokens per KV block (a policy's, a profile's, sim steptime's), and a block's cost in keys
MAX_COST_S = 1e3  # seconds per unit (a step, a sequence, a token, a key, a copy): host costs, profile coefficients
Int = Annotated[int, BeforeValidator(_number)]
Real = Annotated[float, BeforeValidator(_number)]
PosInt = Annotated[int, BeforeValidator(_number), Field(gt=0, le=MAX_COUNT)]
Tokens = Annotated[int, BeforeValidator(_number), Field(gt=0, le=MAX_TOKENS)]
PosFloat = Annotated[float, BeforeValidator(_number), Field(gt=0, le=1e12)]
Seconds = Annotated[float, BeforeValidator(_number), Field(gt=0, le=MAX_SECONDS)]
Rate = Annotated[float, BeforeValidator(_number), Field(ge=1e-9, le=1e9, description="requests per second")]
Cv = Annotated[float, BeforeValidator(_number), Field(ge=1e-6, le=100)]
Seed = Annotated[int, BeforeValidator(_number), Field(ge=0, le=2**63 - 1)]
Gib = Annotated[float, BeforeValidator(_number), Field(ge=0, le=1e6)]
Replicas = Annotated[int, BeforeValidator(_number), Field(gt=0, le=MAX_REPLICAS)]
Rating = Annotated[float, BeforeValidator(_number), Field(ge=1e-3, le=1e12)]  # a device's GB/s or TFLOP/s


def _printable(v: Any) -> Any:
    """A name is printed on the console, in tables and progress lines: a newline split the table's title, an
    escape sequence (ESC [31m) reached the terminal as a command."""
    if isinstance(v, str):
        bad = sorted({c for c in v if ord(c) < 32 or 127 <= ord(c) < 160})
        if bad:
            raise ValueError(f"a name holds control characters ({', '.join(repr(c) for c in bad[:3])}); expected "
                             f"printable text")
    return v


Name = Annotated[str, Field(min_length=1), AfterValidator(_printable)]


# ---------------------------------------------------------------------------------------------- workload


class Poisson(Strict):
    kind: Literal["poisson"]
    rate: Rate


class Gamma(Strict):
    """Gamma inter-arrival times: ``cv`` > 1 is burstier than Poisson (cv = 1 is Poisson)."""

    kind: Literal["gamma"]
    rate: Rate
    cv: Cv = Field(description="coefficient of variation of inter-arrival times")


Arrival = Annotated[Union[Poisson, Gamma], Field(discriminator="kind")]


class Fixed(Strict):
    kind: Literal["fixed"]
    tokens: Tokens


class Uniform(Strict):
    """Integers uniform on [low, high], both included."""

    kind: Literal["uniform"]
    low: Tokens
    high: Tokens

    @model_validator(mode="after")
    def _order(self) -> "Uniform":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self


class LogNormal(Strict):
    """Log-normal lengths with the given mean and coefficient of variation, rounded, clipped to
    [1, max]; the log-mean is solved so that the *clipped* distribution keeps the requested mean."""

    kind: Literal["lognormal"]
    mean: Annotated[float, BeforeValidator(_number), Field(gt=0, le=MAX_TOKENS)]
    cv: Cv = Field(description="standard deviation / mean, before clipping")
    max: Tokens | None = None

    @model_validator(mode="after")
    def _fits(self) -> "LogNormal":
        if self.max is not None and self.mean >= self.max:
            raise ValueError(f"mean ({self.mean}) must be below max ({self.max})")
        return self


Lengths = Annotated[Union[Fixed, Uniform, LogNormal], Field(discriminator="kind")]

# NOTE: shapes chosen by us, means matched to the PagedAttention paper's datasets (references.md).
# The spreads are a judgement (ShareGPT is long-tailed, Alpaca short and narrower); clipping at 1024
# keeps prompt + output within OPT's 2048-token limit, and the log-mean is re-solved so the means hold.
LENGTH_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "sharegpt": {
        "prompt": {"kind": "lognormal", "mean": 161.31, "cv": 1.5, "max": 1024},
        "output": {"kind": "lognormal", "mean": 337.99, "cv": 1.0, "max": 1024},
    },
    "alpaca": {
        "prompt": {"kind": "lognormal", "mean": 19.31, "cv": 0.6, "max": 1024},
        "output": {"kind": "lognormal", "mean": 58.45, "cv": 1.0, "max": 1024},
    },
}


class SharedPrefixes(Strict):
    """A few system prompts, one put before each request's own prompt, chosen by popularity. They make
    prefix caching measurable on generated traffic (a trace's own hash ids do it for real traces)."""

    lengths: list[Tokens] = Field(min_length=1, description="tokens of each system prompt")
    popularity: list[PosFloat] | None = Field(None, description="relative weights (default: equal)")
    hash_block: Annotated[int, BeforeValidator(_number), Field(gt=0, le=1 << 20)] = Field(16, description="tokens per content id in the generated prefix hashes")

    @model_validator(mode="after")
    def _same_length(self) -> "SharedPrefixes":
        if self.popularity is not None and len(self.popularity) != len(self.lengths):
            raise ValueError(f"popularity has {len(self.popularity)} weights for {len(self.lengths)} lengths")
        return self


class SyntheticWorkload(Strict):
    """Generated requests: an arrival process and two length distributions (or a preset)."""

    kind: Literal["synthetic"] = "synthetic"
    arrival: Arrival
    lengths: Literal["sharegpt", "alpaca"] | None = None
    prompt: Lengths | None = None
    output: Lengths | None = None
    num_requests: Annotated[int, BeforeValidator(_number), Field(gt=0, le=10**8)] | None = None
    duration_s: Seconds | None = None
    seed: Seed = 0
    shared_prefixes: SharedPrefixes | None = None

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("lengths"), str):
            preset = LENGTH_PRESETS.get(data["lengths"])
            if preset is not None:
                for k in ("prompt", "output"):
                    if k in data:
                        raise ValueError(f"give either 'lengths' (a preset) or '{k}', not both")
                data = {**data, **copy.deepcopy(preset)}
        return data

    @model_validator(mode="after")
    def _complete(self) -> "SyntheticWorkload":
        if self.prompt is None or self.output is None:
            raise ValueError("needs 'lengths' (sharegpt or alpaca) or both 'prompt' and 'output' distributions")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("needs a stop: 'num_requests', 'duration_s' or both")
        return self


class TraceColumns(Strict):
    """Where a generic table (CSV, JSONL or parquet) keeps each field of a request."""

    arrival: str | None = Field(None, description="arrival time column; none: give an arrival process")
    arrival_unit: Literal["s", "ms", "us", "datetime"] = Field(
        "s", description="numbers in seconds, milliseconds or microseconds, or date-times (ISO 8601)")
    prompt_tokens: str
    output_tokens: str
    hash_ids: str | None = Field(None, description="list column: one hash id per prompt block")
    hash_block_size: Annotated[int, BeforeValidator(_number), Field(gt=0, le=MAX_HASH_BLOCK_SIZE)] | None = Field(None, description="tokens per hashed block")
    session_id: str | None = None

    @model_validator(mode="after")
    def _block_size(self) -> "TraceColumns":
        if (self.hash_ids is None) != (self.hash_block_size is None):
            raise ValueError("give 'hash_ids' and 'hash_block_size' together")
        return self

    @model_validator(mode="after")
    def _distinct(self) -> "TraceColumns":
        """Each field reads its own column: two naming one column is a slip (and pandas gives a table, not a
        column, for a name selected twice)."""
        seen: dict[str, str] = {}
        for key in ("arrival", "prompt_tokens", "output_tokens", "hash_ids", "session_id"):
            column = getattr(self, key)
            if column in seen:
                raise ValueError(f"{seen[column]} and {key} both read column {column!r}; expected a column per field")
            if column is not None:
                seen[column] = key
        return self


class TimeWindow(Strict):
    """Arrivals in [start_s, end_s) of the trace's own clock, re-based so the window starts at 0."""

    start_s: Real = Field(0.0, ge=0, le=MAX_SECONDS)
    end_s: Seconds | None = None

    @model_validator(mode="after")
    def _order(self) -> "TimeWindow":
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        return self


class TraceWorkload(Strict):
    """Replay of a request trace file (plain or gzip): a real format, detected from its header or named
    by ``format``, or a generic table with ``columns``; then the transforms, in this order: ``window``,
    ``sample``, re-timing (``arrival``) or ``rate_scale``, ``num_requests``/``duration_s``,
    ``cap_lengths``. ``kind: table`` is the older name of ``kind: trace``."""

    kind: Literal["trace", "table"]
    path: str = Field(description="trace file, relative to the scenario file; traces:REL for REL in the traces "
                      "folders ($KVSIM_TRACES, then ../shared/traces; `sim trace fetch` fills them)")
    format: Literal["auto", "azure", "burstgpt", "mooncake", "vidur", "lengths", "canonical"] = "auto"
    columns: TraceColumns | None = Field(None, description="column mapping of a generic table")
    models: list[str] | None = Field(None, min_length=1, description="burstgpt: keep only these models")
    log_types: list[str] | None = Field(None, min_length=1, description="burstgpt: keep only these log types")
    bad_rows: Literal["error", "drop"] = Field(
        "error", description="a row with a missing, non-numeric or negative value: stop with an error, or drop it")
    window: TimeWindow | None = None
    sample: Real | None = Field(None, gt=0, le=1, description="keep this fraction of the requests, at random")
    arrival: Arrival | None = Field(None, description="re-time: new arrivals, the trace's own lengths in order")
    rate_scale: Annotated[float, BeforeValidator(_number), Field(ge=1e-9, le=1e9)] | None = Field(None, description="multiply the request rate (arrival times / rate_scale)")
    num_requests: PosInt | None = None
    duration_s: Seconds | None = None
    cap_lengths: Literal["reject", "truncate"] = Field(
        "reject", description="prompt + output over the model's max length: the engine rejects it, or it is "
        "truncated (prompt to max - 1, output to what is left) and counted")
    seed: Seed = Field(0, description="seeds sample and arrival")

    @field_validator("path")
    @classmethod
    def _inside_the_traces_folders(cls, v: str) -> str:
        """``traces:REL`` names a file inside the traces folders: ``traces:../../etc/passwd`` read outside them."""
        if v.startswith(TRACE_PREFIX):
            trace_inside(v[len(TRACE_PREFIX):])
        return v

    @model_validator(mode="after")
    def _coherent(self) -> "TraceWorkload":
        if self.columns is not None and self.format != "auto":
            raise ValueError(f"give either 'format' ({self.format}) or 'columns' (a generic table), not both")
        if self.arrival is not None and self.rate_scale is not None:
            raise ValueError("give either 'arrival' (new arrival times) or 'rate_scale', not both")
        return self


Workload = Annotated[Union[SyntheticWorkload, TraceWorkload], Field(discriminator="kind")]


def own_arrivals(workload: Any) -> bool:
    """Whether a workload mapping (as a file gives it) keeps its trace's own arrival times: its rate is then
    a ``rate_scale``, not ``arrival.rate`` (a trace re-timed by ``arrival`` has a rate like a generated one).
    The one rule a sweep's capacity axis and a plan's rates follow."""
    return (isinstance(workload, dict) and workload.get("kind") in ("trace", "table")
            and not isinstance(workload.get("arrival"), dict))


def _default_kind(data: Any) -> Any:
    if isinstance(data, dict) and "kind" not in data:
        return {**data, "kind": "synthetic"}
    return data


# ---------------------------------------------------------------------------------------------- sampling


class ParallelSampling(Strict):
    """Every request asks for ``n`` outputs: one prefill, then ``n`` samples sharing the prompt's cache."""

    kind: Literal["parallel"]
    n: Int = Field(ge=2, le=63)


class BeamSearch(Strict):
    """Every request runs beam search of ``width`` beams. NOTE: which beams survive each step is a seeded
    random process, not a model's scores: each new beam continues its own beam with
    ``keep_probability``, else a beam chosen uniformly; beams nobody continues are dropped, beams
    continued twice are forked."""

    kind: Literal["beam"]
    width: Int = Field(ge=2, le=63)
    keep_probability: Real = Field(0.8, ge=0, le=1)
    seed: Seed = 0


Sampling = Annotated[Union[ParallelSampling, BeamSearch], Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------- policies


class PagedAllocatorConfig(Strict):
    """Blocks of ``block_size`` taken on demand; admission keeps ``watermark`` of the blocks free."""

    kind: Literal["paged"]
    watermark: Real = Field(0.01, ge=0, lt=1)


class ContiguousAllocatorConfig(Strict):
    """One slab per request reserved at admission, in one linear address space of token slots:
    ``max`` = the model's max length, ``pow2`` = prompt + output rounded up to a power of two,
    ``oracle`` = prompt + output exactly; placed by a buddy allocator or first-fit."""

    kind: Literal["contiguous"]
    reserve: Literal["max", "pow2", "oracle"] = "max"
    placement: Literal["buddy", "first-fit"] = "buddy"


AllocatorConfig = Annotated[Union[PagedAllocatorConfig, ContiguousAllocatorConfig], Field(discriminator="kind")]


class KvOffloadConfig(Strict):
    """A CPU tier for the prefix cache (``sim/offload.py``): evicted cached blocks move to ``cpu_gib`` of
    host memory (LRU) and a hit there is a host -> device copy instead of a prefill."""

    cpu_gib: Annotated[float, BeforeValidator(_number), Field(gt=0, le=1e6)] = Field(
        description="host memory for evicted prefix-cache blocks (GiB)")


class PolicyConfig(Strict):
    """How one server schedules and places KV cache. Presets fill every field; any can be overridden."""

    name: Name
    preset: str | None = None
    batching: Literal["static", "continuous"]
    allocator: AllocatorConfig
    prefill: Literal["separate", "mixed", "chunked"] = Field(
        description="separate: prefill-only steps (vLLM v0); mixed: whole prompts batched with decodes "
        "(Orca); chunked: prompts split under the token budget and mixed with decodes (vLLM v1)"
    )
    block_size: Annotated[int, BeforeValidator(_number), Field(gt=0, le=MAX_BLOCK_SIZE)] = Field(16, description="tokens per KV block (pool geometry; paged allocation unit)")
    max_num_seqs: PosInt = 256
    max_num_batched_tokens: Tokens | None = Field(
        None, description="token budget per step; default max(2048, max_model_len), or 2048 when chunked"
    )
    preemption: Literal["recompute", "swap"] = "recompute"
    swap_space_gib: Gib = 4.0
    prefix_caching: bool = Field(False, description="reuse cached blocks of identical prompt prefixes (paged only)")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="auto: the model's dtype; fp8: one byte per element (the GPU must support fp8)")
    hybrid_allocator: bool = Field(
        True, description="sliding-window, chunked and Mamba layers get their own KV groups (vLLM's hybrid KV "
        "cache manager); false: every layer kept as full attention (vLLM's fallback); see sim/layouts.py")
    kv_offload: KvOffloadConfig | None = Field(None, description="a CPU tier for evicted prefix-cache blocks "
                                               "(paged, with prefix_caching)")

    def unread_option(self) -> str | None:
        """Why a setting the file gives is never read by this policy, or None. Checked on a scenario file as
        written (``load_scenario``), not on the points a sweep makes: an axis such as ``preemption: [recompute,
        swap]`` reaches every policy, contiguous ones included. (A swap space under recompute is a knob the
        decomposition shows with a share of zero: not refused.)"""
        if self.preemption == "swap" and self.allocator.kind != "paged":  # (such a policy ran as recompute)
            return ("preemption: swap copies a preempted sequence's blocks to CPU swap space, which only the paged "
                    "allocator does (a contiguous slab is recomputed): drop it, or use the paged allocator")
        if self.preemption == "swap" and self.swap_space_gib == 0:  # (every preemption recomputed, without a word)
            return ("preemption: swap with swap_space_gib: 0 has no room to swap to (every preempted sequence is "
                    "recomputed): give swap space, or use preemption: recompute")
        return None

    @model_validator(mode="after")
    def _coherent(self) -> "PolicyConfig":
        if self.prefix_caching and self.allocator.kind != "paged":
            raise ValueError("prefix_caching shares blocks: it needs the paged allocator")
        if self.kv_offload is not None and self.allocator.kind != "paged":
            raise ValueError("kv_offload moves evicted prefix-cache blocks to the CPU: it needs the paged allocator")
        if self.kv_offload is not None and not self.prefix_caching:
            raise ValueError("kv_offload keeps evicted prefix-cache blocks: it needs prefix_caching: true")
        if self.batching == "static" and self.allocator.kind != "contiguous":
            raise ValueError("static batching reserves memory per batch: it needs a contiguous allocator")
        if self.batching == "static" and self.prefill != "separate":
            raise ValueError("static batching prefills the whole batch in its first step: use prefill: separate")
        return self


# NOTE (fair comparisons): the PagedAttention paper's Orca baselines are its authors' re-implementations
# inside vLLM's own engine, so they share vLLM's iteration scheduler (v0: prefill-only steps) and differ
# from it only in how KV memory is reserved. `orca-*` are those baselines: the same scheduler as `vllm`,
# a contiguous allocator instead of paged blocks (tests/test_decomposition.py checks that nothing else
# differs). `orca-*-mixed` are Orca as its own paper describes it (OSDI 2022): whole prompts batched
# with the decodes of the same iteration.
_ORCA = {"batching": "continuous", "prefill": "separate", "preemption": "recompute"}
_ORCA_MIXED = {"batching": "continuous", "prefill": "mixed"}
POLICY_PRESETS: dict[str, dict[str, Any]] = {
    "fastertransformer": {
        "batching": "static",
        "allocator": {"kind": "contiguous", "reserve": "max"},
        "prefill": "separate",
    },
    **{f"orca-{r}": {**_ORCA, "allocator": {"kind": "contiguous", "reserve": r}} for r in ("max", "pow2", "oracle")},
    **{f"orca-{r}-mixed": {**_ORCA_MIXED, "allocator": {"kind": "contiguous", "reserve": r}}
       for r in ("max", "pow2", "oracle")},
    "vllm": {"batching": "continuous", "allocator": {"kind": "paged"}, "prefill": "separate", "preemption": "recompute"},
    "vllm-v1": {"batching": "continuous", "allocator": {"kind": "paged", "watermark": 0}, "prefill": "chunked",
                "preemption": "recompute"},  # V1's KV cache manager keeps no watermark
}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and v.get("kind", out[k].get("kind")) == out[k].get("kind"):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _expand_policy(entry: Any) -> Any:
    """A preset name, or a mapping with an optional ``preset`` whose fields it overrides."""
    if isinstance(entry, str):
        entry = {"preset": entry}
    if not isinstance(entry, dict):
        return entry  # let pydantic say what was expected
    preset = entry.get("preset")
    if preset is None:
        return {"name": entry.get("name", "custom"), **entry}
    if not isinstance(preset, str) or preset not in POLICY_PRESETS:  # (a list or mapping: not hashable)
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(POLICY_PRESETS)}")
    merged = _deep_merge(POLICY_PRESETS[preset], {k: v for k, v in entry.items()})
    merged.setdefault("name", preset)
    return merged


Policy = Annotated[PolicyConfig, BeforeValidator(_expand_policy)]


def check_unique_names(policies: list[PolicyConfig]) -> None:
    """A scenario's (or a plan's) policies: each name once (results are keyed by it)."""
    names = [p.name for p in policies]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"policy names must be unique; give each a 'name' ({', '.join(dup)} repeated)")


# ---------------------------------------------------------------------------------------------- hardware


class GpuConfig(Strict):
    """A GPU not in the catalog, by its datasheet figures."""

    name: Name
    memory_gib: Annotated[float, BeforeValidator(_number), Field(gt=0, le=1e6)]
    # (at 1e-12 GB/s or TFLOP/s a step took 10^13 s; a megabyte or a gigaflop a second is below any real device)
    hbm_gb_per_s: Rating
    tflops: Rating = Field(description="dense bf16/fp16 tensor TFLOP/s")
    host_gb_per_s: Rating = 32.0
    interconnect_gb_per_s: Rating = 300.0
    link_gpus: Annotated[int, BeforeValidator(_number), Field(ge=1, le=1024)] = Field(
        SERVER_GPUS, description="GPUs the interconnect joins (8: an NVLink server; 2: bridged pairs; 1: PCIe only): "
        "a tensor-parallel ring past them runs over PCIe, past a server over the network")
    fp8: bool = Field(False, description="fp8 support (kv_cache_dtype: fp8 needs it)")

    def spec(self) -> GpuSpec:
        return GpuSpec(self.name, int(self.memory_gib * GIB), self.hbm_gb_per_s * 1e9, self.tflops * 1e12,
                       self.host_gb_per_s * 1e9, self.interconnect_gb_per_s * 1e9, fp8=self.fp8,
                       link_gpus=self.link_gpus)


class HostCosts(Strict):
    """Overrides of an engine profile's host costs (seconds; see ``sim/engines.py``)."""

    serial_step_s: Real | None = Field(None, ge=0, le=MAX_COST_S)
    serial_per_seq_s: Real | None = Field(None, ge=0, le=MAX_COST_S)
    serial_per_token_s: Real | None = Field(None, ge=0, le=MAX_COST_S)
    overlapped_step_s: Real | None = Field(None, ge=0, le=MAX_COST_S)
    overlapped_per_seq_s: Real | None = Field(None, ge=0, le=MAX_COST_S)
    overlapped_per_token_s: Real | None = Field(None, ge=0, le=MAX_COST_S)


class RooflineConfig(Strict):
    """Step time from the model's shape and the GPU: GEMMs and elementwise ops priced by the operator
    coefficients fitted to measured profiles where the GPU's catalog entry has them (``operators:
    fitted``), else by the datasheet roofline at the efficiencies below; attention at the efficiencies
    below; the host's work by an engine profile (``sim/engines.py``). See ``sim/steptime.py``."""

    kind: Literal["roofline"] = "roofline"
    operators: Literal["fitted", "datasheet"] = Field(
        "fitted", description="fitted: the GPU's measured operator coefficients when it has them; datasheet: never")
    engine: Literal["none", "vllm-0.5", "vllm-0.6", "vllm-v1"] = Field(
        "vllm-v1", description="host-cost profile of the serving engine (sim/engines.py)")
    host: HostCosts | None = Field(None, description="override the engine profile's host costs")
    matmul_efficiency: Real = Field(0.6, gt=0, le=1, description="fraction of peak FLOP/s for linear layers "
                                                                  "(datasheet operators only)")
    attention_efficiency: Real = Field(0.4, gt=0, le=1, description="fraction of peak FLOP/s for prefill attention")
    bandwidth_efficiency: Real = Field(0.8, gt=0, le=1, description="fraction of HBM bandwidth achieved "
                                                                     "(decode attention; datasheet operators)")
    gpu_overhead_s: Real = Field(1e-4, ge=0, le=MAX_COST_S, description="GPU work per step outside the layers "
                                 "(embedding, final norm, sampling kernels)")
    paged_block_cost_tokens: Real = Field(
        0.0, ge=0, le=MAX_BLOCK_SIZE, description="a paged decode kernel's cost per block visited, in keys' "
        "worth of reading (default 0: measured on an H200, paged decode within 1 % of contiguous at blocks 8-64; "
        "the PagedAttention paper's 2023 kernel: 3.68, +23 % at block size 16, its Fig. 18a)")
    allreduce_latency_s: Real = Field(1e-5, ge=0, le=MAX_COST_S,
                                      description="fixed cost of one all-reduce priced from the datasheet, within "
                                      "a server (between servers: the network link's latency)")
    swap_copy_overhead_s: Real = Field(5e-6, ge=0, le=MAX_COST_S,
                                       description="fixed cost of one block copy over the host link")

    def host_overrides(self) -> dict:
        return {} if self.host is None else self.host.model_dump(exclude_none=True)


class ProfileConfig(Strict):
    """Step time from a profile that ``sim calibrate`` fitted to steps measured on a real device (a JSON
    file; a relative path resolves against the scenario's folder). The profile must be of this model."""

    kind: Literal["profile"]
    path: str = Field(min_length=1, description="profile JSON written by sim calibrate")


StepTime = Annotated[Union[RooflineConfig, ProfileConfig], Field(discriminator="kind")]
StepTimeAdapter = TypeAdapter(StepTime)


def _roofline_by_default(data: Any) -> Any:
    """A step_time mapping without ``kind`` is the roofline's (as the default is), so a sweep axis such as
    ``step_time.engine`` works on a base scenario that never wrote a step_time block."""
    if isinstance(data, dict) and "kind" not in data:
        return {**data, "kind": "roofline"}
    return data


# ---------------------------------------------------------------------------------------------- fleets (sim.cluster)

ROUTERS = ("round-robin", "random", "least-outstanding", "least-kv", "power-of-two", "prefix-affinity",
           "session-affinity")


def _known_gpu_name(v):
    if isinstance(v, str) and v not in GPUS:
        raise ValueError(f"unknown gpu {v!r}{_did_you_mean(v, GPUS)}; expected one of {', '.join(GPUS)} or an "
                         f"inline spec")
    return v


class ReplicaGroup(Strict):
    """``count`` replicas of one kind; GPU and tensor parallelism default to the scenario's."""

    gpu: Annotated[str | GpuConfig | None, BeforeValidator(_known_gpu_name)] = None
    tensor_parallel: Annotated[int, BeforeValidator(_number), Field(gt=0, le=1024)] | None = None
    count: Replicas = 1


class RouterOptions(Strict):
    load_cap: Real = Field(1.25, ge=1, le=1e6, description="prefix-affinity: above this times the mean "
                                                            "outstanding requests, route to the least loaded")
    seed: Seed = Field(0, description="random and power-of-two: the router's random stream")


ROUTER_OPTION_USERS = {"load_cap": ("prefix-affinity",), "seed": ("random", "power-of-two")}


def _replicas(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v < 1:
        raise ValueError("a fleet needs at least one replica")
    if isinstance(v, list) and not v:
        raise ValueError("a fleet needs at least one replica group (got an empty list)")
    return v


def _routers(v: Any) -> Any:
    for name in [v] if isinstance(v, str) else v if isinstance(v, list) else []:
        if isinstance(name, str) and name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}{_did_you_mean(name, ROUTERS)}; expected one of "
                             f"{', '.join(ROUTERS)}")
    if isinstance(v, list) and not v:
        raise ValueError("give at least one router")
    if isinstance(v, list) and len(set(map(str, v))) < len(v):
        twice = next(str(x) for i, x in enumerate(v) if str(x) in map(str, v[:i]))
        raise ValueError(f"router {twice!r} is listed twice (each router runs the policies once)")
    return v


def _pool_replicas(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v < 1:
        raise ValueError("a pool needs at least one replica")
    return v


class PoolConfig(Strict):
    """One pool of a disaggregated fleet (``cluster.prefill`` / ``cluster.decode``): ``replicas`` identical
    replicas; GPU and tensor parallelism default to the scenario's."""

    replicas: Annotated[Replicas, BeforeValidator(_pool_replicas)]
    gpu: Annotated[str | GpuConfig | None, BeforeValidator(_known_gpu_name)] = None
    tensor_parallel: Annotated[int, BeforeValidator(_number), Field(gt=0, le=1024)] | None = None


class KvTransferConfig(Strict):
    """A KV-transfer link given by its figures: one direction, decimal GB/s per GPU (each GPU has its own
    link); how long a transfer takes, with tensor parallelism on either side, is ``sim/cluster/disagg.py``'s."""

    # (at 1e-12 GB/s a transfer took 10^14 s; 0.001 GB/s, a megabyte a second, is below any real link)
    gb_per_s: Annotated[float, BeforeValidator(_number), Field(ge=1e-3, le=1e6)]
    latency_ms: Annotated[float, BeforeValidator(_number), Field(ge=0, le=1e6)] = 0.0


def _known_link(v: Any) -> Any:
    if isinstance(v, str) and v not in LINKS:
        raise ValueError(f"unknown link {v!r}{_did_you_mean(v, LINKS)}; expected one of {', '.join(LINKS)} or "
                         f"{{gb_per_s, latency_ms}}")
    return v


class ClusterConfig(Strict):
    """Replicas of the scenario's server behind a router (``sim.cluster``). A list of routers runs each
    policy once per router (results named ``policy/router``). With ``prefill`` and ``decode`` (and
    ``kv_transfer``), a disaggregated fleet instead (``sim/cluster/disagg.py``): the router routes within
    each pool."""

    # None: not given (one replica, or the pools of a disaggregated fleet); a default of 1 would be written
    # out by a dump (sweeps, summary.json) and read back as given
    replicas: Annotated[Replicas | list[ReplicaGroup], BeforeValidator(_replicas)] | None = None
    router: Annotated[str | list[str], BeforeValidator(_routers)] = "round-robin"
    router_options: RouterOptions = RouterOptions()
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    kv_transfer: Annotated[str | KvTransferConfig | None, BeforeValidator(_known_link)] = None

    @model_validator(mode="after")
    def _split(self) -> "ClusterConfig":
        total = (self.prefill.replicas + self.decode.replicas if self.prefill is not None and self.decode is not None
                 else sum(g.count for g in self.groups))
        if total > MAX_REPLICAS:
            raise ValueError(f"{total} replicas in all: at most {MAX_REPLICAS} (the simulator holds and steps every "
                             f"replica on one core)")
        if self.prefill is None and self.decode is None:
            if self.kv_transfer is not None:
                raise ValueError("kv_transfer is the link between a prefill and a decode pool: give cluster.prefill "
                                 "and cluster.decode too, or drop it")
            return self
        if self.prefill is None or self.decode is None:
            given, missing = ("prefill", "decode") if self.decode is None else ("decode", "prefill")
            raise ValueError(f"{given} without {missing}: prefill/decode disaggregation needs both pools "
                             f"(cluster.prefill and cluster.decode)")
        if self.replicas is not None:
            raise ValueError("give either replicas (a colocated fleet) or prefill and decode pools (a "
                             "disaggregated one), not both")
        if self.kv_transfer is None:
            raise ValueError(f"prefill and decode pools need kv_transfer: a link ({', '.join(LINKS)}) or "
                             f"{{gb_per_s, latency_ms}}")
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def unread_option(self) -> str | None:
        """Why a router option the file gives is read by none of its routers, or None. Checked on a scenario
        file as written (``load_scenario``), not on the points a sweep or plan makes by changing the router."""
        for option, users in ROUTER_OPTION_USERS.items():  # (a dump writes the defaults out: those pass)
            if getattr(self.router_options, option) != RouterOptions.model_fields[option].default and not (
                    set(users) & set(self.routers)):
                return (f"router_options.{option} applies to {' and '.join(users)} only; the router here is "
                        f"{', '.join(self.routers)}: drop it, or choose a router that reads it")
        return None

    @property
    def link(self) -> LinkSpec:
        """The KV-transfer link of a disaggregated fleet."""
        t = self.kv_transfer
        if isinstance(t, str):
            return LINKS[t]
        return LinkSpec("custom", t.gb_per_s * 1e9, t.latency_ms / 1e3)

    @property
    def routers(self) -> list[str]:
        return [self.router] if isinstance(self.router, str) else list(self.router)

    @property
    def groups(self) -> list[ReplicaGroup]:
        if isinstance(self.replicas, list):
            return list(self.replicas)
        return [ReplicaGroup(count=self.replicas or 1)]


class Scenario(Strict):
    name: Name
    description: str = ""
    model: str = Field(description="catalog name or path to a Hugging Face config.json")
    gpu: str | GpuConfig
    tensor_parallel: Annotated[int, BeforeValidator(_number), Field(gt=0, le=1024)] = 1
    gpu_memory_utilization: Real = Field(0.9, gt=0, le=1)
    runtime_overhead_gib: Gib = Field(0.5, description="CUDA context and library buffers outside the budget")
    activation_reserve_tokens: Tokens = Field(2048, description="tokens of the activation-memory profiling pass")
    workload: Annotated[Workload, BeforeValidator(_default_kind)]
    policies: list[Policy] = Field(min_length=1)
    sampling: Sampling | None = Field(None, description="parallel samples or beam search for every request")
    step_time: Annotated[StepTime, BeforeValidator(_roofline_by_default)] = RooflineConfig()
    horizon_s: Seconds | None = Field(None, description="stop the simulation here; later requests are unfinished")
    startup_s: Real = Field(0.0, ge=0, le=1e6, description="the server starts serving this long after t = 0 "
                             "(a freshly started server's warm-up, for benchmarks that send requests at once)")
    exact: bool = Field(False, description="step every iteration instead of skipping quiet decode spans")
    record_steps: bool = Field(True, description="keep the per-step table (else only time-binned aggregates)")
    timeline_bin_s: Seconds = Field(1.0, description="timeline bin width; doubles while more than 2048 bins are needed")
    cluster: ClusterConfig | None = Field(None, description="a fleet: replicas behind a router (sim.cluster)")
    decompose: bool = Field(True, description="sim run: decompose each policy's difference from the first one "
                            "knob by knob, running the intermediate policies on the same requests (sim.decompose)")

    # Relative paths in the scenario resolve against its file's folder (set on load).
    _base_dir: Path = PrivateAttr(default=Path("."))

    @model_validator(mode="after")
    def _names(self) -> "Scenario":
        check_unique_names(self.policies)
        return self

    @field_validator("startup_s")
    @classmethod
    def _starts_before_the_horizon(cls, v: float, info: ValidationInfo) -> float:
        horizon = info.data.get("horizon_s")  # (a run finished nothing, and said nothing)
        if horizon is not None and v >= horizon:
            raise ValueError(f"must be below horizon_s ({horizon:g} s): the server would start serving when the "
                             "simulation stops")
        return v

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v):
        return _known_gpu_name(v)  # (the rule a replica group's and a pool's gpu follow)

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str):
        # NOTE: a path (a config.json, or a folder holding one) is checked when it is read, relative to the file
        if v not in MODELS and not (v.endswith(".json") or "/" in v or "\\" in v or v.startswith((".", "~"))):
            raise ValueError(f"unknown model {v!r}{_did_you_mean(v, MODELS)}; expected one of {', '.join(MODELS)} "
                             f"or a path to a config.json or to a folder holding one (a path has a '/': ./{v})")
        return v

    def resolve_path(self, p: str) -> Path:
        if p.startswith(TRACE_PREFIX):  # a file of the traces folders ($KVSIM_TRACES, ../shared/traces)
            return locate_trace(p[len(TRACE_PREFIX):])
        q = Path(p).expanduser()
        return q if q.is_absolute() else self._base_dir / q

    def model_spec(self) -> ModelSpec:
        if self.model in MODELS:
            return MODELS[self.model]
        p = self.resolve_path(self.model)
        try:
            return model_from_hf_config(p / "config.json" if p.is_dir() else p)
        except CatalogError as e:
            raise ScenarioError(f"model: {e}") from None

    def gpu_spec(self) -> GpuSpec:
        return GPUS[self.gpu] if isinstance(self.gpu, str) else self.gpu.spec()


# ---------------------------------------------------------------------------------------------- loading


MAX_YAML_VALUES = 100_000  # values a document may expand to, aliases counted at every use
MAX_YAML_DEPTH = 64
# libyaml's parser where PyYAML was built with it (linear in the text; the pure-Python scanner is quadratic
# in the nesting of flow collections, seconds for a hostile "[[[[...]]]]"), else PyYAML's safe loader
class _YamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """Numbers as YAML 1.2's core schema reads them: ``1:30`` and ``1:30.5`` are text, not YAML 1.1's base-60
    numbers (``num_requests: 1:30`` ran 90 requests; ``prefill_decode: [1:3]`` was the number 63), and ``010``
    is ten, not YAML 1.1's octal 8 (``0o10`` is eight). Kept from YAML 1.1: ``_`` between digits (1_000_000),
    ``0b`` binary, and the floats 1.1 knows (``1e9``, without a dot, is text, which a number field reads)."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, {_INT: re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[0-1_]+)$"),
                   _FLOAT: re.compile(r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]"
                                      r"[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")}.get(tag, rx))
            for tag, rx in resolvers]
    for first, resolvers in _YamlLoader.yaml_implicit_resolvers.items()}


def _yaml_int(loader: yaml.BaseLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    return sign * (int(digits[2:], 8) if digits[:2] == "0o" else int(digits, 0) if digits[:2] in ("0x", "0b")
                   else int(digits))  # (int("010") is 10: decimal)


_YamlLoader.add_constructor(_INT, _yaml_int)
YAML_LOADER = _YamlLoader  # (also the -w values of sim trace)


def _key_lines(root: yaml.Node) -> dict[tuple, int]:
    """Map every key path of a YAML document to its 1-based line, and refuse what no scenario needs:
    duplicate keys (YAML would keep the last one silently), aliases that refer to themselves or that
    expand beyond MAX_YAML_VALUES values (a few hundred bytes can stand for billions), and nesting deeper
    than MAX_YAML_DEPTH. Each node is walked once: an alias's second use is counted, not walked again."""
    lines: dict[tuple, int] = {}
    size: dict[int, int] = {}  # node id -> values it expands to
    active: set[int] = set()  # nodes on the current path (an alias to one of them is a cycle)

    def walk(node: yaml.Node, path: tuple, depth: int) -> int:
        nid = id(node)
        if nid in active:
            raise ValueError(f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")
        if nid in size:
            return size[nid]
        if depth > MAX_YAML_DEPTH:
            raise ValueError(f"line {node.start_mark.line + 1}: nested more than {MAX_YAML_DEPTH} levels deep")
        active.add(nid)
        n = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else None
                if key is not None and key != "<<":
                    if key in seen:
                        raise ValueError(f"line {k.start_mark.line + 1}: duplicate key {key!r} (first at line "
                                         f"{seen[key]}); YAML would keep only the last")
                    seen[key] = k.start_mark.line + 1
                p = path + (key,)
                lines.setdefault(p, k.start_mark.line + 1)
                n += walk(v, p, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines.setdefault(path + (i,), v.start_mark.line + 1)
                n += walk(v, path + (i,), depth + 1)
        if n > MAX_YAML_VALUES:
            raise ValueError(f"line {node.start_mark.line + 1}: expands to more than {MAX_YAML_VALUES:,} values "
                             f"(aliases are counted at every use)")
        active.discard(nid)
        size[nid] = n
        return n

    walk(root, (), 0)
    return lines


_UNION_TAGS = {"synthetic", "table", "parallel", "beam", "trace", "poisson", "gamma", "fixed", "uniform", "lognormal",
               "paged", "contiguous", "roofline", "profile", "GpuConfig", "str"}


def _key_path(loc: tuple) -> tuple:
    # pydantic puts a union's tag (or branch type: "list[ReplicaGroup]") into the location; the user's file
    # has no such key.
    return tuple(p for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or p.startswith("function-")
                                                                  or (p.endswith("]") and "[" in p)
                                                                  or p in _model_names())))


@functools.cache
def _model_names() -> frozenset[str]:
    """The class names of every model here (a union of models puts the branch's name into a location)."""
    out, todo = set(), [BaseModel]
    while todo:
        for c in todo.pop().__subclasses__():
            out.add(c.__name__)
            todo.append(c)
    return frozenset(out)


def _fmt_path(path: tuple) -> str:
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s or "(top level)"


def _models_at(model: type[BaseModel], path: tuple) -> list[type[BaseModel]]:
    """The models a key path leads to from ``model`` (through lists, dicts and unions; [] when it leaves
    the models, e.g. into a free-form mapping)."""
    from typing import get_args, get_origin

    def inside(annotation) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for a in get_args(annotation) for m in inside(a)] if get_origin(annotation) is not None else []

    models = [model]
    for seg in path:
        if isinstance(seg, int):
            continue  # a list index: the same models
        models = [m for x in models if seg in x.model_fields for m in inside(x.model_fields[seg].annotation)]
    return models


def format_validation_error(e: ValidationError, source: str, lines: dict[tuple, int] | None = None,
                            model: type[BaseModel] | None = None) -> str:
    """One line per mistake: ``file:line: key.path: what is wrong (got ...)``; with ``model`` (what was
    validated), an unknown key names the closest known one (did you mean ...?)."""
    msgs = []
    errors = e.errors()
    paths = [_key_path(err["loc"]) for err in errors]
    mismatch = [err["type"].endswith(("_type", "_parsing", "_from_float")) for err in errors]
    for k, (err, path) in enumerate(zip(errors, paths)):
        if mismatch[k] and any((len(q) > len(path) and q[:len(path)] == path) or (q == path and not mismatch[j])
                               for j, q in enumerate(paths)):
            continue  # a union's branch the value is not (a list, for an int): the branch it is says what is wrong
        same = [errors[j]["msg"] for j, q in enumerate(paths) if q == path and mismatch[j]] if mismatch[k] else []
        if len(same) > 1:  # no branch of a union takes the value: one line, every branch's expectation
            if err["msg"] != same[0]:
                continue
            err = {**err, "msg": "Input should be " + " or ".join(m.removeprefix("Input should be ") for m in same)}
        line = None
        if lines:
            for n in range(len(path), -1, -1):
                if path[:n] in lines:
                    line = lines[path[:n]]
                    break
        where = f"{source}:{line}" if line else source
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            if model is not None and path and isinstance(path[-1], str):
                import difflib

                models = _models_at(model, path[:-1])
                owners = [m for m in models if path[-1] in m.model_fields]
                if owners:  # a key of another kind of this mapping (a trace workload's, on a generated one)
                    kinds = " or ".join(sorted({_kind_name(m) for m in owners}))
                    msg += f" here: {path[-1]!r} is a key of {kinds}"
                else:
                    known = sorted({f for m in models for f in m.model_fields})
                    hint = difflib.get_close_matches(path[-1], known, 1)
                    msg += f" (did you mean {hint[0]!r}?)" if hint else ""
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif err["type"] == "union_tag_not_found":  # (pydantic's "Unable to extract tag using discriminator 'kind'")
            kinds = sorted({_kind_name(m).removeprefix("kind: ") for m in _models_at(model, path)}) if model else []
            msg = "no 'kind' given" + (f": expected kind: {' | '.join(kinds)}" if kinds else "")
        got = err.get("input")
        shown = repr(got)
        if len(shown) > 80:  # (a 20,000-character value made a 40 KB "line", quoted in the message too)
            msg = msg.replace(shown, f"{shown[:60]}...")
            shown = f"{shown[:60]}... ({len(shown):,} characters)"
        tail = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(got, (dict, list)) else f" (got {shown})"
        if err["type"] == "invalid_key":  # a key that is not text: its location reads like a list index
            parent = _fmt_path(path[:-1]) if len(path) > 1 else "(top level)"
            hint = ("; YAML reads on, off, yes and no as booleans: quote such a key" if isinstance(got, bool)
                    else "; quote it")
            msgs.append(f"{where}: {parent}: the key {got!r} is not text{hint}")
            continue
        if isinstance(got, bool) and err["type"] in ("string_type", "literal_error", "enum"):
            tail += "; YAML reads on, off, yes and no as true and false: quote such a value"  # (name: off)
        msgs.append(f"{where}: {_fmt_path(path)}: {msg}{tail}")
    return "\n".join(dict.fromkeys(msgs))


def _kind_name(model: type[BaseModel]) -> str:
    """How a union's member is chosen, in words: ``kind: trace`` (its first kind), else its class name."""
    import typing

    kind = model.model_fields.get("kind")
    values = typing.get_args(kind.annotation) if kind is not None else ()
    return f"kind: {values[0]}" if values and isinstance(values[0], str) else model.__name__


def validate_mapping(model: type[BaseModel], data: Any, source: str, lines: dict | None = None,
                     keys: str = "scenario keys") -> Any:
    """``model`` validated from a file's top-level mapping; a mistake raises :class:`ScenarioError`
    naming the file, the line and the key."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{source}: expected a mapping of {keys} at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(format_validation_error(e, source, lines, model)) from None


def parse_scenario(data: Any, source: str = "<scenario>", lines: dict | None = None, base_dir: str = ".") -> Scenario:
    scenario = validate_mapping(Scenario, data, source, lines)
    scenario._base_dir = Path(base_dir)
    return scenario


def read_yaml(path: Path, what: str = "scenario") -> tuple[Any, dict[tuple, int]]:
    """A YAML file's data and the line of each key path; a missing, unreadable or malformed file raises
    :class:`ScenarioError` naming it (``what``: the kind of file, for the message). The one place a
    user's YAML file is read (scenarios, sweeps, step-time blocks)."""
    path = Path(path)
    text = read_text(path, f"{what} file", ScenarioError)
    try:
        node = yaml.compose(text, Loader=YAML_LOADER)
        lines = _key_lines(node) if node is not None else {}
        data = yaml.load(text, Loader=YAML_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        if "nesting depth" in problem:  # libyaml's own limit on flow collections ([[[...]]])
            raise ScenarioError(f"{where}: nested too deeply to read (more than {MAX_YAML_DEPTH} levels expected "
                                f"at most)") from None
        raise ScenarioError(f"{where}: not valid YAML ({problem})") from None
    except ValueError as e:
        raise ScenarioError(f"{path}: {e}") from None
    except RecursionError:
        raise ScenarioError(f"{path}: nested too deeply to read (more than {MAX_YAML_DEPTH} levels expected at most)") \
            from None
    return data, lines


_KIND_COMMAND = {"scenario": "sim run", "sweep": "sim sweep", "plan": "sim plan"}


def file_kind(data: Any) -> str | None:
    """What a user's YAML file is, by its top-level keys: ``plan`` or ``sweep`` (each has ``base:`` (or a key
    close to it, and no ``model``, ``gpu`` or ``workload``), and keys the other's file does not: ``PlanFile``'s,
    ``SweepFile``'s), else ``scenario`` (and for what is not a mapping, or an empty one); None when it cannot
    tell (a ``base:`` and nothing else that a plan or sweep has)."""
    if not isinstance(data, dict) or not data or (
            "base" not in data and any(k in data for k in ("model", "gpu", "workload"))):
        return "scenario"
    from sim.plan import PlanFile
    from sim.sweep.spec import SweepFile

    plan, sweep = set(PlanFile.model_fields), set(SweepFile.model_fields)
    if "base" not in data:  # a sweep or plan whose base: is missing or misspelt (bse:, Base:), told so by its own
        import difflib  # validation (was: "a scenario file ..., not a plan file: run it with sim run")

        plan, sweep = plan - set(Scenario.model_fields), sweep - set(Scenario.model_fields)
        near_base = difflib.get_close_matches("base", [k.lower() for k in data if isinstance(k, str)], 1, 0.7)
        if not near_base and not any(k in plan | sweep for k in data):
            return "scenario"
    for kind, keys in (("plan", plan - sweep), ("sweep", sweep - plan)):
        if any(k in data for k in keys):
            return kind
    return None


def check_kind(data: Any, path: str | Path, expected: str) -> None:
    """One clear error for a file of another kind (a plan given to ``sim run``), instead of one per key."""
    kind = file_kind(data)
    if kind is not None and kind != expected and isinstance(data, dict) and data:  # (else: expected a mapping)
        keys = ", ".join(f"{k}:" for k in list(data)[:5])
        raise ScenarioError(f"{path}: a {kind} file ({keys} ...), not a {expected} file: run it with "
                            f"`{_KIND_COMMAND[kind]} {path}`")


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem raises :class:`ScenarioError` naming file and key."""
    path = user_path(path, "scenario file", ScenarioError)
    data, lines = read_yaml(path)
    check_kind(data, path, "scenario")
    scenario = parse_scenario(data, str(path), lines, base_dir=str(path.parent))
    unread = scenario.cluster.unread_option() if scenario.cluster is not None else None
    if unread:
        line = lines.get(("cluster", "router_options"))
        raise ScenarioError(f"{path}{f':{line}' if line else ''}: cluster.{unread}")
    for i, policy in enumerate(scenario.policies):
        unread = policy.unread_option()
        if unread:
            line = lines.get(("policies", i))
            raise ScenarioError(f"{path}{f':{line}' if line else ''}: policies[{i}] ({policy.name}): {unread}")
    return scenario
