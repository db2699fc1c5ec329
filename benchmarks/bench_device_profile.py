"""The default step-time model (the roofline, fitted to Vidur's profiles) against steps measured on a GPU.

    python benchmarks/bench_device_profile.py [PROFILE.json] [--model llama-3-8b] [--gpu h200] [--engine none]

PROFILE is a calibration profile written on a device (``sim calibrate``, or the device check's
``profile.json``; default ``reports/device_profile_h200.json``, measured on an H200). Every measured
step in it (decode, prefill and mixed, paged and contiguous) is priced by ``RooflineStepTime`` for the
profiled shape (the catalog model with the profile's layer count; its shape must match) on the catalog
GPU (default: the one the profile's ``provenance.device`` names), with the engine's host costs
(default ``none``: the profile measures the GPU's time, CUDA events around the step). Prints, per
layout and kind of step, the mean signed error and the mean absolute error of the prediction, then
every decode point: how far the uncalibrated model can be trusted on that GPU with that backend.

The device check's decode steps are CUDA graphs (GPU-bound); its prefill and mixed steps run eagerly,
about 700 launches for 8 layers, so a short prefill measures the host's launch time (about 10 ms), not
the GPU: compare those only where they are long.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sim.catalog import CatalogError, resolve_gpu, resolve_model  # noqa: E402
from sim.config import RooflineConfig, ScenarioError  # noqa: E402
from sim.core import StepPlan  # noqa: E402
from sim.steptime import PROFILE_MODEL_KEYS, RooflineStepTime, load_profile, measured_gpu  # noqa: E402

DEFAULT = ROOT / "reports" / "device_profile_h200.json"


def profiled_model(name: str, prof: dict):
    """The catalog model cut to the profile's layers; an error when the rest of the shape differs."""
    spec = resolve_model(name)
    spec = dataclasses.replace(spec, num_layers=prof["model"]["num_layers"])
    diff = {k: (getattr(spec, k), prof["model"][k]) for k in PROFILE_MODEL_KEYS if getattr(spec, k) != prof["model"][k]}
    if diff:
        raise SystemExit(f"error: {name} is not the profiled shape: " +
                         ", ".join(f"{k} {a} here, {b} in the profile" for k, (a, b) in diff.items()))
    return spec


def compare(prof: dict, model, gpu, engine: str) -> list[dict]:
    """One row per measured point: its counts, the measured and the predicted seconds."""
    rows = []
    for layout in ("paged", "contiguous"):
        st = RooflineStepTime(model, gpu, 1, RooflineConfig(kind="roofline", engine=engine), paged=layout == "paged")
        for p in prof["points"]:
            if p["layout"] != layout:
                continue
            n, pre, dec = p["num_seqs"], p["num_prefill_tokens"], p["num_decode_tokens"]
            plan = StepPlan(num_seqs=n, num_tokens=pre + dec, num_prefill_tokens=pre, num_decode_tokens=dec,
                            num_sampled=n, decode_context_tokens=p["decode_context_tokens"],
                            prefill_attention_pairs=p["prefill_attention_pairs"], block_size=prof["block_size"],
                            paged=layout == "paged")
            rows.append({"layout": layout, "kind": p["kind"], "num_seqs": n, "prefill_tokens": pre,
                         "decode_keys": p["decode_context_tokens"], "measured_s": p["measured_s"],
                         "predicted_s": st.step_time_s(plan)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", default=str(DEFAULT))
    ap.add_argument("--model", default="llama-3-8b", help="the catalog model the profile measured (its layers cut)")
    ap.add_argument("--gpu", default=None, help="catalog GPU (default: the profile's provenance.device)")
    ap.add_argument("--engine", default="none", choices=("none", "vllm-0.5", "vllm-0.6", "vllm-v1"))
    a = ap.parse_args(argv)
    try:
        prof = load_profile(a.profile)
    except ScenarioError as e:
        raise SystemExit(f"error: {e}") from None
    if not prof.get("points"):
        raise SystemExit(f"error: {a.profile}: no measured steps (points): not a profile written by sim calibrate")
    device = prof.get("provenance", {}).get("device", "")
    gpu_name = a.gpu or measured_gpu(device)
    if gpu_name is None:
        raise SystemExit(f"error: {a.profile} was measured on {device!r}, no catalog GPU: give --gpu")
    try:
        model, gpu = profiled_model(a.model, prof), resolve_gpu(gpu_name)
    except CatalogError as e:
        raise SystemExit(f"error: {e}") from None
    rows = compare(prof, model, gpu, a.engine)
    print(f"{a.profile}: {len(rows)} steps measured on {device} ({prof['provenance'].get('date', '?')}); "
          f"roofline for {model.name} x {model.num_layers} layers on {gpu.name}, engine {a.engine}")
    print(f"{'layout':<11} {'kind':<8} {'steps':>5} {'mean signed':>12} {'mean abs':>9}")
    for layout in ("paged", "contiguous"):
        for kind in ("decode", "prefill", "mixed"):
            sel = [r for r in rows if r["layout"] == layout and r["kind"] == kind]
            if not sel:
                continue
            e = np.array([r["predicted_s"] / r["measured_s"] - 1 for r in sel])
            print(f"{layout:<11} {kind:<8} {len(sel):>5} {e.mean():>+11.1%} {np.abs(e).mean():>9.1%}")
    print("\ndecode steps (paged): sequences, keys read, measured and predicted ms")
    for r in rows:
        if r["layout"] == "paged" and r["kind"] == "decode":
            print(f"  {r['num_seqs']:>4} {r['decode_keys']:>7,} {r['measured_s'] * 1e3:>7.2f} {r['predicted_s'] * 1e3:>7.2f}"
                  f" {r['predicted_s'] / r['measured_s'] - 1:>+7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
