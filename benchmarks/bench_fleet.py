"""Fleet speed: a fleet of replicas against the same requests simulated as independent servers.

    python benchmarks/bench_fleet.py                       # 16 replicas, Azure conv at 16x its rate
    python benchmarks/bench_fleet.py --copies 4 --replicas 4

Workload: the Azure LLM inference 2023 conversation trace ($KVSIM_TRACES or ../shared/traces/), at
``--copies`` times its rate over the same hour: that many copies of the trace laid over each other,
copy k shifted by k/copies of the trace's span (wrapping around), so the request count and the rate
both grow by ``--copies`` (16: about 310k requests). Model: Llama-3-8B, each replica one A100-80GB,
``vllm``. Runs (in this process, one after the other; pinned to one core when ``taskset`` exists):

- fleet: ``--replicas`` replicas behind each of ``--routers`` (round-robin and least-outstanding);
- independent: the same requests as ``--replicas`` single servers, server k taking requests k, k+N, ...
  (what round-robin gives each replica), timed together;
- with ``--replay``, after each fleet: the requests as that fleet routed them, as independent servers
  (for a router reading live state, what routing at each arrival on one clock costs over the same work).

The runs alternate, ``--rounds`` times (default 3: fleet, fleet, independent, fleet, ...), so a shared
machine's slow and fast spells fall on all of them; each run's figure is its median over the rounds.
Prints CPU seconds (this process's: a loaded machine's other work does not count), simulated requests
per second, and each fleet's cost over the independent servers'. ``--minutes M``: only the first M
minutes of the tiled trace (a quick check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.config import parse_scenario  # noqa: E402
from sim.run import run  # noqa: E402
from sim.trace_paths import locate  # noqa: E402
from sim.workload import load_requests  # noqa: E402
from traces.workload import load_trace  # noqa: E402


def scenario(cluster: dict | None) -> dict:
    d = {"name": "bench-fleet", "model": "llama-3-8b", "gpu": "a100-80gb", "policies": ["vllm"],
         "record_steps": False, "decompose": False,
         "workload": {"kind": "trace", "path": str(locate("azure_2023/AzureLLMInferenceTrace_conv.csv")),
                      "cap_lengths": "truncate"}}
    if cluster:
        d["cluster"] = cluster
    return d


def tiled(requests, copies: int):
    """``copies`` copies of the trace over its own span, copy k shifted by k/copies of it (wrapping)."""
    t0, span = requests.arrival_s[0], requests.arrival_s[-1] - requests.arrival_s[0]
    arr = np.concatenate([(requests.arrival_s - t0 + k * span / copies) % span for k in range(copies)])
    order = np.argsort(arr, kind="stable")
    rep = lambda a: np.tile(a, copies)[order]  # noqa: E731
    return requests.replace(arrival_s=arr[order], prompt_tokens=rep(requests.prompt_tokens),
                            output_tokens=rep(requests.output_tokens), prefix_hashes=None, session_id=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--routers", nargs="+", default=["round-robin", "least-outstanding"])
    ap.add_argument("--no-independent", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=None, help="only the first M minutes of the tiled trace")
    ap.add_argument("--replay", action="store_true",
                    help="after each fleet, its own routing as independent servers (what routing at arrivals costs)")
    a = ap.parse_args()
    if shutil.which("taskset") and "KVSIM_PINNED" not in os.environ:
        os.environ["KVSIM_PINNED"] = "1"
        os.execvp("taskset", ["taskset", "-c", "0", sys.executable, *sys.argv])
    base = parse_scenario(scenario(None))
    requests = tiled(load_requests(base, load_trace), a.copies)
    if a.minutes is not None:
        requests = requests.take(np.flatnonzero(requests.arrival_s < requests.arrival_s[0] + 60 * a.minutes),
                                 "other_server")
    n = len(requests)

    assigned = {}  # router -> each request's replica

    def fleet(router):
        s = parse_scenario(scenario({"replicas": a.replicas, "router": router}))
        t = time.process_time()
        res = run(s, requests=requests).policies["vllm"]
        cpu = time.process_time() - t
        assigned[router] = res.requests.replica.to_numpy()
        return cpu, {"finished": res.summary["num_finished"], "events": res.num_events,
                     "p99_ttft_ms": res.summary["p99_ttft_ms"], "load_imbalance_kv": res.fleet["load_imbalance_kv"]}

    def independent(parts):
        cpu, finished, events = 0.0, 0, 0
        for part in parts:
            t = time.process_time()
            res = run(base, requests=requests.take(part, "other_server")).policies["vllm"]
            cpu += time.process_time() - t
            finished += res.summary["num_finished"]
            events += res.num_events
        return cpu, {"finished": finished, "events": events}

    runs = {}
    for r in a.routers:
        runs[f"fleet {a.replicas} x {r}"] = lambda r=r: fleet(r)
        if a.replay:
            runs[f"  {r}'s routing, independent"] = lambda r=r: independent(
                [np.flatnonzero(assigned[r] == k) for k in range(a.replicas)])
    if not a.no_independent:
        runs[f"independent {a.replicas} servers"] = lambda: independent(
            [np.arange(k, n, a.replicas) for k in range(a.replicas)])
    times: dict[str, list[float]] = {name: [] for name in runs}
    info = {}
    for _ in range(a.rounds):
        for name, f in runs.items():
            cpu, info[name] = f()
            times[name].append(cpu)
    rows = [{"run": name, "cpu_s": float(np.median(ts)), "cpu_s_rounds": ts, "requests": n, **info[name]}
            for name, ts in times.items()]
    ind = rows[-1]["cpu_s"] if not a.no_independent else None
    from sim import native

    print(native.describe())
    print(f"{n:,} requests (Azure conv x{a.copies}), {a.replicas} replicas, vllm, Llama-3-8B on A100-80GB each; "
          f"CPU s: median of {a.rounds} alternating rounds")
    for j, r in enumerate(rows):
        extra = f"  {r['cpu_s'] / ind - 1:+.1%} vs independent" if ind and r["run"].startswith("fleet") else ""
        if r["run"].startswith("  "):  # the fleet above it over the same routing run as independent servers
            extra = f"  (the fleet: {rows[j - 1]['cpu_s'] / r['cpu_s'] - 1:+.1%} over this)"
        print(f"{r['run']:<42} {r['cpu_s']:7.1f} s CPU  {r['requests'] / r['cpu_s']:9,.0f} req/s  "
              f"finished {r['finished']:,}  events {r['events']:,}{extra}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
