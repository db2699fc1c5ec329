"""What interleaving alone costs: lone servers advanced together on one clock, against one after another.

    python benchmarks/bench_interleave.py                  # blocks of 1 and 4 events (about 5 minutes on 2 cores)
    python benchmarks/bench_interleave.py --blocks 1 16 64

A fleet whose router reads live replica state (least-outstanding) must have every replica current at
every arrival, so one core takes the replicas' events in time order, one replica's then another's. This
separates that interleaving from routing. The requests as ``bench_fleet.py``'s least-outstanding fleet
routes them (16 replicas, the first ``--minutes`` of the Azure conversation trace at 16x its rate) are
served by 16 lone servers that know their arrivals ahead: no router, no pushes, the same events as the
fleet. Each run is a process under cachegrind (a 48 KiB 12-way first level, a 2 MiB 16-way last level:
this machine's L1 and L2), minus a process that only sets its servers up; every run ends with the
servers' results:

- ``apart``: one server after another (what ``bench_fleet.py --replay`` times);
- ``together B``: all of them, B events of a server at a time, the server whose clock is earliest first
  (B = 1: the fleet's order, without its router);
- ``fleet``: the least-outstanding fleet itself (routing at each arrival, and the fleet's own summary).

Prints millions of instructions and of first- and last-level data-cache misses. The driver of
``together`` is interpreted Python (a heap): it adds instructions, hardly any misses. Needs valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHES = ["--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]


def child(mode: str, blocks: int, minutes: float, routing: str) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import heapq
    import math

    import numpy as np

    from bench_fleet import requests_of, scenario
    from sim.cluster.fleet import Fleet
    from sim.config import parse_scenario
    from sim.engine import Engine, LoneClock, paced_gc
    from sim.policy import rejection_reasons, resolve_policy
    from sim.run import model_executor, run

    base, requests = requests_of(16, minutes)
    fleet = parse_scenario(scenario({"replicas": 16, "router": "least-outstanding"}))
    if mode == "route":  # the routing the other runs replay
        np.save(routing, run(fleet, requests=requests).policies["vllm"].requests.replica.to_numpy())
        return
    if mode.startswith("fleet"):
        model, policy = fleet.model_spec(), fleet.policies[0]
        f = Fleet(fleet, model, policy, "least-outstanding", requests, model_executor, fleet.record_steps)
        if mode == "fleet":
            f.run()
        return
    assigned = np.load(routing)
    model, gpu = base.model_spec(), base.gpu_spec()
    servers = []
    for j in range(16):
        part = requests.take(np.flatnonzero(assigned == j), "other_server")
        resolved = resolve_policy(base, model, gpu, base.policies[0])
        e = Engine(part, resolved, model_executor(base, model, gpu, resolved, part), horizon_s=base.horizon_s,
                   exact=base.exact, record_steps=base.record_steps, timeline_bin_s=base.timeline_bin_s,
                   sampling=base.sampling, startup_s=base.startup_s)  # as sim.run.run makes a lone server
        ok = rejection_reasons(resolved, e.kv, part.prompt_tokens, part.output_tokens) == 0
        clock = LoneClock()
        servers.append((e.waits(np.flatnonzero(ok), clock), clock, e))
    if mode == "setup":
        return
    events = 0
    with paced_gc():
        if mode == "apart":
            for waits, clock, _ in servers:
                for delay in waits:
                    clock.now = clock.now + delay
                    events += 1
        else:
            heap = [(0.0, j) for j in range(len(servers))]
            while heap:
                _, j = heapq.heappop(heap)
                waits, clock, _ = servers[j]
                for _ in range(blocks):
                    delay = next(waits, None)
                    if delay is None:
                        break
                    clock.now = clock.now + delay
                    events += 1
                else:
                    heapq.heappush(heap, (clock.now, j))
    for _, clock, e in servers:  # each server's results, as a lone run makes them
        assert math.isfinite(clock.now)
        e.results()
    print(json.dumps({"events": events}))


def measure(mode: str, blocks: int, minutes: float, routing: str) -> tuple[int, int, int]:
    cmd = [*(["setarch", "-R"] if shutil.which("setarch") else []), "valgrind", "--tool=cachegrind",
           "--cache-sim=yes", *CACHES, "--cachegrind-out-file=/dev/null", sys.executable, __file__, "--child",
           json.dumps([mode, blocks, minutes, routing])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    got = [re.search(rf"{k}:\s+([\d,]+)", out.stderr) for k in (r"I\s+refs", r"D1\s+misses", r"LLd\s+misses")]
    if out.returncode != 0 or None in got:
        sys.exit(f"{mode}: valgrind run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return tuple(int(m.group(1).replace(",", "")) for m in got)  # type: ignore[union-attr,return-value]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(*json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4], help="events of a server at a time")
    ap.add_argument("--minutes", type=float, default=4.0, help="the first M minutes of the tiled trace")
    a = ap.parse_args()
    if any(b < 1 for b in a.blocks) or a.minutes <= 0:
        ap.error("--blocks must be at least 1 and --minutes positive")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_instructions import needs_valgrind_and_trace

    needs_valgrind_and_trace("bench_interleave")
    with tempfile.TemporaryDirectory() as tmp:
        routing = str(Path(tmp) / "routing.npy")
        subprocess.run([sys.executable, __file__, "--child", json.dumps(["route", 1, a.minutes, routing])],
                       check=True)
        runs = [("setup", 1), ("fleet-setup", 1), ("apart", 1), *[("together", b) for b in a.blocks], ("fleet", 1)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # (counts do not depend on the load)
            counts = list(pool.map(lambda r: measure(*r, a.minutes, routing), runs))
        setups = {"fleet": counts[1]}
        print(f"16 servers, least-outstanding's routing of the first {a.minutes:g} minutes; millions, each run "
              "minus a process that only sets it up")
        print(f"{'run':<14} {'instructions':>12} {'L1 data misses':>15} {'L2 data misses':>15}")
        first = None
        for (mode, b), count in zip(runs[2:], counts[2:]):
            got = [x - s for x, s in zip(count, setups.get(mode, counts[0]))]
            first = first or got
            name = f"together {b}" if mode == "together" else mode
            over = "" if got is first else "   (" + ", ".join(f"{x / y - 1:+.0%}" for x, y in zip(got, first)) + ")"
            print(f"{name:<14} {got[0] / 1e6:12,.0f} {got[1] / 1e6:15,.1f} {got[2] / 1e6:15,.2f}{over}", flush=True)


if __name__ == "__main__":
    main()
