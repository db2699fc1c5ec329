"""Today's KV layouts: the capacity table, and the simulator's speed on a hybrid model.

    python benchmarks/bench_layouts.py capacity            # KV capacity per GPU, each new model (no simulation)
    python benchmarks/bench_layouts.py speed [--requests 2000] [--repeats 3] [--calls]

capacity: for each model of issue 16 on the GPUs it is served on, the KV pool per GPU (0.9 of memory, 0.5 GiB
runtime overhead, the activation estimate, block size 16) with the hybrid allocator off and on, at the model's
dtype and at fp8: pages, and the tokens it holds filled with 32k-token sequences (``layouts.capacity_tokens``;
per GPU: with tensor parallelism every rank holds its share of the same tokens).

speed: wall seconds per simulated request for Gemma-3-27B on one H100 with the hybrid allocator (7 KV groups, window
freeing) and without it (one group: the classic managers), paged and contiguous, on the same ShareGPT-like Poisson
requests; the median of ``--repeats`` runs each, the rows taking turns. The issue's bar: the hybrid model at most
1.5x slower per request. ``--calls`` also counts each row's Python function calls in one run (cProfile): a
measure of the work that the machine's load does not move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.catalog import GIB, GPUS, MODELS  # noqa: E402
from sim.config import parse_scenario  # noqa: E402
from sim.kv import kv_pool  # noqa: E402
from sim.layouts import capacity_tokens, kv_layout  # noqa: E402
from sim.run import run  # noqa: E402
from sim.workload import load_requests  # noqa: E402

# (model, gpu, tensor_parallel): each on the fewest GPUs of its usual kind that hold its weights
DEPLOYMENTS = [("gemma-3-27b", "h100", 1), ("gpt-oss-120b", "h100", 1), ("llama-4-scout", "h100", 4),
               ("deepseek-v3", "h200", 8), ("jamba-v0.1", "h100", 2)]
CONTEXT = 32768


def capacity_rows() -> list[dict]:
    rows = []
    for name, gpu, tp in DEPLOYMENTS:
        m, g = MODELS[name], GPUS[gpu]
        for fp8 in (False, True):
            for hybrid in (False, True):
                if hybrid is False and "mamba" in m.kinds:
                    continue  # Mamba layers need the hybrid allocator
                lay = kv_layout(m, tp, 16, 1 if fp8 else None, hybrid)
                pool = kv_pool(m, g, tp=tp, gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
                               slot_bytes=lay.slot_bytes)
                rows.append({"model": name, "gpus": f"{tp}x {gpu}", "kv": "fp8" if fp8 else "bf16",
                             "hybrid": hybrid, "groups": len(lay.groups), "kv_gib": pool.kv_bytes / GIB,
                             "pages": pool.num_blocks, "tokens": capacity_tokens(lay, pool.num_blocks, CONTEXT)})
    return rows


def print_capacity() -> None:
    print(f"| model | GPUs | KV dtype | hybrid allocator | groups | KV GiB/GPU | pages of 16 | tokens at {CONTEXT // 1024}k context |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in capacity_rows():
        print(f"| {r['model']} | {r['gpus']} | {r['kv']} | {'on' if r['hybrid'] else 'off'} | {r['groups']} | "
              f"{r['kv_gib']:.1f} | {r['pages']:,} | {r['tokens']:,} |")


SPEED_ROWS = [("paged, full attention (hybrid off)", {"preset": "vllm", "hybrid_allocator": False}),
              ("paged, hybrid (7 groups)", {"preset": "vllm", "hybrid_allocator": True}),
              ("contiguous, full attention (hybrid off)", {"preset": "orca-oracle", "hybrid_allocator": False}),
              ("contiguous, hybrid (7 groups)", {"preset": "orca-oracle", "hybrid_allocator": True})]


def speed(requests: int, repeats: int, calls: bool = False) -> None:
    base = {"name": "bench-layouts", "model": "gemma-3-27b", "gpu": "h100", "decompose": False,
            "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "sharegpt",
                         "num_requests": requests, "seed": 0}}
    print(f"{requests:,} ShareGPT-like requests, Poisson 2/s, Gemma-3-27B on 1x H100, median of {repeats} "
          "(the rows run in turn, repeat after repeat, so that a change in the machine's load hits all alike)")
    setups = []
    for label, pol in SPEED_ROWS:
        s = parse_scenario({**base, "policies": [{**pol, "name": "p"}]})
        setups.append((label, s, load_requests(s)))
    times: dict[str, list[float]] = {label: [] for label, _, _ in setups}
    last = {}
    for _ in range(repeats):
        for label, s, reqs in setups:
            t0 = time.perf_counter()
            last[label] = run(s, requests=reqs)
            times[label].append(time.perf_counter() - t0)
    per = {}
    for label, _, _ in setups:
        dt = statistics.median(times[label])
        per[label] = dt / requests
        m = last[label].policies["p"].summary
        print(f"  {label:<40} {dt:7.2f} s  {dt / requests * 1e3:7.3f} ms/request  ({m['num_steps']:,} steps, "
              f"{m['num_finished']:,} finished, {m['request_throughput']:.2f} req/s simulated)")
    for kind in ("paged", "contiguous"):
        a, b = (per[label] for label, _ in SPEED_ROWS if label.startswith(kind))
        print(f"  {kind}: hybrid / full {b / a:.2f}x per request")
    if calls:
        import cProfile
        import pstats

        n = {}
        for label, s, reqs in setups:
            prof = cProfile.Profile()
            prof.runcall(run, s, requests=reqs)
            n[label] = pstats.Stats(prof).total_calls
            print(f"  {label:<40} {n[label]:>11,} Python function calls")
        for kind in ("paged", "contiguous"):
            a, b = (n[label] for label, _ in SPEED_ROWS if label.startswith(kind))
            print(f"  {kind}: hybrid / full {b / a:.2f}x function calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["capacity", "speed"])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="also count each row's Python function calls (cProfile)")
    a = ap.parse_args()
    if a.what == "capacity":
        print_capacity()
    else:
        speed(a.requests, a.repeats, a.calls)


if __name__ == "__main__":
    main()
