"""Simulator speed: simulated requests per wall-clock second, per preset.

    python benchmarks/bench_sim.py [--requests 20000] [--rate 1.5] [--exact]

The quickstart setup (OPT-13B, A100-40GB, ShareGPT-like lengths, Poisson arrivals) with more requests.
Prints one line per preset and the total; single-threaded (pin with `taskset -c 0` for one core).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim.config import load_scenario  # noqa: E402
from sim.run import run  # noqa: E402
from sim.workload import load_requests  # noqa: E402

PRESETS = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson arrival rate, requests/s")
    ap.add_argument("--exact", action="store_true", help="step every iteration (the reference mode)")
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    a = ap.parse_args()

    base = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml")
    w = base.workload.model_copy(update={"num_requests": a.requests,
                                         "arrival": base.workload.arrival.model_copy(update={"rate": a.rate})})
    scen = base.model_copy(update={"workload": w, "exact": a.exact, "record_steps": True})
    requests = load_requests(scen)
    print(f"{len(requests):,} requests, OPT-13B on A100-40GB, ShareGPT-like, Poisson {a.rate}/s, "
          f"{'exact' if a.exact else 'span'} mode")
    total = 0.0
    for name in a.presets:
        s = scen.model_copy(update={"policies": [p for p in scen.policies if p.name == name]})
        t0 = time.perf_counter()
        r = run(s, requests=requests)
        dt = time.perf_counter() - t0
        total += dt
        m = r.policies[name].summary
        print(f"  {name:<18} {dt:7.2f} s  {len(requests) / dt:9,.0f} req/s  ({m['num_steps']:,} steps, "
              f"{len(r.policies[name].steps):,} records, {m['num_finished']:,} finished)")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  {'all presets':<18} {total:7.2f} s  {len(requests) * len(a.presets) / total:9,.0f} req/s; "
          f"peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
