"""Calibration: measure a grid of real steps and fit the simulator's profile step-time model to them.

    grid (decode batch x context, prefill tokens x sequences x cached context, mixed, swaps)
      -> synthetic StepPlans run by the torch executor on a scratch KV pool (paged and contiguous)
      -> median of ``repeats`` runs per point (after one unmeasured run)
      -> least squares on ``sim.steptime.profile_features`` per layout, every 4th point held back
      -> PROFILE.json (``sim.steptime.load_profile`` reads it; ``step_time: {kind: profile, path: ...}``)

The fit minimises relative error (each row divided by its measured time), so short decode steps weigh
as much as long prefills; a term whose coefficient comes out negative is dropped and the rest refitted,
so every coefficient is a non-negative time per unit of something physical.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from gpu.device import configure_cpu, default_attention, default_dtype, provenance, resolve_device, synchronize, timed
from gpu.executor import TorchExecutor, scratch_plan
from gpu.kv_cache import KvCache
from gpu.model import LlamaModel, ModelShape
from sim.catalog import CatalogError, ModelSpec, resolve_model as catalog_model
from sim.config import Scenario, ScenarioError, load_scenario
from sim.policy import resolve_policy
from sim.kv import KvPool
from sim.steptime import PROFILE_FORMAT, PROFILE_TERMS, profile_features, profile_model
from sim.workload import RequestTable, TraceReader, load_requests

HELD_BACK_EVERY = 4


@dataclass(frozen=True)
class Grid:
    """The steps to measure. Decode (batch, mean cached context, see ``spread``); prefill (sequences, new
    tokens each, cached tokens each); mixed (decode batch, mean decode context, prefill tokens of one
    sequence); swap block counts."""

    decode: tuple[tuple[int, int], ...]
    prefill: tuple[tuple[int, int, int], ...]
    mixed: tuple[tuple[int, int, int], ...]
    swap_blocks: tuple[int, ...]
    repeats: int
    max_context: int  # the longest sequence a step may hold (the model's limit)

    def pool_tokens(self, block_size: int) -> int:
        """Slots the largest point needs (each sequence rounded up to whole blocks)."""
        B = block_size
        need = [b * (c + 1 + B) for b, c in self.decode] + [s * (n + c + B) for s, n, c in self.prefill]
        need += [b * (c + 1 + B) + n + B for b, c, n in self.mixed]
        return max(need + [B * max(self.swap_blocks, default=1)])


def _geometric(lo: int, hi: int, num: int) -> list[int]:
    if hi <= lo:
        return [hi]
    return sorted({int(round(x)) for x in np.geomspace(lo, hi, num)})


def make_grid(max_batch: int, max_context: int, max_prefill_tokens: int, max_pool_tokens: int,
              quick: bool = False) -> Grid:
    """Points spread geometrically over the ranges, keeping every point inside ``max_pool_tokens``."""
    n = 3 if quick else 5
    batches = _geometric(1, max_batch, n)
    contexts = _geometric(min(16, max_context - 1), max_context - 1, n)  # cached tokens before the decoded one
    decode = [(b, c) for b in batches for c in contexts if b * (c + 17) <= max_pool_tokens]
    prefill = []
    for tokens in _geometric(min(16, max_prefill_tokens), max_prefill_tokens, n + 1):
        seqs = -(-tokens // max_context)  # no sequence longer than the model allows
        prefill.append((seqs, tokens // seqs, 0))
        if tokens >= 32 * seqs:
            prefill.append((4 * seqs, tokens // (4 * seqs), 0))
        cached = min(max_context - tokens, 4 * tokens)
        if cached > 0:  # a chunk over cached context (chunked prefill, prefix hits)
            prefill.append((1, tokens, cached))
    prefill = [(s, t, c) for s, t, c in prefill if s * (t + c + 16) <= max_pool_tokens]
    mixed = []
    for b, c in decode[:: max(1, len(decode) // (2 if quick else 4))]:
        t = min(max_prefill_tokens - b, max(16, max_prefill_tokens // 4), max_context)  # one sequence's prompt
        if t > 1 and b * (c + 17) + t + 16 <= max_pool_tokens:
            mixed.append((b, c, t))
    swaps = (1, 8) if quick else (1, 4, 16, 64)
    return Grid(tuple(decode), tuple(prefill), tuple(mixed), tuple(s for s in swaps if 16 * s <= max_pool_tokens),
                3 if quick else 5, max_context)


def grid_for_scenario(scenario: Scenario, requests: RequestTable, max_pool_tokens: int, quick: bool = False) -> Grid:
    """A grid covering what the scenario's policies can schedule on its requests."""
    model = scenario.model_spec()
    longest = int((requests.prompt_tokens + requests.output_tokens).max())
    max_batch = min(max(p.max_num_seqs for p in scenario.policies), len(requests))
    gpu = scenario.gpu_spec()
    budget = max(resolve_policy(scenario, model, gpu, p).max_num_batched_tokens for p in scenario.policies)
    max_prefill = min(budget, int(np.sort(requests.prompt_tokens)[::-1][:max_batch].sum()))
    return make_grid(max_batch, min(longest, model.max_model_len), max_prefill, max_pool_tokens, quick)


def resolve_model(name: str) -> ModelSpec:
    """A catalog name or a Hugging Face config.json (a file, or a folder holding one): the catalog's rule
    (``sim.catalog.resolve_model``; this one took no folder, and called a folder without one unknown)."""
    try:
        return catalog_model(name)
    except CatalogError as e:
        raise ScenarioError(f"--model: {e}") from None


class StepBench:
    """Runs synthetic steps of fresh sequences on a scratch pool and times them. Paged sequences get
    blocks in a shuffled order (a real pool is scattered); contiguous ones consecutive slabs."""

    def __init__(self, model: LlamaModel, cache: KvCache, paged: bool, attention: str, seed: int) -> None:
        self.prompts: dict[int, int] = {}
        self.ex = TorchExecutor(model, cache, self.prompts, paged=paged, attention=attention, seed=seed)
        self.cache = cache
        self.paged = paged
        self.order = np.random.default_rng(seed).permutation(cache.num_blocks)
        self.next_id = 0

    def step_s(self, news: list[int], cached: list[int]) -> float:
        ids = list(range(self.next_id, self.next_id + len(news)))
        self.next_id += len(news)
        for i, n, c in zip(ids, news, cached):
            self.prompts[i] = n + c
        plan = scratch_plan(ids, news, cached, self.cache.block_size, self.paged,
                            block_order=self.order if self.paged else None)
        t = self.ex.step_time_s(plan)
        for i in ids:
            del self.prompts[i], self.ex.tokens[i]
        return t

    def swap_s(self, num_blocks: int) -> float:
        """One swap-out and one swap-in of ``num_blocks`` blocks (2 x num_blocks block copies)."""
        pairs = tuple((int(b), i) for i, b in enumerate(self.order[:num_blocks]))
        back = tuple((c, g) for g, c in pairs)
        return timed(self.ex.device, lambda: (self.cache.swap_out(pairs), self.cache.swap_in(back)))[1]


def spread(batch: int, context: int, cap: int) -> list[int]:
    """Cached contexts of a decode batch: evenly from context/4 to 7/4 context (mean ``context``), at most
    ``cap``, as a real batch mixes lengths (a kernel's cost can follow the longest, not only the sum)."""
    if batch == 1:
        return [context]
    lo = max(1, context // 4)
    return np.linspace(lo, 2 * context - lo, batch).round().clip(1, cap).astype(int).tolist()


def measure(bench: StepBench, grid: Grid, layout: str) -> list[dict]:
    """Median seconds of every grid point (one unmeasured run first), with its profile terms."""
    steps: list[tuple[str, list[int], list[int]]] = []
    cap = grid.max_context - 1
    steps += [("decode", [1] * b, spread(b, c, cap)) for b, c in grid.decode]
    steps += [("prefill", [n] * s, [c] * s) for s, n, c in grid.prefill]
    steps += [("mixed", [1] * b + [n], spread(b, c, cap) + [0]) for b, c, n in grid.mixed]
    rows = []
    for kind, news, cached in steps:
        bench.step_s(news, cached)
        t = float(np.median([bench.step_s(news, cached) for _ in range(grid.repeats)]))
        pre = [(n, c) for n, c in zip(news, cached) if n > 1]
        dec = [c for n, c in zip(news, cached) if n == 1]
        rows.append({"layout": layout, "kind": kind, "num_seqs": len(news),
                     "num_prefill_tokens": sum(n for n, _ in pre),
                     "prefill_attention_pairs": sum(n * c + n * (n + 1) // 2 for n, c in pre),
                     "num_decode_tokens": len(dec), "decode_context_tokens": sum(c + 1 for c in dec),
                     "measured_s": t})
    for i, row in enumerate(rows):
        row["held_back"] = i % HELD_BACK_EVERY == HELD_BACK_EVERY - 1
    return rows


def _terms(rows: list[dict]) -> np.ndarray:
    return profile_features(*(np.array([r[k] for r in rows]) for k in
                              ("num_prefill_tokens", "prefill_attention_pairs", "num_decode_tokens",
                               "decode_context_tokens")))


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of relative error (rows scaled by 1/y); terms with a negative coefficient are
    dropped (set to 0) one at a time, the most negative first, and the rest refitted."""
    w = 1.0 / y
    active = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        if active.any():
            coef[active] = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        active[int(np.argmin(coef))] = False


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    e = np.abs(predicted - measured) / measured
    return {"num_points": int(len(e)), "mape": float(e.mean()) if len(e) else None,
            "max_relative_error": float(e.max()) if len(e) else None}


def fit_layout(rows: list[dict]) -> dict:
    """Coefficients fitted on the kept points; errors on kept and held-back points."""
    x, y = _terms(rows), np.array([r["measured_s"] for r in rows])
    held = np.array([r["held_back"] for r in rows])
    coef = fit_nonnegative(x[~held], y[~held])
    pred = x @ coef
    return {"coefficients": dict(zip(PROFILE_TERMS, map(float, coef))),
            "fit": {"train": relative_errors(pred[~held], y[~held]), "held_back": relative_errors(pred[held], y[held])}}


def fit_swap(blocks: list[int], seconds: list[float]) -> float:
    """Seconds per block copy (least squares through the origin; each measurement copied 2 x blocks)."""
    b = 2 * np.asarray(blocks, dtype=np.float64)
    return float(max(0.0, (b @ np.asarray(seconds)) / (b @ b))) if len(b) else 0.0


BLOCK_COST_SIZES = (8, 16, 32, 64)


def fit_block_cost(points: list[dict], key_s: float) -> float:
    """The paged decode kernel's cost per block visited, in keys' worth (``paged_block_cost_tokens``),
    from decode steps measured paged at several block sizes and contiguous on the same batches.

    The step-time model says a paged step's extra time over the contiguous one is
    ``key_s * [K * beta / b + n * (b - 1) / 2 * (1 + beta / b)]`` (K keys, n sequences): linear in beta,
    so beta is least squares through the origin (clipped at 0)."""
    x = np.array([key_s * (p["keys"] / p["block_size"] + p["num_seqs"] * (p["block_size"] - 1) / (2 * p["block_size"]))
                  for p in points])
    y = np.array([p["paged_s"] - p["contiguous_s"] - key_s * p["num_seqs"] * (p["block_size"] - 1) / 2
                  for p in points])
    return float(max(0.0, (x @ y) / (x @ x))) if len(x) and (x @ x) > 0 else 0.0


def measure_block_cost(llama: LlamaModel, shape: ModelShape, model: ModelSpec, dev, dtype, attention: str, grid: Grid,
                       seed: int, block_sizes=BLOCK_COST_SIZES) -> list[dict]:
    """Median seconds of the grid's decode points, paged at each block size and contiguous."""
    cap = grid.max_context - 1
    points = []
    for b in block_sizes:
        pool = KvPool(-(-grid.pool_tokens(b) // b), b, model.kv_bytes_per_token(1), 0, 0, 0)
        cache = KvCache(shape, pool, dev, dtype)
        benches = {paged: StepBench(llama, cache, paged, attention, seed) for paged in (True, False)}
        if dev.type != "cpu":  # kernels specialise on the block size: compile them before timing. On the
            for bench in benches.values():  # CPU nothing compiles (calibrate's own warmups ran every path)
                bench.ex.warmup()
        # NOTE: the 3 decode points that read the most keys: where a per-block cost shows, and few enough
        # that this costs a small share of the calibration (4 block sizes x 3 points x 2 layouts)
        for batch, ctx in sorted(grid.decode, key=lambda bc: bc[0] * bc[1])[-3:]:
            cached = spread(batch, ctx, cap)
            t = {}
            for paged, bench in benches.items():  # NOTE: interleaved, so drift hits both alike
                bench.step_s([1] * batch, cached)
                t[paged] = float(np.median([bench.step_s([1] * batch, cached) for _ in range(grid.repeats)]))
            points.append({"block_size": b, "num_seqs": batch, "keys": sum(c + 1 for c in cached),
                           "paged_s": t[True], "contiguous_s": t[False]})
        del benches, cache
    return points


def calibrate(model: ModelSpec, device: str, *, grid: Grid, out: str | Path | None = None, block_size: int = 16,
              dtype: torch.dtype | None = None, attention: str | None = None, seed: int = 0,
              step_logs: list | None = None) -> dict:
    """Measure ``grid`` on ``device`` for both layouts, fit, and write the profile to ``out`` (if given).
    ``step_logs``: a list that receives every measured step's host and GPU times (the executor's log)."""
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    attention = attention or default_attention(dev)
    shape = ModelShape.from_spec(model)
    llama = LlamaModel.random(shape, dev, dtype, seed)
    num_blocks = -(-grid.pool_tokens(block_size) // block_size)
    pool = KvPool(num_blocks, block_size, model.kv_bytes_per_token(1), 0, 0, 0)
    cache = KvCache(shape, pool, dev, dtype)
    layouts, points, swap = {}, [], []
    for layout in ("paged", "contiguous"):
        bench = StepBench(llama, cache, layout == "paged", attention, seed)
        bench.ex.warmup()
        rows = measure(bench, grid, layout)
        if step_logs is not None:
            step_logs.extend(bench.ex.step_log)
        layouts[layout] = fit_layout(rows)
        points += rows
        if layout == "paged":
            for k in grid.swap_blocks:
                bench.swap_s(k)
                swap.append((k, float(np.median([bench.swap_s(k) for _ in range(grid.repeats)]))))
    block_points = measure_block_cost(llama, shape, model, dev, dtype, attention, grid, seed)
    synchronize(dev)
    key_s = layouts["contiguous"]["coefficients"]["decode_key_s"]
    profile = {
        "format": PROFILE_FORMAT,
        "model": profile_model(model),
        "provenance": provenance(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "attention": attention,
        "block_size": block_size,
        "terms": list(PROFILE_TERMS),
        "layouts": layouts,
        "swap_block_s": fit_swap([k for k, _ in swap], [t for _, t in swap]),
        # per block visited, in keys' worth: the roofline's paged_block_cost_tokens, measured
        "paged_block_cost_tokens": fit_block_cost(block_points, key_s),
        "grid": asdict(grid),
        "points": points,
        "swap_points": [{"num_blocks": k, "measured_s": t} for k, t in swap],
        "block_cost_points": block_points,
    }
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(profile, indent=1))
    return profile


def calibrate_to_file(out: str | Path, device: str, *, model: str | None = None, scenario: str | Path | None = None,
                      quick: bool = False, cpu_threads: int | None = 1, read_trace: TraceReader | None = None) -> dict:
    """``sim calibrate``: the model by name (or the scenario's); the grid over the scenario's range when
    one is given, else over a default range (batches to 64, contexts to 4096, prefills to 2048 tokens)."""
    configure_cpu(cpu_threads if str(device) == "cpu" else None)
    if model is None and scenario is None:
        raise ScenarioError("sim calibrate needs --model or --scenario")
    scen = load_scenario(scenario) if scenario is not None else None
    spec = resolve_model(model) if model is not None else scen.model_spec()
    if scen is not None:
        if spec != scen.model_spec():
            raise ScenarioError(f"--model {spec.name} is not the model of {scenario} ({scen.model}); give one of them")
        from sim.run import policy_pool

        gpu = scen.gpu_spec()
        pool_tokens = max(policy_pool(scen, spec, gpu, p).num_slots for p in scen.policies)
        grid = grid_for_scenario(scen, load_requests(scen, read_trace), pool_tokens, quick)
    else:
        ctx = min(spec.max_model_len, 4096)
        grid = make_grid(64, ctx, 2048, 64 * ctx // 4, quick)
    return calibrate(spec, device, grid=grid, out=out)


def print_profile(profile: dict, path: str | Path, console) -> None:
    p = profile["provenance"]
    console.print(f"{profile['model']['name']} ({profile['model']['num_layers']} layers) on {p['device']}, "
                  f"{profile['dtype']}, {profile['attention']} attention: {len(profile['points'])} steps measured",
                  highlight=False, markup=False)
    for layout, v in profile["layouts"].items():
        fit = v["fit"]["held_back"]
        mape = "-" if fit["mape"] is None else f"{fit['mape']:.1%}"
        worst = "-" if fit["max_relative_error"] is None else f"{fit['max_relative_error']:.1%}"
        console.print(f"  {layout:>10}: held-back MAPE {mape} over {fit['num_points']} points (max {worst})",
                      highlight=False, markup=False)
    if "paged_block_cost_tokens" in profile:
        console.print(f"  paged block cost: {profile['paged_block_cost_tokens']:.2f} keys' worth per block "
                      f"(block sizes {', '.join(str(b) for b in sorted({p['block_size'] for p in profile['block_cost_points']}))})",
                      highlight=False, markup=False)
    console.print(f"  profile: {path}", highlight=False, markup=False)
