"""Which GEMM form fits Vidur's profiles: the catalog's (whole tiles of rows past the first) against the smooth
p-norm it replaced and two other tile-quantised forms.

    python benchmarks/bench_gemm_forms.py [ROOT]       # ROOT: Vidur's layout (default ../shared/profiles/vidur)

Measured GEMMs step up just past multiples of 64 or 128 tokens (cuBLAS computes whole tiles of rows). Every
form has the coefficients of ``GemmFit`` (launch + (t_c^p + t_m^p)^(1/p)), and all but the smooth one a row
tile T:

- ``smooth``: t_c of M itself (the catalog's form until 2026-12-05: +26 % at 256 tokens on H100);
- ``above T``: t_c of M rounded up to a multiple of T once M exceeds T, of M itself up to T (a kernel for a
  short batch uses short tiles): ``GemmFit.tile_rows``, the catalog's form;
- ``rows T``: t_c of M rounded up to a multiple of T, a short batch too;
- ``floor T``: the smooth curve, but never below the compute of whole tiles: max(p-norm, t_c(M rounded up)).

Leave-one-model-out as ``sim profiles validate`` does it: per GPU, fit on the other models, predict the
left-out one's layer (its four GEMMs by the form, its elementwise ops by the catalog's fit), every TP degree
and token count. Each fold picks its own T (the lowest in-sample error on its training models; the
catalog's fit, ``sim.profiles.pick_tile``, also tries T = 1 and refuses unphysical fits, which picks the
same tiles here). Prints, per GPU and form, the layer MAPE and its worst token count's (as ``validate``
prints them), the signed error per token band, and at 128, 256 and 512 tokens (full decode batches) the
signed error and the worst model and TP degree's; then each form's coefficients fitted on every model,
since a fit that needs a bandwidth efficiency above 1 fits the data, not the GPU.
Needs scipy (as the fit does); about 15 s.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.catalog import GemmFit  # noqa: E402
from sim.profiles import (GEMM_COEFS, GEMM_OPS, _gemm_rows, _least_squares, fit_elementwise,  # noqa: E402
                          gpu_specs, layer_ms, measured_ops, profile_model, read_profiles)

TILES = (16, 32, 64, 128, 256)


class Tiled(GemmFit):
    """A ``GemmFit`` whose compute is priced on whole tiles of ``tile`` rows, as ``form`` says."""

    def __init__(self, form: str, tile: int, **coefs) -> None:
        super().__init__(**coefs, tile_rows=tile if form == "above" else 1)
        object.__setattr__(self, "form", form)
        object.__setattr__(self, "tile", tile)

    def time_s(self, m, n, k, gpu, dtype_bytes=2, weight_bytes=None):
        if self.form in ("smooth", "above"):  # GemmFit itself (tile_rows 1 or T)
            return super().time_s(m, n, k, gpu, dtype_bytes)
        rows = np.ceil(m / self.tile) * self.tile
        whole = 2.0 * rows * n * k / (self.compute_efficiency * gpu.flops_per_s)
        if self.form == "rows":
            tc = whole * (1.0 + self.tile_tokens / m)
            tm = dtype_bytes * (m * k + k * n + m * n) / (self.bandwidth_efficiency * gpu.hbm_bytes_per_s)
            return self.launch_s + (tc**self.sharpness + tm**self.sharpness) ** (1.0 / self.sharpness)
        return np.maximum(super().time_s(m, n, k, gpu, dtype_bytes), self.launch_s + whole)  # floor


def fit(profiles, gpu, form: str, tile: int) -> tuple[Tiled, float]:
    """The form's coefficients fitted in log time as ``sim.profiles.fit_gemm`` does; (fit, mean squared residual)."""
    M, N, K, y = _gemm_rows(profiles)
    ok = y > 0

    def resid(f):
        return np.log(f.time_s(M[ok], N[ok], K[ok], gpu) / y[ok])

    f = _least_squares(resid, partial(Tiled, form, tile), GEMM_COEFS)
    return f, float(np.mean(resid(f) ** 2))


def best(profiles, gpu, form: str) -> Tiled:
    if form == "smooth":
        return fit(profiles, gpu, form, 1)[0]
    return min((fit(profiles, gpu, form, t) for t in TILES), key=lambda x: x[1])[0]


def loo(ps, specs) -> pd.DataFrame:
    rows = []
    for g in ps.gpus():
        gpu, profs = specs[g], ps.for_gpu(g)
        for left in profs:
            train = [p for p in profs if p is not left]
            ew = fit_elementwise(train, gpu)
            fits = {form: best(train, gpu, form) for form in ("smooth", "rows", "above", "floor")}
            model = profile_model(left.table, left.model)
            for tp in sorted(left.table.num_tensor_parallel_workers.unique()):
                tokens, meas = measured_ops(left, int(tp))
                m = tokens.astype(np.float64)
                shapes, eb = model.layer_gemms(int(tp)), model.layer_elementwise_bytes(int(tp))
                for form, f in fits.items():
                    pred = {op: f.time_s(m, *shapes[op], gpu) * 1e3 for op in GEMM_OPS}
                    for op in meas:
                        if op not in pred:
                            e = ew[op]
                            pred[op] = (e.launch_s + m * eb[op] / (e.bandwidth_efficiency * gpu.hbm_bytes_per_s)) * 1e3
                    err = layer_ms(pred, tuple(meas)) / layer_ms(meas, tuple(meas)) - 1.0
                    rows.append(pd.DataFrame({"gpu": g, "model": left.model, "tp": int(tp), "tokens": tokens,
                                              "form": form if form == "smooth" else f"{form} {f.tile}", "err": err}))
    return pd.concat(rows, ignore_index=True)


def summary(d: pd.DataFrame) -> pd.Series:
    out = {"MAPE": d.err.abs().mean(), "worst tokens": d.err.abs().groupby(d.tokens).mean().max()}
    for lo, hi in ((1, 16), (17, 128), (129, 256), (257, 512), (513, None)):
        band = d[(d.tokens >= lo) & ((d.tokens <= hi) if hi else True)]
        out[f"{lo}-{hi}" if hi else f"{lo}+"] = band.err.mean()
    for t in (128, 256, 512):
        at = d[d.tokens == t]
        by = at.groupby(["model", "tp"]).err.mean()
        out[f"={t}"], out[f"worst {t}"] = at.err.mean(), by.loc[by.abs().idxmax()]
    return pd.Series(out) * 100


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "shared" / "profiles" / "vidur"
    if not root.is_dir():
        sys.exit(f"no profiles at {root} (give Vidur's profile folder as the argument)")
    ps = read_profiles(root)
    specs = gpu_specs(ps)
    d = loo(ps, specs)
    d["form"] = d.form.str.replace(r" \d+$", " *", regex=True)  # (each fold's own tile)
    pd.set_option("display.width", 200)
    print("Leave-one-model-out, one layer (GEMMs + elementwise ops), signed error % (predicted / measured - 1)")
    print(d.groupby(["gpu", "form"]).apply(summary, include_groups=False).round(1).to_string())
    print("\nFitted on every model of the GPU (tile: the form's best):")
    for g in ps.gpus():
        for form in ("smooth", "rows", "above", "floor"):
            f = best(ps.for_gpu(g), specs[g], form)
            print(f"  {g:5} {form:6} tile {f.tile if form != 'smooth' else '-':>3}  launch {f.launch_s * 1e6:5.1f} us  "
                  f"compute eff {f.compute_efficiency:.3f}  bandwidth eff {f.bandwidth_efficiency:.3f}  "
                  f"p {f.sharpness:5.2f}  tile_tokens {f.tile_tokens:6.1f}")


if __name__ == "__main__":
    main()
