"""What interleaving alone costs: lone servers advanced together on one clock, against one after another.

    python benchmarks/bench_interleave.py                  # cachegrind, blocks of 1 and 4 (about 5 minutes on 2 cores)
    python benchmarks/bench_interleave.py --blocks 1 16 64
    python benchmarks/bench_interleave.py --cpu 3 5        # CPU time: 3 processes of 5 rounds, 15 minutes of the trace

A fleet whose router reads live replica state (least-outstanding) must have every replica current at
every arrival, so one core takes the replicas' events in time order, one replica's then another's. This
separates that interleaving from routing. The requests as ``bench_fleet.py``'s least-outstanding fleet
routes them (16 replicas, the first ``--minutes`` of the Azure conversation trace at 16x its rate) are
served by 16 lone servers that know their arrivals ahead: no router, no pushes, the same events as the
fleet. One driver (interpreted Python, a heap of the servers' clocks) takes every run's events, so runs
differ only in their order:

- ``apart``: one server after another (what ``bench_fleet.py --replay`` times);
- ``together B``: all of them, B events of a server at a time, the server whose clock is earliest first
  (B = 1: the fleet's order, without its router);
- ``fleet``: the least-outstanding fleet itself (routing at each arrival in its compiled clock loop, and
  the fleet's own summary).

By default each run is a process under cachegrind (a 48 KiB 12-way first level, a 2 MiB 16-way last
level: this machine's L1 and L2), minus a process that only sets its servers up; every run ends with the
servers' results. Prints millions of instructions and of first- and last-level data-cache misses; needs
valgrind. ``--cpu PROCESSES ROUNDS`` times ``apart`` and ``together 1`` instead (CPU seconds of the events
alone, fresh servers each run, alternating inside each process, each process fresh and pinned to one core
where ``taskset`` exists) and prints each process's median ratio: a shared machine's noise moves a whole
process more than one run within it.
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
    import math

    import numpy as np

    from bench_fleet import requests_of, scenario
    from sim.cluster.fleet import Fleet
    from sim.config import parse_scenario
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
    servers = lone_servers(base, requests, np.load(routing))
    if mode == "setup":
        return
    events = drive(servers, 1 if mode == "apart" else len(servers), blocks)
    for _, clock, e in servers:  # each server's results, as a lone run makes them
        assert math.isfinite(clock.now)
        e.results()
    print(json.dumps({"events": events}))


def lone_servers(base, requests, assigned) -> list:
    """One lone server per replica of ``assigned`` (as ``sim.run.run`` makes one), each with its waits
    generator and its clock, not started."""
    import numpy as np

    from sim.engine import Engine, LoneClock
    from sim.policy import rejection_reasons, resolve_policy
    from sim.run import model_executor

    model, gpu = base.model_spec(), base.gpu_spec()
    servers = []
    for j in range(int(assigned.max()) + 1):
        part = requests.take(np.flatnonzero(assigned == j), "other_server")
        resolved = resolve_policy(base, model, gpu, base.policies[0])
        e = Engine(part, resolved, model_executor(base, model, gpu, resolved, part), horizon_s=base.horizon_s,
                   exact=base.exact, record_steps=base.record_steps, timeline_bin_s=base.timeline_bin_s,
                   sampling=base.sampling, startup_s=base.startup_s)
        ok = rejection_reasons(resolved, e.kv, part.prompt_tokens, part.output_tokens) == 0
        clock = LoneClock()
        servers.append((e.waits(np.flatnonzero(ok), clock), clock, e))
    return servers


def drive(servers: list, group: int, blocks: int = 1) -> int:
    """Take the servers' events ``group`` servers at a time (1: one server after another), ``blocks``
    events of a server at a time, the server whose clock is earliest first; returns the events taken."""
    import heapq

    from sim.engine import paced_gc

    events = 0
    with paced_gc():
        for g0 in range(0, len(servers), group):
            heap = [(0.0, j) for j in range(g0, min(g0 + group, len(servers)))]
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
    return events


def cpu(minutes: float, rounds: int, routing: str) -> None:
    """CPU time, in this one process: the same driver taking the lone servers one after another, then all
    together, ``rounds`` times alternately (fresh servers each run; setup and results not timed)."""
    import statistics
    import time

    import numpy as np

    from bench_fleet import requests_of

    base, requests = requests_of(16, minutes)
    assigned = np.load(routing)
    times: dict[int, list[float]] = {1: [], 16: []}
    for _ in range(rounds):
        for group in times:
            servers = lone_servers(base, requests, assigned)
            t = time.process_time()
            drive(servers, group)
            times[group].append(time.process_time() - t)
            del servers
    print(json.dumps({"apart": times[1], "together": times[16],
                      "ratio": statistics.median(b / a for a, b in zip(times[1], times[16]))}))


def measure(mode: str, blocks: int, minutes: float, routing: str) -> tuple[int, int, int]:
    cmd = [*(["setarch", "-R"] if shutil.which("setarch") else []), "valgrind", "--tool=cachegrind",
           "--cache-sim=yes", *CACHES, "--cachegrind-out-file=/dev/null", sys.executable, __file__, "--child",
           json.dumps([mode, blocks, minutes, routing])]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    got = [re.search(rf"{k}:\s+([\d,]+)", out.stderr) for k in (r"I\s+refs", r"D1\s+misses", r"LLd\s+misses")]
    if out.returncode != 0 or None in got:
        sys.exit(f"{mode}: valgrind run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return tuple(int(m.group(1).replace(",", "")) for m in got)  # type: ignore[union-attr,return-value]


def cpu_table(processes: int, rounds: int, minutes: float, routing: str) -> None:
    import statistics

    pin = ["taskset", "-c", os.environ.get("KVSIM_BENCH_CORE", "0")] if shutil.which("taskset") else []
    print(f"16 lone servers, least-outstanding's routing of the first {minutes:g} minutes; CPU s of the events "
          f"alone, one driver: apart (one server after another) and together (in time order), {rounds} "
          "alternating rounds per process")
    ratios = []
    for p in range(processes):
        out = subprocess.run([*pin, sys.executable, __file__, "--child", json.dumps(["cpu", minutes, rounds, routing])],
                             capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        ratios.append(got["ratio"])
        print(f"process {p + 1}: apart {statistics.median(got['apart']):.2f} s, together "
              f"{statistics.median(got['together']):.2f} s (medians); together over apart, median of the rounds: "
              f"{got['ratio'] - 1:+.1%}", flush=True)
    print(f"median over processes: {statistics.median(ratios) - 1:+.1%} (range {min(ratios) - 1:+.1%} to "
          f"{max(ratios) - 1:+.1%})")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        args = json.loads(sys.argv[2])
        if args[0] == "cpu":
            sys.path.insert(0, str(ROOT))
            sys.path.insert(0, str(ROOT / "benchmarks"))
            cpu(*args[1:])
        else:
            child(*args)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4], help="events of a server at a time")
    ap.add_argument("--minutes", type=float, default=None,
                    help="the first M minutes of the tiled trace (default 4; 15 with --cpu)")
    ap.add_argument("--cpu", type=int, nargs=2, metavar=("PROCESSES", "ROUNDS"),
                    help="CPU time instead of cachegrind: PROCESSES fresh processes, each timing apart and together "
                         "ROUNDS times alternately")
    a = ap.parse_args()
    a.minutes = a.minutes or (15.0 if a.cpu else 4.0)
    if any(b < 1 for b in a.blocks) or a.minutes <= 0 or (a.cpu and min(a.cpu) < 1):
        ap.error("--blocks, PROCESSES and ROUNDS must be at least 1 and --minutes positive")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_instructions import needs_valgrind_and_trace

    needs_valgrind_and_trace("bench_interleave", valgrind=not a.cpu)
    with tempfile.TemporaryDirectory() as tmp:
        routing = str(Path(tmp) / "routing.npy")
        subprocess.run([sys.executable, __file__, "--child", json.dumps(["route", 1, a.minutes, routing])],
                       check=True)
        if a.cpu:
            return cpu_table(a.cpu[0], a.cpu[1], a.minutes, routing)
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
