"""Simulator speed at scale: requests per wall-clock second and peak memory, per preset.

    python benchmarks/bench_speed.py                 # Azure conv trace + 1e4, 1e5, 1e6 generated requests
    python benchmarks/bench_speed.py --sizes 10000 100000 --presets vllm

Setup (issue 8): Llama-2-7B on one A100-80GB. (a) The Azure LLM inference 2023 conv trace at its own
rate, read from $KVSIM_TRACES or ../shared/traces/ when present. (b) Generated workloads with Azure-conv-like sizes
(log-normal prompts: mean 1155, cv 0.6, at most 3072 tokens; outputs: mean 211, cv 1.3, at most 1000)
and Poisson arrivals at 5.5 requests/s, about the trace's own rate, which keeps every preset busy.
Each (workload, preset) runs in a fresh process, pinned to one core when `taskset` exists, so its
peak RSS is its own. Prints seconds, simulated requests per second, peak RSS, and the ratio of
times between consecutive sizes (linear cost means ~10x per 10x requests); for the trace, the number of
simulation events (steps, spans of steps, idle gaps) and the cost per event (CPU time of the whole
``run`` -- loop, results and summary -- over events; issue 18's target is 14 us on the reference core).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sim.trace_paths import locate  # noqa: E402  (searched in $KVSIM_TRACES, then ../shared/traces)

AZURE = locate("azure_2023/AzureLLMInferenceTrace_conv.csv")
PRESETS = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm", "vllm-v1"]


def scenario(workload: dict, preset: str, exact: bool) -> dict:
    return {"name": "bench", "model": "llama-2-7b", "gpu": "a100-80gb", "workload": workload,
            "policies": [preset], "record_steps": False, "exact": exact}


def generated(n: int) -> dict:
    return {"arrival": {"kind": "poisson", "rate": 5.5}, "num_requests": n, "seed": 0,
            "prompt": {"kind": "lognormal", "mean": 1155, "cv": 0.6, "max": 3072},
            "output": {"kind": "lognormal", "mean": 211, "cv": 1.3, "max": 1000}}


def child(spec: dict) -> None:
    """Run one simulation in this process and print its figures as JSON."""
    sys.path.insert(0, str(ROOT))
    from sim.config import parse_scenario
    from sim.run import run
    from kvsim import load_requests  # the trace readers wired in (a trace workload)

    s = parse_scenario(spec["scenario"])
    requests = load_requests(s)
    t0, c0 = time.perf_counter(), time.process_time()
    r = run(s, requests=requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    p = next(iter(r.policies.values()))
    m = p.summary
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": len(requests), "finished": m["num_finished"],
                      "steps": m["num_steps"], "events": p.num_events,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="*", type=int, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    ap.add_argument("--exact", action="store_true", help="step every iteration (the reference mode)")
    ap.add_argument("--no-trace", action="store_true", help="skip the Azure conv trace")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    print(f"Llama-2-7B on A100-80GB, {'exact' if a.exact else 'span'} mode, one process per run "
          f"({os.cpu_count()} cores here)")
    if not a.no_trace:
        if AZURE.exists():
            print(f"\n(a) Azure conv trace ({AZURE.name}) at its own rate")
            for p in a.presets:
                r = measure({"scenario": scenario({"kind": "trace", "path": str(AZURE)}, p, a.exact)})
                print(f"  {p:<18} {r['wall_s']:7.2f} s (cpu {r['cpu_s']:5.2f} s) {r['requests'] / r['wall_s']:9,.0f} req/s  "
                      f"peak RSS {r['peak_rss_mib']:6.0f} MiB  ({r['finished']:,} finished, {r['steps']:,} steps, "
                      f"{r['events']:,} events, {r['cpu_s'] / r['events'] * 1e6:5.1f} us/event)")
        else:
            print(f"\n(a) skipped: {AZURE} not found (real traces live outside the project: "
                  "sim trace fetch azure-2023-conv)")
    print("\n(b) generated, Azure-conv-like sizes, Poisson 5.5 req/s")
    for p in a.presets:
        prev, last_n = None, 1
        for n in a.sizes:
            r = measure({"scenario": scenario(generated(n), p, a.exact)})
            ratio = f"  x{r['wall_s'] / prev:5.2f} time for x{n // last_n}" if prev else ""
            print(f"  {p:<18} {n:>9,} req {r['wall_s']:8.2f} s (cpu {r['cpu_s']:7.2f} s) {n / r['wall_s']:9,.0f} req/s  "
                  f"peak RSS {r['peak_rss_mib']:6.0f} MiB{ratio}")
            prev, last_n = r["wall_s"], n


if __name__ == "__main__":
    main()
