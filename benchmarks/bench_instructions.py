"""Instructions per simulation, counted by valgrind: a speed figure that a busy machine does not move.

    python benchmarks/bench_instructions.py                    # every case (about 15 minutes)
    python benchmarks/bench_instructions.py vllm fleet-lo      # some of them

CPU timings on a shared machine vary by tens of percent from run to run; the instructions a run executes
vary by about 1 % (sets of objects iterate in address order, which moves between processes). Each case
runs twice under ``valgrind --tool=cachegrind --cache-sim=no``, once simulating and once only loading the
same requests and importing the same modules, and prints the difference: the simulation's own
instructions, from a cold start (its pricing caches empty), in millions; ``--repeat N`` prints the median
of N such differences. Compare two versions of the code by running this script in each checkout.

Cases (the Azure LLM inference 2023 conversation trace, from $KVSIM_TRACES or ../shared/traces/):

- ``vllm``, ``vllm-v1``, ``vllm-prefix-caching``, ``orca-oracle``: its first 600 s (2,867 requests),
  Llama-2-7B on one A100-80GB, one policy;
- ``six-presets``: the same 600 s under the six presets in one run (they share pricing);
- ``fleet-lo``, ``fleet-rr``: the trace at 16x its rate (``bench_fleet.py``'s tiling), its first 4
  minutes (21,183 requests), 16 replicas of Llama-3-8B behind least-outstanding and round-robin (which
  routes ahead: the same work as 16 independent servers).

Needs valgrind (``apt-get install valgrind``); says so and exits 2 without it or without the trace.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm", "vllm-v1"]
CASES = {
    "vllm": ["vllm"],
    "vllm-v1": ["vllm-v1"],
    "vllm-prefix-caching": [{"preset": "vllm", "name": "vllm-prefix-caching", "prefix_caching": True}],
    "orca-oracle": ["orca-oracle"],
    "six-presets": PRESETS,
    "fleet-lo": "least-outstanding",
    "fleet-rr": "round-robin",
}


def child(case: str, simulate: bool) -> None:
    """One case in this process: load its requests, import what a run imports, and run it if ``simulate``."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import importlib

    import numpy as np

    importlib.import_module("sim.cluster.fleet")  # what a run imports (sim.run imports the engine), in both modes
    from sim.config import parse_scenario
    from sim.run import run
    from sim.trace_paths import locate
    from sim.workload import load_requests
    from traces.workload import load_trace

    what = CASES[case]
    if isinstance(what, list):
        s = parse_scenario({"name": "bench", "model": "llama-2-7b", "gpu": "a100-80gb", "policies": what,
                            "record_steps": False, "decompose": False,
                            "workload": {"kind": "trace", "duration_s": 600,
                                         "path": str(locate("azure_2023/AzureLLMInferenceTrace_conv.csv"))}})
        requests = load_requests(s, load_trace)
    else:
        from bench_fleet import scenario, tiled

        base = parse_scenario(scenario(None))
        requests = tiled(load_requests(base, load_trace), 16)
        requests = requests.take(np.flatnonzero(requests.arrival_s < requests.arrival_s[0] + 240), "other_server")
        s = parse_scenario(scenario({"replicas": 16, "router": what}))
    if simulate:
        res = run(s, requests=requests)
        print("events", sum(p.num_events for p in res.policies.values()), "requests", len(requests))


def instructions(case: str, simulate: bool) -> int:
    cmd = [*(["setarch", "-R"] if shutil.which("setarch") else []),  # the same addresses, where it can
           "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", sys.executable,
           __file__, "--child", case, "run" if simulate else "load"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    m = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if out.returncode != 0 or m is None:
        sys.exit(f"{case}: valgrind run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return int(m.group(1).replace(",", ""))


def needs_valgrind_and_trace(name: str, valgrind: bool = True) -> None:
    """Exit 2, saying which, when valgrind (unless not ``valgrind``) or the Azure conversation trace is
    missing (benchmark ``name``)."""
    if valgrind and shutil.which("valgrind") is None:
        print(f"{name}: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(ROOT))
    from sim.trace_paths import find_trace, searched

    if find_trace("azure_2023/AzureLLMInferenceTrace_conv.csv") is None:
        print(f"{name}: azure_2023/AzureLLMInferenceTrace_conv.csv not found (searched {searched()})", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] == "run")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"some of: {', '.join(CASES)} (default: all)")
    ap.add_argument("--repeat", type=int, default=1, help="median of this many measurements per case")
    a = ap.parse_args()
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case {', '.join(unknown)}; expected some of: {', '.join(CASES)}")
    needs_valgrind_and_trace("bench_instructions")
    from sim import native

    print(native.describe())
    print("case                    M instructions (simulation only, cold start)")
    for case in a.cases or list(CASES):
        ns = sorted(instructions(case, True) - instructions(case, False) for _ in range(max(1, a.repeat)))
        spread = f"  (of {len(ns)}: {ns[0] / 1e6:,.0f}-{ns[-1] / 1e6:,.0f})" if len(ns) > 1 else ""
        print(f"{case:<23} {ns[len(ns) // 2] / 1e6:10,.0f}{spread}", flush=True)


if __name__ == "__main__":
    main()
