"""Simulator speed at scale: requests per wall-clock second and peak memory, per preset; the cost per
event of each policy kind; start-up and whole-command times; and the targets, met or not.

    python benchmarks/bench_speed.py                 # everything, 10^6 requests included (minutes)
    python benchmarks/bench_speed.py --sizes         # no generated workloads: under a minute
    python benchmarks/bench_speed.py --sizes 100000 1000000 --presets vllm --no-trace

Setup (issue 8): Llama-2-7B on one A100-80GB. (a) The Azure LLM inference 2023 conv trace at its own
rate, read from $KVSIM_TRACES or ../shared/traces/ when present. (b) Generated workloads with Azure-conv-like sizes
(log-normal prompts: mean 1155, cv 0.6, at most 3072 tokens; outputs: mean 211, cv 1.3, at most 1000)
and Poisson arrivals at 5.5 requests/s, about the trace's own rate, which keeps every preset busy.
Each (workload, preset) runs in a fresh process, pinned to one core when `taskset` exists, so its
peak RSS is its own. Prints seconds, simulated requests per second, peak RSS, and the ratio of
times between consecutive sizes (linear cost means ~10x per 10x requests); for the trace, the number of
simulation events (steps, spans of steps, idle gaps) and the cost per event (CPU time of the whole
``run`` -- loop, results and summary -- over events; issue 18's target is 14 us on the reference core).

(c) The Azure trace under vllm and its variants (swap preemption, chunked prefill, prefix caching, a fleet
of two replicas): us/event and the ratio to plain vllm, each ratio taken within a round (``--rounds``,
default 3, each variant once per round) and the median over rounds printed. (d) Start-up: ``import sim`` and
``cli.py --help``, median of 5 fresh processes. (e) The whole command, ``cli.py run <Azure trace,
vllm> --no-report``, median of 3 fresh processes (start-up, trace reading, the run, the result files),
the trace read from its parsed copy (``traces/cache.py``; an untimed run first makes it, in a fresh folder);
and the same with the cache off, every run parsing the trace (what a trace's first run costs).
Times of fresh processes are CPU seconds (user + system, pinned to one core), which other work on the
machine disturbs less than wall time; wall time is printed beside them. The targets block at the end
compares each figure with the issue's target (``TARGETS``); a figure this run did not measure says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sim.trace_paths import locate  # noqa: E402  (searched in $KVSIM_TRACES, then ../shared/traces)

AZURE = locate("azure_2023/AzureLLMInferenceTrace_conv.csv")
PRESETS = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm", "vllm-v1"]
# (c): vllm and its variants on the trace, each a one-policy scenario (a policy entry, extra scenario keys)
VARIANTS = {
    "vllm": ("vllm", {}),
    "vllm swap": ({"preset": "vllm", "preemption": "swap", "name": "vllm-swap"}, {}),
    "vllm-v1 (chunked)": ("vllm-v1", {}),
    "vllm prefix cache": ({"preset": "vllm", "prefix_caching": True, "name": "vllm-prefix"}, {}),
    "vllm fleet of 2": ("vllm", {"cluster": {"replicas": 2, "router": "least-outstanding"}}),
}
# The targets: (label, unit, limit); every one is "at most".
TARGETS = {
    "us_per_event": ("us/event, Azure trace, vllm (CPU of run)", "us", 14.0),
    "command": ("whole `sim run --no-report`, Azure trace, vllm (CPU)", "s", 1.0),
    "startup": ("import sim + CLI start (`cli.py --help`, CPU)", "s", 0.3),
    "million": ("10^6 generated requests, vllm (CPU of run)", "s", 20.0),
    "rss": ("peak RSS at 10^6 requests, vllm", "MiB", 500.0),
    "x10": ("time ratio 10^5 -> 10^6 requests, vllm (CPU)", "x", 10.5),
    "variants": ("slowest vllm variant per event vs plain vllm", "x", 1.5),
}


def scenario(workload: dict, preset: str | dict, exact: bool, **extra) -> dict:
    return {"name": "bench", "model": "llama-2-7b", "gpu": "a100-80gb", "workload": workload,
            "policies": [preset], "record_steps": False, "exact": exact, **extra}


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
    if s.cluster is not None:  # imported before the clock starts, as sim.run's own modules are (start-up: (d))
        import sim.cluster.fleet  # noqa: F401  (and pandas, which a fleet's result tables use)
    t0, c0 = time.perf_counter(), time.process_time()
    r = run(s, requests=requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    p = next(iter(r.policies.values()))
    m = p.summary
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "requests": len(requests), "finished": m["num_finished"],
                      "steps": m["num_steps"], "events": p.num_events,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def pinned(cmd: list[str]) -> list[str]:
    core = os.environ.get("KVSIM_BENCH_CORE", "0")  # the core the runs are pinned to
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") else cmd


def measure(spec: dict) -> dict:
    out = subprocess.run(pinned([sys.executable, __file__, "--child", json.dumps(spec)]), capture_output=True,
                         text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed(cmd: list[str], repeat: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Medians of (CPU seconds, wall seconds) of ``repeat`` fresh processes running ``cmd`` in the
    checkout, pinned (``env``: variables set for them). CPU: user + system of the child, from the
    kernel's accounting (``RUSAGE_CHILDREN``)."""
    cpu, wall = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(pinned(cmd), capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
        wall.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr}")
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(cpu), statistics.median(wall)


def targets_block(got: dict) -> None:
    """Each target, the figure measured and met / NOT met (or why there is no figure)."""
    print("\ntargets")
    for key, (label, unit, limit) in TARGETS.items():
        v = got.get(key)
        if isinstance(v, str):
            verdict, shown = v, "-"
        else:
            verdict, shown = ("met" if v <= limit else "NOT met"), f"{v:,.2f} {unit}"
        print(f"  {label:<56} <= {limit:g} {unit:<4} {shown:>12}  {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="*", type=int, default=[10_000, 100_000, 1_000_000],
                    help="generated request counts (none: skip the generated workloads, a quick run)")
    ap.add_argument("--presets", nargs="*", default=PRESETS)
    ap.add_argument("--exact", action="store_true", help="step every iteration (the reference mode)")
    ap.add_argument("--rounds", type=int, default=3, help="(c): rounds of the variants, each a fresh process")
    ap.add_argument("--no-trace", action="store_true", help="skip everything on the Azure conv trace: (a), (c), (e)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.rounds = max(1, a.rounds)
    if a.child:
        child(json.loads(a.child))
        return
    from sim import native

    print(native.describe())
    print(f"Llama-2-7B on A100-80GB, {'exact' if a.exact else 'span'} mode, one process per run "
          f"({os.cpu_count()} cores here)")
    got: dict[str, float | str] = {}
    on_trace: dict[str, dict] = {}  # (a)'s runs, by preset: (c) starts from its vllm run
    no_trace = "not measured (--no-trace)" if a.no_trace else f"not measured ({AZURE} not found)"
    if not a.no_trace:
        if AZURE.exists():
            print(f"\n(a) Azure conv trace ({AZURE.name}) at its own rate")
            for p in a.presets:
                r = on_trace[p] = measure({"scenario": scenario({"kind": "trace", "path": str(AZURE)}, p, a.exact)})
                print(f"  {p:<18} {r['wall_s']:7.2f} s (cpu {r['cpu_s']:5.2f} s) {r['requests'] / r['wall_s']:9,.0f} req/s  "
                      f"peak RSS {r['peak_rss_mib']:6.0f} MiB  ({r['finished']:,} finished, {r['steps']:,} steps, "
                      f"{r['events']:,} events, {r['cpu_s'] / r['events'] * 1e6:5.1f} us/event)")
        else:
            print(f"\n(a) skipped: {AZURE} not found (real traces live outside the project: "
                  "sim trace fetch azure-2023-conv)")
    if a.sizes:
        print("\n(b) generated, Azure-conv-like sizes, Poisson 5.5 req/s")
    for p in a.presets if a.sizes else []:
        prev, last_n = None, 1
        for n in a.sizes:
            r = measure({"scenario": scenario(generated(n), p, a.exact)})
            ratio = f"  x{r['wall_s'] / prev['wall_s']:5.2f} time for x{n // last_n}" if prev else ""
            print(f"  {p:<18} {n:>9,} req {r['wall_s']:8.2f} s (cpu {r['cpu_s']:7.2f} s) {n / r['wall_s']:9,.0f} req/s  "
                  f"peak RSS {r['peak_rss_mib']:6.0f} MiB{ratio}")
            if p == "vllm" and n == 1_000_000:
                got["million"], got["rss"] = r["cpu_s"], r["peak_rss_mib"]
                if prev and last_n == 100_000:
                    got["x10"] = r["cpu_s"] / prev["cpu_s"]
            prev, last_n = r, n
    if "vllm" not in a.presets or 1_000_000 not in a.sizes:
        got.setdefault("million", "not measured (needs --presets vllm --sizes ... 1000000)")
        got.setdefault("rss", got["million"])
    got.setdefault("x10", "not measured (needs --sizes 100000 1000000 in order, vllm)")

    if a.no_trace or not AZURE.exists():
        got["us_per_event"] = got["variants"] = got["command"] = no_trace
    else:
        print(f"\n(c) Azure conv trace, vllm and its variants (CPU of run per event; ratio to plain vllm in the same "
              f"round; medians of {a.rounds} rounds)")
        runs: dict[str, list[dict]] = {label: [] for label in VARIANTS}
        for k in range(a.rounds):  # every variant once per round, in turn: a slow spell hits a whole round
            for label, (policy, extra) in VARIANTS.items():
                r = on_trace.get(policy) if k == 0 and policy == "vllm" and not extra else None
                runs[label].append(r or measure({"scenario": scenario({"kind": "trace", "path": str(AZURE)}, policy,
                                                                      a.exact, **extra)}))
        per = {label: [r["cpu_s"] / r["events"] * 1e6 for r in rs] for label, rs in runs.items()}
        base = per["vllm"]
        worst = 0.0
        for label, rs in runs.items():
            ratio = statistics.median(x / b for x, b in zip(per[label], base))
            worst = max(worst, ratio)
            spread = f"  (rounds x{min(x / b for x, b in zip(per[label], base)):4.2f}-" \
                     f"{max(x / b for x, b in zip(per[label], base)):4.2f})" if a.rounds > 1 and label != "vllm" else ""
            print(f"  {label:<18} (cpu {statistics.median(r['cpu_s'] for r in rs):5.2f} s) {rs[0]['events']:>9,} events "
                  f"{statistics.median(per[label]):6.1f} us/event  x{ratio:4.2f}{spread}")
        got["us_per_event"], got["variants"] = statistics.median(base), worst

    print("\n(d) start-up, median of 5 fresh processes (CPU, wall)")
    for label, cmd in (("import sim", [sys.executable, "-c", "import sim"]),
                       ("cli.py --help", [sys.executable, "cli.py", "--help"])):
        cpu, wall = timed(cmd, 5)
        print(f"  {label:<18} {cpu:6.3f} s cpu {wall:6.3f} s wall")
        if label == "cli.py --help":  # the CLI's start: importing sim, typer and rich, parsing the arguments
            got["startup"] = cpu

    if not (a.no_trace or not AZURE.exists()):
        print("\n(e) whole command: cli.py run <Azure trace, llama-2-7b, a100-80gb, vllm> --no-report, "
              "median of 3 fresh processes")
        with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
            spec = Path(tmp) / "azure-vllm.yaml"
            spec.write_text(json.dumps({"name": "azure-vllm", "model": "llama-2-7b", "gpu": "a100-80gb",
                                        "workload": {"kind": "trace", "path": str(AZURE)},
                                        "policies": ["vllm"]}))  # JSON is YAML; record_steps as default
            cmd = [sys.executable, "cli.py", "run", str(spec), "--no-report", "-o", str(Path(tmp) / "out")]
            cold = timed(cmd, 3, {"KVSIM_TRACE_CACHE": "0"})  # every run parses the trace (pandas imported)
            warm = {"KVSIM_TRACE_CACHE": str(Path(tmp) / "traces")}
            timed(cmd, 1, warm)  # (this one parses the trace and keeps it)
            cpu, wall = timed(cmd, 3, warm)
        print(f"  {'sim run':<18} {cpu:6.3f} s cpu {wall:6.3f} s wall  (the trace read from its parsed copy, "
              "traces/cache.py)")
        print(f"  {'first read':<18} {cold[0]:6.3f} s cpu {cold[1]:6.3f} s wall  (the trace parsed: KVSIM_TRACE_CACHE=0)")
        got["command"] = cpu
    targets_block(got)

if __name__ == "__main__":
    main()
