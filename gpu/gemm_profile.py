"""Measure the four GEMMs of one transformer layer on a GPU, in Vidur's profile layout, so that
``sim profiles fit`` and ``sim profiles validate`` fit and check a GPU that Vidur never profiled (the H200).

    python gpu/gemm_profile.py --out DIR [--models NAME ...] [--tokens 1,2,4,...] [--repeats 15]
    python gpu/gemm_profile.py --combine RUN1 RUN2 RUN3 --out DIR      # here: one profile of several runs

Writes ``DIR/compute/<gpu>/<org>/<model>/mlp.csv`` (one row per token count and tensor-parallel degree:
``time_stats.<op>.{min,max,mean,median,std}`` in ms for ``attn_pre_proj``, ``attn_post_proj``,
``mlp_up_proj``, ``mlp_down_proj``, and the shape columns Vidur's files have) and ``DIR/provenance.json``.
``--combine`` merges runs of this script (on any machine): each op's median is the median of the runs'
medians (a run's transient slowdown, such as one seen on an H200 where a handful of small GEMMs read 2-5x
slow in one of three runs, does not reach the fit), min and max the extremes, mean the mean of the runs'
means, std the spread of the runs' medians. The elementwise ops are not measured: our PyTorch versions of
them are not the fused kernels a serving engine runs, so the catalog keeps the sibling GPU's fits for those.

Each GEMM is ``torch.nn.functional.linear`` of bf16 random inputs (tokens x K) and a random weight (N x K):
cuBLAS, as an unquantized serving engine runs a linear layer, with (N, K) the model's per-rank shape
(``ModelSpec.layer_gemms``: QKV and gate/up split by columns, output and down projections by rows, KV heads
replicated below one per rank). Timing: ``repeats`` runs, each after a read of 256 MiB that evicts the L2
(a serving step streams every layer's weights, so a layer's GEMM never finds its weight cached), all
enqueued before the first synchronisation so that no launch gap is inside the events; the median is the
figure. The eviction reads: the first H200 runs (reports/h200_gemm) evicted by writing, and their
memory-bound GEMMs came out 17-25 % slower than the same GEMMs inside a real decode step
(gpu/decode_breakdown.py), likely from writing back the dirty lines while the GEMM streamed its weights.
The shapes are the four models of Vidur's H100 profiles plus Llama-3-8B, so the H100 and the measured GPU
can be compared model by model.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sim.catalog import ModelSpec  # noqa: E402

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# org/model (Vidur's folder names) -> (heads, KV heads, hidden, FFN, vocab, gated MLP, tensor-parallel degrees)
MODELS = {
    "meta-llama/Llama-2-70b-hf": (64, 8, 8192, 28672, 32768, True, (1, 2, 4, 8)),
    "codellama/CodeLlama-34b-Instruct-hf": (64, 8, 8192, 22016, 32768, True, (1, 2, 4, 8)),
    "Qwen/Qwen-72B": (64, 64, 8192, 24576, 152064, True, (1, 2, 4, 8)),
    "microsoft/phi-2": (32, 32, 2560, 10240, 51200, False, (1,)),
    "meta-llama/Meta-Llama-3-8B": (32, 8, 4096, 14336, 128256, True, (1, 2, 4, 8)),
}
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512, 576, 640,
          768, 896, 1024, 1280, 1536, 2048, 2560, 3072, 3584, 4096)
STATS = ("min", "max", "mean", "median", "std")
FLUSH_BYTES = 256 << 20


def gpu_folder(name: str) -> str:
    """The profile folder of a device name: the catalog GPU it names (``NVIDIA H200`` -> ``h200``), else the name
    in lower case with dashes."""
    from sim.steptime import measured_gpu

    return measured_gpu(name) or "-".join(name.lower().replace("nvidia", "").split())


def time_ms(torch, fn, flush, repeats: int) -> list[float]:
    """Per-run milliseconds of ``fn``, each after evicting the L2 (by reading ``flush``), all enqueued before one
    synchronisation."""
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        flush.sum()  # a read: the L2 holds clean lines of this buffer, none of the weight
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def measure_model(torch, device, spec: ModelSpec, tps, tokens, repeats: int, flush) -> list[dict]:
    rows = []
    for tp in tps:
        shapes = spec.layer_gemms(tp)
        weights = {op: torch.randn(shapes[op], device=device, dtype=torch.bfloat16) for op in GEMM_OPS}
        for m in tokens:
            row = {}
            for op in GEMM_OPS:
                n, k = shapes[op]
                x = torch.randn((m, k), device=device, dtype=torch.bfloat16)
                w = weights[op]
                ts = time_ms(torch, lambda: torch.nn.functional.linear(x, w), flush, repeats)
                row.update({f"time_stats.{op}.min": min(ts), f"time_stats.{op}.max": max(ts),
                            f"time_stats.{op}.mean": statistics.fmean(ts),
                            f"time_stats.{op}.median": statistics.median(ts),
                            f"time_stats.{op}.std": statistics.pstdev(ts)})
            row.update(n_head=spec.num_heads, n_kv_head=spec.num_kv_heads, n_embd=spec.hidden_size,
                       n_expanded_embd=spec.ffn_size, vocab_size=spec.vocab_size, use_gated_mlp=spec.gated_mlp,
                       num_tokens=m, num_tensor_parallel_workers=tp)
            rows.append(row)
        del weights
    return rows


COLUMNS = [f"time_stats.{op}.{s}" for op in GEMM_OPS for s in STATS] + [
    "n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
    "num_tensor_parallel_workers"]  # what a run of this script writes, in order


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in r.items()} for r in rows)


class CombineError(Exception):
    """A run folder ``--combine`` cannot merge: what and where (one line, exit 2)."""


def combine(runs: list[Path], out: Path) -> list[Path]:
    """One profile folder of several runs' (the same models, token counts and degrees in each). Everything is
    read and checked before anything is written (a damaged run left a half-written folder)."""
    for run in runs:
        if not Path(run).is_dir():
            raise CombineError(f"--combine {run}: not a folder (a run's --out)")
    if out.exists() and not out.is_dir():
        raise CombineError(f"--out {out}: is a file; expected the folder to write")
    first = sorted(Path(runs[0]).glob("compute/*/*/*/mlp.csv"))
    if not first:
        raise CombineError(f"{runs[0]}: no compute/<gpu>/<org>/<model>/mlp.csv")
    merged: dict[Path, list[dict]] = {}
    for path in first:
        rel = path.relative_to(runs[0])
        tables = []
        for run in runs:
            try:
                with open(Path(run) / rel, newline="") as f:
                    reader = csv.DictReader(f)
                    if list(reader.fieldnames or []) != COLUMNS:  # (extra columns: a DictWriter ValueError)
                        extra = sorted(set(reader.fieldnames or []) - set(COLUMNS))[:3]
                        missing = sorted(set(COLUMNS) - set(reader.fieldnames or []))[:3]
                        raise CombineError(f"{Path(run) / rel}: not a run of this script (its columns differ: "
                                           f"extra {extra or 'none'}, missing {missing or 'none'}; a Vidur "
                                           "profile folder is read as it is, not combined)")
                    tables.append({(r["num_tokens"], r["num_tensor_parallel_workers"]): r for r in reader})
            except (OSError, KeyError, csv.Error) as e:
                raise CombineError(f"{Path(run) / rel}: not a run of this script ({e.__class__.__name__}: {e})")
        keys = list(tables[0])
        if any(set(t) != set(keys) for t in tables):
            raise CombineError(f"{rel}: the runs measured different token counts or degrees")
        rows = []
        for key in keys:
            row = dict(tables[0][key])
            for op in GEMM_OPS:
                def col(stat: str) -> list[float]:
                    try:
                        values = [float(t[key][f"time_stats.{op}.{stat}"]) for t in tables]
                    except (KeyError, TypeError, ValueError):
                        values = []
                    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
                        raise CombineError(f"{rel}: time_stats.{op}.{stat} missing, negative or not a number at "
                                           f"num_tokens {key[0]}, degree {key[1]} in one of the runs")
                    return values
                medians = col("median")
                row.update({f"time_stats.{op}.min": min(col("min")), f"time_stats.{op}.max": max(col("max")),
                            f"time_stats.{op}.mean": statistics.fmean(col("mean")),
                            f"time_stats.{op}.median": statistics.median(medians),
                            f"time_stats.{op}.std": statistics.pstdev(medians)})
            rows.append(row)
        merged[out / rel] = rows
    provs = []
    for r in runs:
        p = Path(r) / "provenance.json"
        if p.exists():
            try:
                provs.append(json.loads(p.read_text()))
            except (OSError, ValueError) as e:
                raise CombineError(f"{p}: unreadable ({e.__class__.__name__}: {e})") from None
    for path, rows in merged.items():
        write_csv(path, rows)
    (out / "provenance.json").write_text(json.dumps({"combined": [str(r) for r in runs], "runs": provs}, indent=1))
    return list(merged)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the profile folder to write (Vidur's layout)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="org/model names of MODELS")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--combine", nargs="+", default=None, help="run folders to merge into --out (no GPU needed)")
    a = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {a.tokens!r}: expected comma-separated positive integers")
    if not tokens or min(tokens) < 1 or a.repeats < 1:
        ap.error("--tokens must be positive integers and --repeats at least 1")
    if a.combine:
        try:
            written = combine([Path(r) for r in a.combine], Path(a.out))
        except CombineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(written)} profiles of {len(a.combine)} runs under {a.out}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device: GEMM profiles are measured on a GPU", file=sys.stderr)
        return 2
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; expected some of {', '.join(MODELS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    from gpu.check import bundle_source
    from gpu.device import provenance

    prov = {**provenance(device), "source": bundle_source()}
    folder = Path(a.out) / "compute" / gpu_folder(prov["device"])
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    a_ = torch.randn((4096, 4096), device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 2.0:  # clocks up before the first measurement
        a_ @ a_
        torch.cuda.synchronize()
    started = time.perf_counter()
    for name in a.models:
        heads, kv, hidden, ffn, vocab, gated, tps = MODELS[name]
        spec = ModelSpec(name.split("/")[-1], 1, hidden, heads, kv, ffn, vocab, 4096, gated_mlp=gated,
                         tie_embeddings=False)
        t = time.perf_counter()
        rows = measure_model(torch, device, spec, tps, tokens, a.repeats, flush)
        write_csv(folder / name / "mlp.csv", rows)
        print(f"{name}: {len(rows)} rows x {len(GEMM_OPS)} GEMMs in {time.perf_counter() - t:.1f} s", flush=True)
        torch.cuda.empty_cache()
    (Path(a.out) / "provenance.json").write_text(json.dumps(
        {**prov, "method": "torch.nn.functional.linear, bf16 random inputs; L2 evicted (256 MiB read) before each "
                           f"of {a.repeats} runs; CUDA events; median", "wall_s": time.perf_counter() - started},
        indent=1))
    print(f"wrote {folder} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
