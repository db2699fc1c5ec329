"""Measured GPU operator profiles (Vidur's layout) and the per-GPU operator model fitted to them.

A profile folder in Vidur's layout (``vidur/data/profiling/`` or a user's own profiling output):

    compute/<gpu>/<org>/<model>/mlp.csv      one row per (num_tokens, num_tensor_parallel_workers): the
                                             median ms of each non-attention op of ONE layer
    network/<topology>/all_reduce.csv        all-reduce ms by message size (bytes) and num_workers

The fit is **per GPU, not per model**: every op is priced from its shape (GEMM dimensions, bytes moved)
and the GPU's datasheet, and the few coefficients (efficiencies, launch costs, a transition sharpness)
are fitted on all the models measured on that GPU. So a model never profiled on a GPU (any catalog
model, any config.json) is priced by the same coefficients; leave-one-model-out validation
(``validate``) measures how well that carries over.

Op models (times in seconds; M tokens; N, K the GEMM's output and reduction sizes on one TP rank):

    GEMM         launch + (t_c**p + t_m**p) ** (1/p)
                   t_c = 2*R*N*K / (compute_eff * peak FLOP/s) * (1 + m_tile / R)   tile under-use at small M
                   t_m = 2 * (M*K + K*N + M*N) bytes / (bandwidth_eff * HBM bytes/s)
                 R: M, rounded up to whole tiles of ``tile_rows`` once M exceeds one (``GEMM_TILE_ROWS``);
                 a smooth (p-norm) transition between the weight-streaming and compute-bound regimes:
                 no kink at the ridge point, where ``max(t_c, t_m)`` would switch abruptly.
    elementwise  launch + bytes / (bandwidth_eff * HBM bytes/s)     per op kind (norm, rope, act, add)
    all-reduce   (latency**p + (bytes / bus bytes/s)**p) ** (1/p)   per (topology, num_workers)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Final

import numpy as np
import pandas as pd

from sim.catalog import MAX_CONFIG_INT, AllReduceFit, ElementwiseFit, GemmFit, GpuSpec, ModelSpec, OperatorFit
from sim.kv import CapacityError, check_tensor_parallel

# The ops of one layer as Vidur names them; ``add`` (a residual add) runs twice per layer.
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
LAYER_OPS = GEMM_OPS + ELEMENTWISE_OPS
OP_CALLS_PER_LAYER = {op: 2 if op == "add" else 1 for op in LAYER_OPS}
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
KEY_COLUMNS = ("num_tokens", "num_tensor_parallel_workers")
NETWORK_COLUMNS = ("num_workers", "size", "time_stats.all_reduce.median")

# Vidur's GPU folder names -> catalog GPUs; network topologies -> the GPU whose tensor-parallel group uses it.
PROFILE_GPUS = {"a100": "a100-80gb", "h100": "h100", "a40": "a40"}
TOPOLOGY_GPUS = {"a100_dgx": "a100-80gb", "h100_dgx": "h100"}

# The largest value a column may hold: above it a figure is no measurement (a typo, a unit mix-up) and would drag
# the fit to its bounds. A batch of 2**24 tokens holds any catalog model's whole context (Llama-4-Scout:
# 10,485,760); a scenario's tensor_parallel is at most 1,024. Vidur's slowest op takes 39 ms (a 70B layer's
# gate/up at 4,096 tokens on an A40); even a 400B-class layer's gate/up at 2**24 tokens on an A40 takes
# about 390 s, under the 10**6 ms allowed for one op of one layer.
LIMITS = {"num_tokens": (2**24, "tokens in one batch"),
          "num_tensor_parallel_workers": (1024, "(a scenario's limit on tensor_parallel)"),
          "num_workers": (1024, "(a scenario's limit on tensor_parallel)"),
          "time_stats": (1e6, "ms (17 minutes for one op of one layer: no kernel time)"),
          # a model's sizes: as a config.json's are bounded (sim.catalog.model_from_hf_config)
          **{c: (MAX_CONFIG_INT, "(as in a model's config.json)")
             for c in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")}}


class ProfileError(ValueError):
    """A profile file that cannot be read: the message names the file, line and column."""


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class ComputeProfile:
    gpu: str  # Vidur's folder name (a100, h100, a40, ...)
    model: str  # org/model
    path: Path
    table: pd.DataFrame  # KEY_COLUMNS + SHAPE_COLUMNS + one median-ms column per op in LAYER_OPS


@dataclass
class NetworkProfile:
    topology: str
    path: Path
    table: pd.DataFrame  # num_workers, size (bytes), time_ms


def _read_csv(path: Path, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> pd.DataFrame:
    """The file's rows, with ``required`` and whichever ``optional`` columns it has checked as numbers."""
    try:
        df = pd.read_csv(path, skip_blank_lines=False)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: not a readable CSV file ({str(e).strip()})") from None
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ProfileError(f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                           f"(expected Vidur's profiling columns)")
    if not len(df):
        raise ProfileError(f"{path}: no rows")
    for col in required + tuple(c for c in optional if c in df.columns):
        raw = df[col]
        if col == "use_gated_mlp" and not pd.api.types.is_numeric_dtype(raw):  # true/false among 0/1 (alone: bool)
            raw = raw.map(lambda s: {"true": 1, "false": 0}.get(str(s).strip().lower(), s))
        v = pd.to_numeric(raw, errors="coerce")
        x = v.to_numpy(dtype=np.float64)
        if col == "use_gated_mlp":
            what, bad = "0 or 1 (false or true)", (x != 0) & (x != 1)
        elif col.startswith("time_stats."):  # a 0-ms time is no measurement (log-time fit)
            what, bad = "a time > 0 ms", ~(np.isfinite(x) & (x > 0))
        else:  # counts and sizes
            what, bad = "a positive whole number", ~(np.isfinite(x) & (x > 0)) | (x % 1 != 0)
        limit, why = LIMITS.get("time_stats" if col.startswith("time_stats.") else col, (np.inf, ""))
        over = ~bad & (x > limit)
        if (bad | over).any():
            i = int(np.flatnonzero(bad | over)[0])
            got = df[col].iloc[i]
            got = got.item() if isinstance(got, np.generic) else got  # 3.5, nan: not np.float64(3.5)
            raise ProfileError(f"{path}: line {i + 2}, column {col!r}: expected "
                               f"{what if bad[i] else f'at most {limit:,.0f} {why}'}, got {got!r}")
        df[col] = v
    return df


def read_compute_profile(path: str | Path) -> ComputeProfile:
    """One ``compute/<gpu>/<org>/<model>/mlp.csv``."""
    path = Path(path)
    # NOTE: every layer has the GEMMs; an elementwise op a model lacks is absent (phi-2 runs attention and
    # MLP in parallel after one norm: no post_attention_layernorm column), and stays NaN here
    df = _read_csv(path, KEY_COLUMNS + SHAPE_COLUMNS + tuple(f"time_stats.{op}.median" for op in GEMM_OPS),
                   tuple(f"time_stats.{op}.median" for op in ELEMENTWISE_OPS))
    present = [op for op in LAYER_OPS if f"time_stats.{op}.median" in df.columns]
    shape = df[list(SHAPE_COLUMNS)].drop_duplicates()
    if len(shape) > 1:
        i = int(df.index[(df[list(SHAPE_COLUMNS)] != df[list(SHAPE_COLUMNS)].iloc[0]).any(axis=1)][0])
        raise ProfileError(f"{path}: line {i + 2}: the model's shape columns ({', '.join(SHAPE_COLUMNS)}) "
                           f"differ from the first row's: one file holds one model")
    table = df[list(KEY_COLUMNS + SHAPE_COLUMNS)].astype(np.int64).copy()
    r = table.iloc[0]  # the heads split the width, and the key-value heads the heads, as a config.json's must
    for col, whole, part in (("n_embd", r.n_embd, r.n_head), ("n_head", r.n_head, r.n_kv_head)):
        if whole % part:
            raise ProfileError(f"{path}: line 2, column {col!r}: {whole} is not a multiple of "
                               f"{'n_head' if col == 'n_embd' else 'n_kv_head'} {part}")
    name = "/".join(path.parts[-3:-1])
    model = profile_model(table, name)
    for tp in table.num_tensor_parallel_workers.unique():  # heads split over the ranks, as a run requires
        try:
            check_tensor_parallel(model, int(tp))
        except CapacityError as e:
            i = int(np.flatnonzero(table.num_tensor_parallel_workers == tp)[0])
            raise ProfileError(f"{path}: line {i + 2}, column 'num_tensor_parallel_workers': {e}") from None
    for op in LAYER_OPS:
        table[op] = df[f"time_stats.{op}.median"].astype(np.float64) if op in present else np.nan
    # NOTE: Vidur's files repeat some (num_tokens, tp) rows (measured twice): their mean is the measurement
    table = table.groupby(list(KEY_COLUMNS + SHAPE_COLUMNS), as_index=False, dropna=False)[list(LAYER_OPS)].mean()
    return ComputeProfile(gpu=path.parts[-4] if len(path.parts) >= 4 else "?", model=name, path=path, table=table)


def read_network_profile(path: str | Path) -> NetworkProfile:
    """One ``network/<topology>/all_reduce.csv``; only single-node groups (devices_per_node ≥ num_workers)."""
    path = Path(path)
    df = _read_csv(path, NETWORK_COLUMNS)
    if "devices_per_node" in df.columns:
        single = pd.to_numeric(df.devices_per_node, errors="coerce") >= df.num_workers
        if not single.any():  # a topology with no fit of its own would still be claimed by its GPU's fit
            pairs = sorted({(int(w), str(d)) for w, d in zip(df.num_workers, df.devices_per_node)})
            raise ProfileError(f"{path}: no usable rows: the fit uses all-reduces within one node (devices_per_node "
                               f"≥ num_workers), and every row spans nodes (num_workers/devices_per_node: "
                               f"{', '.join(f'{w}/{d}' for w, d in pairs[:6])}{', ...' if len(pairs) > 6 else ''})")
        df = df[single]
    table = pd.DataFrame({"num_workers": df.num_workers.astype(np.int64), "size": df["size"].astype(np.int64),
                          "time_ms": df["time_stats.all_reduce.median"].astype(np.float64)})
    return NetworkProfile(topology=path.parent.name, path=path, table=table.reset_index(drop=True))


@dataclass
class ProfileSet:
    root: Path
    compute: list[ComputeProfile] = field(default_factory=list)
    network: list[NetworkProfile] = field(default_factory=list)

    def gpus(self) -> list[str]:
        return sorted({p.gpu for p in self.compute})

    def for_gpu(self, gpu: str) -> list[ComputeProfile]:
        return [p for p in self.compute if p.gpu == gpu]

    def need_compute(self) -> None:
        """Fitting a GPU needs its compute profiles; all-reduce files alone fit no GPU's coefficients."""
        if not self.compute:
            raise ProfileError(f"no compute profiles (compute/<gpu>/<org>/<model>/mlp.csv) under {self.root}"
                               + (f"; all-reduce files alone ({', '.join(n.topology for n in self.network)}) give "
                                  f"no GPU's coefficients" if self.network else ""))


def read_profiles(root: str | Path) -> ProfileSet:
    """Every ``compute/*/*/*/mlp.csv`` and ``network/*/all_reduce.csv`` under ``root`` (Vidur's layout)."""
    root = Path(root)
    if not root.is_dir():
        raise ProfileError(f"{root}: no such profile folder (expected Vidur's layout: compute/<gpu>/<org>/<model>/"
                           f"mlp.csv, network/<topology>/all_reduce.csv)")
    out = ProfileSet(root)
    out.compute = [read_compute_profile(p) for p in sorted(root.glob("compute/*/*/*/mlp.csv"))]
    out.network = [read_network_profile(p) for p in sorted(root.glob("network/*/all_reduce.csv"))]
    if not out.compute and not out.network:
        # a parent of the layout (``../shared/profiles`` holds ``vidur/``): name the folders that hold it
        found = (("*/compute/*/*/*/mlp.csv", 4), ("*/*/compute/*/*/*/mlp.csv", 4), ("*/network/*/all_reduce.csv", 2),
                 ("*/*/network/*/all_reduce.csv", 2))  # (pattern, the layout's root: that many folders up)
        below = sorted({str(p.parents[up]) for pat, up in found for p in root.glob(pat)})
        raise ProfileError(f"{root}: no compute/<gpu>/<org>/<model>/mlp.csv or network/<topology>/all_reduce.csv "
                           f"files found" + (f"; Vidur's layout is in {' and '.join(below)}: pass that folder"
                                             if below else ""))
    return out


# ---------------------------------------------------------------------------------------------- op shapes


def profile_model(table: pd.DataFrame, name: str) -> ModelSpec:
    """The shape a profile's columns give (layers and lengths are not in the files and not needed here)."""
    r = table.iloc[0]
    return ModelSpec(name, 1, int(r.n_embd), int(r.n_head), int(r.n_kv_head), int(r.n_expanded_embd),
                     int(r.vocab_size), 4096, gated_mlp=bool(r.use_gated_mlp), tie_embeddings=False)


# ---------------------------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class Coef:
    """One fitted coefficient: the optimizer's start and bounds, in ``unit`` (the fit's field is the value times
    ``unit``). A ``floor`` lower bound is where a term of the model vanishes (no launch cost, no tile term; at
    sharpness 1 the two regimes add): a fit may well end there. Ending at any other bound says the measurements
    are beyond what the model fits, and ``fit_notes`` says so."""

    name: str
    start: float
    lower: float
    upper: float
    unit: float = 1.0
    floor: bool = False


GEMM_COEFS = (Coef("launch_s", 8.0, 0.0, 200.0, 1e-6, floor=True), Coef("compute_efficiency", 0.7, 0.05, 1.0),
              Coef("bandwidth_efficiency", 0.8, 0.05, 1.2), Coef("sharpness", 2.0, 1.0, 20.0, floor=True),
              Coef("tile_tokens", 10.0, 0.0, 2000.0, floor=True))
# Row tiles the GEMM fit tries (``GemmFit.tile_rows``; 1: the smooth curve). NOTE: measured GEMMs step up
# just past multiples of 64 or 128 tokens (whole tiles of rows), and the smooth curve fitted through the
# steps priced a full decode batch up to a quarter slow. Leave-one-model-out over Vidur's profiles (``sim
# profiles validate``), smooth -> tiled: layer MAPE A100 4.1 -> 3.4 %, H100 5.5 -> 5.0 %, A40 4.2 -> 4.2 %;
# at 256 tokens +12.8 -> -1.5 %, +25.8 -> +11.0 %, +14.5 -> +8.1 %. Rounding every M (a short batch too)
# fitted as well on A100 and H100 only with a bandwidth efficiency above the datasheet's
# (benchmarks/bench_gemm_forms.py); ``pick_tile`` refuses such fits.
GEMM_TILE_ROWS = (1, 16, 32, 64, 128, 256)
ELEMENTWISE_COEFS = (Coef("launch_s", 5.0, 0.0, 200.0, 1e-6, floor=True), Coef("bandwidth_efficiency", 0.5, 0.01, 1.2))
ALLREDUCE_COEFS = (Coef("latency_s", 20.0, 0.1, 1000.0, 1e-6), Coef("bus_bytes_per_s", 100.0, 0.1, 5000.0, 1e9),
                   Coef("sharpness", 2.0, 1.0, 20.0, floor=True))


def _least_squares(fun, cls, coefs):
    """``cls`` with the coefficients that minimise ``fun(cls(...))`` (residuals) within their bounds."""
    from scipy.optimize import least_squares  # NOTE: only fitting needs scipy; pricing a step does not

    def make(x):
        return cls(**{c.name: v * c.unit for c, v in zip(coefs, x)})

    x = least_squares(lambda x: fun(make(x)), [c.start for c in coefs],
                      bounds=([c.lower for c in coefs], [c.upper for c in coefs]), x_scale="jac").x
    return make([float(v) for v in x])


def at_bounds(fit, coefs) -> list[str]:
    """The coefficients of ``fit`` that ended at a bound other than a floor (within 1e-6 of their range)."""
    out = []
    for c in coefs:
        v, tol = getattr(fit, c.name) / c.unit, 1e-6 * (c.upper - c.lower)
        if v >= c.upper - tol or (v <= c.lower + tol and not c.floor):
            out.append(f"{c.name}={getattr(fit, c.name):.4g} (its {'upper' if v >= c.upper - tol else 'lower'} bound)")
    return out


def _gemm_rows(profiles: list[ComputeProfile]):
    Ms, Ns, Ks, ys = [], [], [], []
    for p in profiles:
        model = profile_model(p.table, p.model)
        for tp, g in p.table.groupby("num_tensor_parallel_workers"):
            shapes = model.layer_gemms(int(tp))
            for op in GEMM_OPS:
                n, k = shapes[op]
                Ms.append(g.num_tokens.to_numpy(np.float64))
                Ns.append(np.full(len(g), n, np.float64))
                Ks.append(np.full(len(g), k, np.float64))
                ys.append(g[op].to_numpy(np.float64) / 1e3)
    return [np.concatenate(a) for a in (Ms, Ns, Ks, ys)]


def fit_gemm(profiles: list[ComputeProfile], gpu: GpuSpec) -> GemmFit:
    """Fit the GEMM coefficients on every GEMM of every profile (relative error: least squares in log time),
    once per row tile of ``GEMM_TILE_ROWS``; ``pick_tile`` chooses among the fits."""
    M, N, K, y = _gemm_rows(profiles)
    ok = y > 0

    def resid(fit):
        return np.log(fit.time_s(M[ok], N[ok], K[ok], gpu) / y[ok])

    fits = [_least_squares(resid, partial(GemmFit, tile_rows=t), GEMM_COEFS) for t in GEMM_TILE_ROWS]
    return pick_tile(fits, [float(np.sum(resid(f) ** 2)) for f in fits])


# a taller tile must fit better than a shorter one by more than this (relative squared error) to win: the
# optimizer's own noise is a few parts per million, and on data without steps several tiles fit alike
TILE_MARGIN: Final = 1e-4


def pick_tile(fits: list[GemmFit], errors: list[float]) -> GemmFit:
    """The fit with the least squared error ``errors``, the shortest tile among those within ``TILE_MARGIN`` of
    it, among the physical ones: no coefficient at a bound of the optimizer (``at_bounds``) and efficiencies at
    most 1 (a fit may reach 1.2 to say the data lie beyond the model; one that needs memory faster than the
    datasheet fits the measured models, not the GPU). If none is physical, among all."""
    ok = [i for i, f in enumerate(fits)
          if not at_bounds(f, GEMM_COEFS) and f.compute_efficiency <= 1.0 and f.bandwidth_efficiency <= 1.0]
    ok = ok or list(range(len(fits)))
    best = min(errors[i] for i in ok)
    return min((fits[i] for i in ok if errors[i] <= best * (1.0 + TILE_MARGIN)), key=lambda f: f.tile_rows)


def fit_elementwise(profiles: list[ComputeProfile], gpu: GpuSpec) -> dict[str, ElementwiseFit]:
    """Per op kind: launch + bytes / (efficiency * HBM bandwidth), fitted in log time."""
    out = {}
    for op in ELEMENTWISE_OPS:
        b, y = [], []
        for p in profiles:
            model = profile_model(p.table, p.model)
            for tp, g in p.table.groupby("num_tensor_parallel_workers"):
                b.append(g.num_tokens.to_numpy(np.float64) * model.layer_elementwise_bytes(int(tp))[op])
                y.append(g[op].to_numpy(np.float64) / 1e3)
        b, y = np.concatenate(b), np.concatenate(y)
        ok = y > 0  # NaN (an op the model lacks) compares False
        if not ok.any():  # measured on no model: not fitted (the datasheet roofline prices it; ``fit_notes``)
            continue

        def resid(e):
            return np.log((e.launch_s + b[ok] / (e.bandwidth_efficiency * gpu.hbm_bytes_per_s)) / y[ok])

        out[op] = _least_squares(resid, ElementwiseFit, ELEMENTWISE_COEFS)
    return out


def fit_allreduce(net: NetworkProfile) -> dict[int, AllReduceFit]:
    """Per worker count: a p-norm of a fixed latency and bytes over a bus bandwidth."""
    out = {}
    for w, g in net.table.groupby("num_workers"):
        s, y = g["size"].to_numpy(np.float64), g.time_ms.to_numpy(np.float64) / 1e3
        ok = y > 0

        def resid(fit):
            return np.log(fit.time_array(s[ok]) / y[ok])

        out[int(w)] = _least_squares(resid, AllReduceFit, ALLREDUCE_COEFS)
    return out


def fit_gpu(profiles: list[ComputeProfile], gpu: GpuSpec, network: NetworkProfile | None = None,
            source: str = "") -> OperatorFit:
    """All of one GPU's coefficients from the given profiles (all of them measured on that GPU)."""
    models = sorted({p.model for p in profiles})
    return OperatorFit(gemm=fit_gemm(profiles, gpu), elementwise=fit_elementwise(profiles, gpu),
                       allreduce=fit_allreduce(network) if network is not None else {},
                       topology=network.topology if network is not None else "",
                       source=source or f"fitted to {', '.join(models)}")


# ---------------------------------------------------------------------------------------------- predicting


def predict_ops(fit: OperatorFit | None, gpu: GpuSpec, model: ModelSpec, tp: int, tokens) -> dict[str, np.ndarray]:
    """Predicted ms per call of each layer op for token counts ``tokens`` (an array), by the step-time
    model's own op pricer: with ``fit`` (fitted coefficients) or, when None, the datasheet roofline."""
    from sim.config import RooflineConfig
    from sim.steptime import OpPricer

    pricer = OpPricer(model, replace(gpu, operators=fit), tp,
                      RooflineConfig(operators="fitted" if fit is not None else "datasheet"))
    M = np.asarray(tokens, np.float64)
    out = {op: np.asarray(pricer.gemm_s(M, n, k)) * 1e3 for op, (n, k) in pricer.gemms.items()}
    for op in pricer.elementwise:  # the ops this model has (OPT: no rope)
        out[op] = np.asarray(pricer.elementwise_s(op, M)) * 1e3
    return out


def layer_ms(ops: dict[str, np.ndarray], present=LAYER_OPS) -> np.ndarray:
    """One layer's non-attention time: the sum of its ops (``add`` twice), of those ``present``."""
    return sum(ops[op] * OP_CALLS_PER_LAYER[op] for op in present)


def measured_ops(p: ComputeProfile, tp: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Token counts and the measured ms of each op the model has, at one TP degree."""
    g = p.table[p.table.num_tensor_parallel_workers == tp]
    return g.num_tokens.to_numpy(), {op: g[op].to_numpy(np.float64) for op in LAYER_OPS if g[op].notna().all()}


# ---------------------------------------------------------------------------------------------- validation


def _ape(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred / meas - 1.0)


def leave_one_model_out(ps: ProfileSet, gpu_specs: dict[str, GpuSpec]) -> pd.DataFrame:
    """For every GPU and every model measured on it: fit on the other models, predict this one.

    One row per (gpu, left-out model, tp, num_tokens, op) with the measured and predicted ms, for the
    fitted model ("fitted") and the datasheet roofline ("roofline"); op ``layer`` is the layer's sum."""
    ps.need_compute()
    rows = []
    alone = []  # GPUs with one model measured: nothing to fit on when it is left out
    for g in ps.gpus():
        spec = gpu_specs[g]
        profs = ps.for_gpu(g)
        if len(profs) < 2:
            alone.append(g)
            continue
        for left in profs:
            fit = fit_gpu([p for p in profs if p is not left], spec)
            model = profile_model(left.table, left.model)
            for tp in sorted(left.table.num_tensor_parallel_workers.unique()):
                tokens, meas = measured_ops(left, int(tp))
                for kind, pred in (("fitted", predict_ops(fit, spec, model, int(tp), tokens)),
                                   ("roofline", predict_ops(None, spec, model, int(tp), tokens))):
                    for op in tuple(meas) + ("layer",):
                        m = layer_ms(meas, tuple(meas)) if op == "layer" else meas[op]
                        q = layer_ms(pred, tuple(meas)) if op == "layer" else pred[op]
                        rows.append(pd.DataFrame({"gpu": g, "model": left.model, "tp": int(tp), "num_tokens": tokens,
                                                  "op": op, "kind": kind, "measured_ms": m, "predicted_ms": q}))
    if not rows:
        raise ProfileError(f"leave-one-model-out needs at least two models measured on a GPU; "
                           f"{', '.join(alone)} {'has' if len(alone) == 1 else 'have'} one each")
    df = pd.concat(rows, ignore_index=True)
    df["ape"] = _ape(df.predicted_ms.to_numpy(), df.measured_ms.to_numpy())
    df.attrs["single_model_gpus"] = alone
    return df


def allreduce_errors(ps: ProfileSet, fits: dict[str, dict[int, AllReduceFit]]) -> pd.DataFrame:
    """In-sample error of each topology's all-reduce fit (there is one measured topology per fit)."""
    rows = []
    for net in ps.network:
        fit = fits[net.topology]
        for w, g in net.table.groupby("num_workers"):
            if int(w) in fit:
                pred = fit[int(w)].time_array(g["size"].to_numpy(np.float64)) * 1e3
                rows.append(pd.DataFrame({"topology": net.topology, "num_workers": int(w), "size": g["size"],
                                          "measured_ms": g.time_ms, "predicted_ms": pred}))
    df = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    if len(df):
        df["ape"] = _ape(df.predicted_ms.to_numpy(), df.measured_ms.to_numpy())
    return df


def mape_table(loo: pd.DataFrame) -> pd.DataFrame:
    """Per GPU and op: MAPE (%) of the fitted and the roofline model, and the worst token count's MAPE
    (the mean over left-out models and TP degrees at one token count)."""
    by = loo.groupby(["gpu", "op", "kind"])
    t = by.ape.mean().unstack("kind") * 100
    worst = loo.groupby(["gpu", "op", "kind", "num_tokens"]).ape.mean().groupby(["gpu", "op", "kind"]).max()
    t = t.join((worst.unstack("kind") * 100).add_suffix("_worst_tokens"))
    return t.reset_index()


TOKEN_RANGES = ((1, 16), (17, 128), (129, 512), (513, None))  # small decode batches .. prefill chunks
# token counts a band's mean hides: a full decode batch at max_num_seqs 128, 256 (the default) or 512, which
# are also multiples of cuBLAS's tiles, where measured GEMMs run fastest and a fit errs most
FULL_BATCHES = (128, 256, 512)


def bias_table(loo: pd.DataFrame) -> pd.DataFrame:
    """Per GPU and token range, the fitted model's error on one layer's whole time (``layer``): signed mean
    (%, negative: predicted faster than measured) and MAPE (%), over the left-out models and TP degrees; then
    the same at each of ``FULL_BATCHES`` measured (``=256``), with the largest signed error of one model and
    TP degree there (``worst``; the ranges leave it empty). A MAPE over every token count hides a bias where
    decode batches live (a handful of the measured counts), and a band's mean hides one token count."""
    layer = loo[(loo.op == "layer") & (loo.kind == "fitted")]
    err = layer.predicted_ms / layer.measured_ms - 1.0
    rows = []
    for gpu in sorted(layer.gpu.unique()):
        for lo, hi in TOKEN_RANGES:
            m = (layer.gpu == gpu) & (layer.num_tokens >= lo) & ((layer.num_tokens <= hi) if hi else True)
            if m.any():
                e = err[m]
                rows.append({"gpu": gpu, "tokens": f"{lo}-{hi}" if hi else f"{lo}+", "rows": int(m.sum()),
                             "signed_error": float(e.mean() * 100), "mape": float(e.abs().mean() * 100)})
        for t in FULL_BATCHES:
            m = (layer.gpu == gpu) & (layer.num_tokens == t)
            if m.any():
                e = err[m]
                by = e.groupby([layer.model[m], layer.tp[m]]).mean()
                rows.append({"gpu": gpu, "tokens": f"={t}", "rows": int(m.sum()), "signed_error": float(e.mean() * 100),
                             "mape": float(e.abs().mean() * 100),
                             "worst": float(by.loc[by.abs().idxmax()] * 100)})
    return pd.DataFrame(rows, columns=["gpu", "tokens", "rows", "signed_error", "mape", "worst"])


def gpu_specs(ps: ProfileSet) -> dict[str, GpuSpec]:
    """The catalog GPU of each profile folder (Vidur's names, or a catalog name); an unknown one is an error."""
    from sim.catalog import GPUS

    unknown = [g for g in ps.gpus() if PROFILE_GPUS.get(g, g) not in GPUS]
    if unknown:
        raise ProfileError(f"{ps.root}: no catalog GPU for profile folder(s) {', '.join(unknown)} (expected one of "
                           f"{', '.join(sorted(set(PROFILE_GPUS) | set(GPUS)))})")
    return {g: GPUS[PROFILE_GPUS.get(g, g)] for g in ps.gpus()}


def profile_commit(root: str | Path) -> str:
    """The upstream commit a copied profile folder records (Vidur's ``COMMIT`` file), if any."""
    f = Path(root) / "COMMIT"
    return f.read_text(errors="replace").strip()[:64] if f.is_file() else ""


def profile_origin(root: str | Path) -> str:
    """Who measured a profile folder, as a fit's ``source`` begins: this project's ``gpu/gemm_profile.py``
    (its ``provenance.json``: runs, device, date) or Vidur (its ``COMMIT`` file)."""
    root = Path(root)
    try:
        prov = json.loads((root / "provenance.json").read_text())
    except (OSError, ValueError):
        prov = None
    if isinstance(prov, dict):
        runs = [r for r in (prov.get("runs") or [prov]) if isinstance(r, dict)]
        devices = sorted({str(r["device"]) for r in runs if r.get("device")})
        dates = sorted(str(r["date"])[:10] for r in runs if r.get("date"))
        return (f"gpu/gemm_profile.py, {len(runs)} run{'s' if len(runs) != 1 else ''}"
                f"{' on ' + ', '.join(devices) if devices else ''}{' ' + dates[0] if dates else ''}")
    commit = profile_commit(root)
    return f"Vidur profiles{' @' + commit[:12] if commit else ''}"


def fit_catalog_literals(ps: ProfileSet, gpu_specs: dict[str, GpuSpec], origin: str = "Vidur profiles"
                         ) -> dict[str, OperatorFit]:
    """The coefficients the catalog ships: each profiled GPU fitted on all its models, with the
    all-reduce of its topology; ``origin`` (``profile_origin``) begins each fit's source."""
    ps.need_compute()
    nets = {n.topology: n for n in ps.network}
    out = {}
    for g in ps.gpus():
        name = PROFILE_GPUS.get(g, g)
        topo = next((t for t, gg in TOPOLOGY_GPUS.items() if gg == name and t in nets), None)
        models = sorted({p.model.split("/")[-1] for p in ps.for_gpu(g)})
        src = f"{origin}: {g}, {', '.join(models)}"
        if topo:
            src += f"; all-reduce {topo}"
        out[name] = fit_gpu(ps.for_gpu(g), gpu_specs[g], nets.get(topo) if topo else None, source=src)
    return out


def fit_notes(ps: ProfileSet, fits: dict[str, OperatorFit]) -> list[str]:
    """What a reader of the fitted coefficients must know (``sim profiles fit`` and ``validate`` print it): the
    coefficients that ended at a bound of the optimizer (``Coef``), the ops measured on no model of a GPU,
    which the datasheet roofline prices (``OpPricer.elementwise_s``), and the network files no GPU's fit uses."""
    notes = []
    unused = [n for n in ps.network if n.topology not in {f.topology for f in fits.values()}]
    other = [str(n.path.relative_to(ps.root)) for n in unused if n.topology not in TOPOLOGY_GPUS]
    parts = [f"{', '.join(other)} (a GPU's all-reduce comes from "
             f"{', '.join(f'{t} for {g}' for t, g in TOPOLOGY_GPUS.items())} only)"] if other else []
    parts += [f"{n.path.relative_to(ps.root)} (no {TOPOLOGY_GPUS[n.topology]} compute profiles)"
              for n in unused if n.topology in TOPOLOGY_GPUS]
    if parts:
        notes.append(f"note: not used by any GPU's fit: {'; '.join(parts)}")
    for name, fit in fits.items():
        stuck = ([f"GEMM {c}" for c in at_bounds(fit.gemm, GEMM_COEFS)]
                 + [f"{op} {c}" for op, e in fit.elementwise.items() for c in at_bounds(e, ELEMENTWISE_COEFS)]
                 + [f"all-reduce x{w} {c}" for w, a in fit.allreduce.items() for c in at_bounds(a, ALLREDUCE_COEFS)])
        if stuck:
            notes.append(f"warning: {name}: the fit ended at its bounds, not at a fit of the measurements: "
                         f"{', '.join(stuck)}; check the profile's times")
        missing = [op for op in ELEMENTWISE_OPS if op not in fit.elementwise]
        if missing:
            notes.append(f"warning: {name}: {', '.join(missing)} measured on no model (no file has its column): "
                         f"not fitted; the datasheet roofline prices {'it' if len(missing) == 1 else 'them'}")
    return notes


def fit_to_dict(fit: OperatorFit) -> dict:
    d = asdict(fit)
    d["allreduce"] = {str(k): v for k, v in d["allreduce"].items()}
    return d


def _round(x: float) -> float:
    return float(f"{x:.4g}") if x else 0.0


def fit_literal(fit: OperatorFit) -> str:
    """Python source of ``fit``, as pasted into ``sim/catalog.py``."""
    g = fit.gemm
    lines = ["OperatorFit(",
             f"    gemm=GemmFit(launch_s={_round(g.launch_s)!r}, compute_efficiency={_round(g.compute_efficiency)!r}, "
             f"bandwidth_efficiency={_round(g.bandwidth_efficiency)!r}, sharpness={_round(g.sharpness)!r}, "
             f"tile_tokens={_round(g.tile_tokens)!r}, tile_rows={g.tile_rows!r}),",
             "    elementwise={"]
    for op, e in fit.elementwise.items():
        lines.append(f"        {op!r}: ElementwiseFit({_round(e.launch_s)!r}, {_round(e.bandwidth_efficiency)!r}),")
    lines += [f"        # {op!r}: not measured on this GPU: priced by the datasheet roofline"
              for op in ELEMENTWISE_OPS if op not in fit.elementwise]
    lines.append("    },")
    lines.append("    allreduce={" + ", ".join(
        f"{w}: AllReduceFit({_round(a.latency_s)!r}, {_round(a.bus_bytes_per_s)!r}, {_round(a.sharpness)!r})"
        for w, a in fit.allreduce.items()) + "},")
    lines.append(f"    topology={fit.topology!r},")
    lines.append(f"    source={fit.source!r},")
    lines.append(")")
    return "\n".join(lines)


def smoothness(fit: OperatorFit, gpu: GpuSpec, model: ModelSpec, tp: int, max_tokens: int = 4096
               ) -> tuple[float, float]:
    """(the largest relative change of the predicted layer time between adjacent token counts within a GEMM
    tile (not from k to k + 1 tiles of ``GemmFit.tile_rows``, where whole tiles step up), the smallest
    relative change between any adjacent counts (negative: a token more made it cheaper))."""
    tokens = np.arange(1, max_tokens + 1)
    ops = predict_ops(fit, gpu, model, tp, tokens)
    t_ms = layer_ms(ops, tuple(ops))
    step = np.diff(t_ms) / t_ms[:-1]
    t = fit.gemm.tile_rows
    within = (tokens[:-1] % t != 0) | (tokens[:-1] < t) if t > 1 else np.ones(len(step), bool)
    return float(np.max(np.abs(step[within]))), float(np.min(step))



# ---------------------------------------------------------------------------------------------- commands

# Step time vs tensor parallelism at a large decode batch (the report's figure): model, GPU, batch, context
TP_FIGURE_CASES = (("llama-3-70b", "h100", 256, 1024), ("llama-3-8b", "h100", 256, 1024),
                   ("llama-2-70b", "a100-80gb", 256, 1024))


def step_vs_tp() -> pd.DataFrame:
    """Predicted decode-step ms vs TP at a large batch: today's model (fitted operators + the vllm-v1
    host profile) and the model before the fit (datasheet roofline, a constant 2 ms per step)."""
    from sim.catalog import GPUS, MODELS
    from sim.config import RooflineConfig
    from sim.steptime import decode_step_ms

    before = RooflineConfig(operators="datasheet", engine="none", gpu_overhead_s=0.002, paged_block_cost_tokens=0)
    rows = []
    for model, gpu, batch, ctx in TP_FIGURE_CASES:
        for tp in (1, 2, 4, 8):
            for label, cfg in (("fitted + vllm-v1 host", RooflineConfig()),
                               ("fitted + vllm-0.5 host", RooflineConfig(engine="vllm-0.5")),
                               ("before: datasheet + 2 ms", before)):
                ms = decode_step_ms(MODELS[model], GPUS[gpu], tp, batch, ctx, cfg)
                rows.append({"model": model, "gpu": gpu, "batch": batch, "context": ctx, "tp": tp, "model_kind": label,
                             **ms})
    return pd.DataFrame(rows)


def validate_to_dir(root: str | Path, out_dir: str | Path) -> tuple[dict[str, Path], list[str], list[str]]:
    """``sim profiles validate``: leave-one-model-out on every GPU of ``root``; writes ``loo.parquet``
    (every prediction), ``mape.csv`` (per GPU and op), ``allreduce.parquet``, ``step_vs_tp.csv`` and
    ``fits.json`` (each GPU fitted on all its models). Returns the paths, the GPUs left out of the
    validation (one model measured: nothing to fit on when it is left out) and the fits' notes (``fit_notes``)."""
    import json

    ps = read_profiles(root)
    specs = gpu_specs(ps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    commit = profile_commit(root)
    fits = fit_catalog_literals(ps, specs, commit)
    loo = leave_one_model_out(ps, specs)
    paths = {"loo": out / "loo.parquet", "mape": out / "mape.csv", "bias": out / "bias.csv",
             "allreduce": out / "allreduce.parquet", "step_vs_tp": out / "step_vs_tp.csv", "fits": out / "fits.json"}
    loo.to_parquet(paths["loo"])
    mape_table(loo).to_csv(paths["mape"], index=False)
    bias_table(loo).to_csv(paths["bias"], index=False)
    nets = {n.topology: fit_allreduce(n) for n in ps.network}
    allreduce_errors(ps, nets).to_parquet(paths["allreduce"])
    step_vs_tp().to_csv(paths["step_vs_tp"], index=False)
    paths["fits"].write_text(json.dumps({"source": str(root), "commit": commit,
                                         "gpus": {k: fit_to_dict(v) for k, v in fits.items()},
                                         "allreduce": {t: {str(w): asdict(a) for w, a in f.items()}
                                                       for t, f in nets.items()}}, indent=1))
    return paths, loo.attrs["single_model_gpus"], fit_notes(ps, fits)
