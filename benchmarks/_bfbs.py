"""Fleet speed: a fleet of replicas against the same requests simulated as independent servers.

    python benchmarks/bench_fleet.py                       # 16 replicas, Azure conv at 16x its rate
    python benchmarks/bench_fleet.py --copies 4 --replicas 4

Workload: the Azure LLM inference 2023 conversation trace ($KVSIM_TRACES or ../shared/traces/), at
``--copies`` times its rate over the same hour: that many copies of the trace laid over each other,
copy k shifted by k/copies of the trace's span (wrapping around), so the request count and the rate
both grow by ``--copies`` (16: about 310k requests). Model: Llama-3-8B, each replica one A100-80GB,
``vllm``. Runs, each in a fresh process pinned to one core (when ``taskset`` exists):

- fleet: ``--replicas`` replicas behind each of ``--routers`` (round-robin and least-outstanding);
- independent: the same requests as ``--replicas`` single servers, server k taking requests k, k+N, ...
  (what round-robin gives each replica), timed together;
- with ``--replay``, after each fleet: the requests as that fleet routed them, as independent servers
  (for a router reading live state, what routing at each arrival on one clock costs over the same work).

The runs alternate, ``--rounds`` times (default 3: fleet, fleet, independent, fleet, ...), so a shared
machine's slow and fast spells fall on all of them. Prints each run's CPU seconds (the simulation's, in
its process: loading the trace is not counted) as the median and the minimum over the rounds, simulated
requests per second, and each fleet's cost over the independent servers': the ratio of the medians, and
the median of the rounds' own ratios (each round's runs are neighbours in time). ``--minutes M``: only
the first M minutes of the tiled trace (a quick check).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
    d = {"name": "bench-fleet", "model": "llama-3-8b", "gpu": "a100-80gb", "policies": [{"preset": "vllm", "name": "vllm", "block_size": int(os.environ.get("BS", "16"))}],
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


def requests_of(copies: int, minutes: float | None):
    base = parse_scenario(scenario(None))
    requests = tiled(load_requests(base, load_trace), copies)
    if minutes is not None:
        requests = requests.take(np.flatnonzero(requests.arrival_s < requests.arrival_s[0] + 60 * minutes),
                                 "other_server")
    return base, requests


def child(spec: dict) -> None:
    """One run in this process: prints its CPU seconds and figures as JSON (a fleet also writes its routing
    to ``spec["save"]``)."""
    base, requests = requests_of(spec["copies"], spec["minutes"])
    import sim.cluster.fleet  # noqa: F401  (imported before the clock starts, as pandas is)

    if spec["kind"] == "fleet":
        s = parse_scenario(scenario({"replicas": spec["replicas"], "router": spec["router"]}))
        t = time.process_time()
        res = run(s, requests=requests).policies["vllm"]
        cpu = time.process_time() - t
        np.save(spec["save"], res.requests.replica.to_numpy())
        info = {"finished": res.summary["num_finished"], "events": res.num_events}
    else:
        n, k = len(requests), spec["replicas"]
        if spec["parts"] is None:  # round-robin's split
            parts = [np.arange(j, n, k) for j in range(k)]
        else:  # a fleet's own routing
            assigned = np.load(spec["parts"])
            parts = [np.flatnonzero(assigned == j) for j in range(k)]
        cpu, finished, events = 0.0, 0, 0
        for part in parts:
            t = time.process_time()
            res = run(base, requests=requests.take(part, "other_server")).policies["vllm"]
            cpu += time.process_time() - t
            finished += res.summary["num_finished"]
            events += res.num_events
        info = {"finished": finished, "events": events}
    print(json.dumps({"cpu_s": cpu, "requests": len(requests), **info}))


def measure(spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", os.environ.get("KVSIM_BENCH_CORE", "0"), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    common = {"copies": a.copies, "minutes": a.minutes, "replicas": a.replicas}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for r in a.routers:
            save = str(Path(tmp) / f"{r}.npy")
            runs[f"fleet {a.replicas} x {r}"] = {**common, "kind": "fleet", "router": r, "save": save}
            if a.replay:
                runs[f"  {r}'s routing, independent"] = {**common, "kind": "independent", "parts": save}
        if not a.no_independent:
            runs[f"independent {a.replicas} servers"] = {**common, "kind": "independent", "parts": None}
        times: dict[str, list[float]] = {name: [] for name in runs}
        info = {}
        for _ in range(a.rounds):
            for name, spec in runs.items():
                info[name] = measure(spec)
                times[name].append(info[name].pop("cpu_s"))
    rows = [{"run": name, "cpu_s": float(np.median(ts)), "cpu_s_min": min(ts), "cpu_s_rounds": ts, **info[name]}
            for name, ts in times.items()]
    ind = times[rows[-1]["run"]] if not a.no_independent else None
    from sim import native

    print(native.describe())
    print(f"{rows[0]['requests']:,} requests (Azure conv x{a.copies}), {a.replicas} replicas, vllm, Llama-3-8B on "
          f"A100-80GB each; CPU s of the simulation, each run a fresh process: median (min) of {a.rounds} "
          f"alternating rounds")
    for j, r in enumerate(rows):
        extra = ""
        if ind and r["run"].startswith("fleet"):
            paired = float(np.median([x / y for x, y in zip(r["cpu_s_rounds"], ind)]))
            extra = f"  {r['cpu_s'] / np.median(ind) - 1:+.1%} vs independent (per round: {paired - 1:+.1%})"
        if r["run"].startswith("  "):  # the fleet above it over the same routing run as independent servers
            mine = rows[j - 1]["cpu_s_rounds"]
            paired = float(np.median([x / y for x, y in zip(mine, r["cpu_s_rounds"])]))
            extra = f"  (the fleet: {rows[j - 1]['cpu_s'] / r['cpu_s'] - 1:+.1%} over this, per round {paired - 1:+.1%})"
        print(f"{r['run']:<42} {r['cpu_s']:6.1f} s ({r['cpu_s_min']:5.1f}) {r['requests'] / r['cpu_s']:8,.0f} req/s  "
              f"finished {r['finished']:,}  events {r['events']:,}{extra}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
