"""Where a decode step's GPU time goes, by kernel: the device check's 8-layer Llama-3-8B shape, paged, at a few
(batch, mean context) points, each step timed as the replay times it (a CUDA graph, events) and its kernels
timed by the profiler (CUPTI) on the same step run eagerly.

    python gpu/decode_breakdown.py --out breakdown.json [--device cuda[:N]] [--points 1x2048,16x2048,64x512,256x188]

Kernels are grouped by name: ``gemm`` (cuBLAS), ``attention`` (our Triton decode kernels), ``store_kv``,
``elementwise`` (PyTorch's pointwise kernels: norms, rotary, activation, residual adds, casts), ``reduction``
(argmax and norms' reductions), ``copy`` (memcpy, memset), ``other``. The figures say which part of a step
the roofline's prediction misses; they describe this project's backend, not a serving engine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GROUPS = (("attention", ("decode_attention", "decode_reduce")), ("store_kv", ("store_kv",)),
          ("gemm", ("gemm", "gemv", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "ampere")),
          ("reduction", ("argmax", "reduce")), ("copy", ("memcpy", "memset")),
          ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")))


def group_of(name: str) -> str:
    n = name.lower()
    return next((g for g, keys in GROUPS if any(k in n for k in keys)), "other")


def kernel_times_us(prof) -> dict[str, float]:
    """Total device microseconds per kernel name in a profile (torch's names for the field differ by version)."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t:
            out[e.key] += float(t)
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--points", default="1x2048,16x2048,64x512,256x188", help="batch x mean context, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    try:
        points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
    except ValueError:
        points = []
    if not points or any(len(p) != 2 or min(p) < 1 for p in points) or a.repeats < 1 or a.layers < 1:
        ap.error(f"--points {a.points!r}: expected BATCHxCONTEXT pairs of positive integers, comma-separated "
                 "(and --repeats, --layers at least 1)")
    from torch.profiler import ProfilerActivity, profile

    from gpu.calibrate import StepBench, spread
    from gpu.device import default_attention, default_dtype, provenance, resolve_device
    from gpu.kv_cache import KvCache
    from gpu.model import LlamaModel, ModelShape
    from sim.catalog import MODELS
    from sim.kv import KvPool

    try:
        dev = resolve_device(a.device)
    except ValueError as e:  # ScenarioError is a ValueError too: a user's --device, said plainly
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dev.type != "cuda":
        print(f"error: --device {a.device}: the breakdown reads CUDA kernel times (CUPTI): it needs a GPU",
              file=sys.stderr)
        return 2
    dtype, attention = default_dtype(dev), default_attention(dev)
    spec = MODELS["llama-3-8b"]
    shape = ModelShape.from_spec(spec, a.layers)
    llama = LlamaModel.random(shape, dev, dtype, 0)
    bs = 16
    blocks = max(b * (-(-(2 * c + 2) // bs) + 1) for b, c in points)
    cache = KvCache(shape, KvPool(blocks, bs, spec.kv_bytes_per_token(1), 0, 0, 0), dev, dtype)
    graphs = StepBench(llama, cache, True, attention, 0)
    eager = StepBench(llama, cache, True, attention, 0)
    eager.ex.graphs = None  # the same steps launched one kernel at a time, for the profiler
    for bench in (graphs, eager):
        bench.ex.warmup()
    rows = []
    for batch, ctx in points:
        cached = spread(batch, ctx, shape.max_model_len - 1)
        news = [1] * batch
        graphs.step_s(news, cached)  # captures this bucket's graph
        step = statistics.median(graphs.step_s(news, cached) for _ in range(a.repeats))
        eager.step_s(news, cached)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.repeats):
                eager.step_s(news, cached)
        kernels = {k: v / a.repeats for k, v in kernel_times_us(prof).items()}
        by_group: dict[str, float] = defaultdict(float)
        for k, v in kernels.items():
            by_group[group_of(k)] += v
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
        rows.append({"batch": batch, "mean_context": ctx, "keys": sum(c + 1 for c in cached),
                     "graph_step_us": step * 1e6, "kernel_us_by_group": dict(by_group),
                     "kernel_us_total": sum(kernels.values()), "top_kernels_us": top})
        print(f"{batch:>4} x {ctx:>5}: graph step {step * 1e6:8.1f} us; kernels "
              + ", ".join(f"{g} {v:.1f}" for g, v in sorted(by_group.items(), key=lambda kv: -kv[1])), flush=True)
    Path(a.out).write_text(json.dumps({"provenance": provenance(dev), "model": f"{spec.name} x {a.layers} layers",
                                       "dtype": str(dtype), "attention": attention, "block_size": bs,
                                       "repeats": a.repeats, "points": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
