"""The device check: one command, one JSON of figures with provenance, written after every section.

    python gpu/check.py --device cuda --out reports/device_check.json      # a GPU, inside --budget-s (420 s)
    python gpu/check.py --device cpu --out /tmp/device_check.json          # small shapes (the interpreter)

Sections, each isolated (an exception is recorded with its traceback and the next section runs), each
with a share of the time left (``--budget-s``; checked between steps, and a SIGALRM cuts a section that
overruns its share by half), the JSON rewritten atomically after each one so a kill keeps what was done:

  kernels      every kernel against its fp64 PyTorch reference, error per sequence (RMS), in a process of
               its own (a fault cannot take the rest down); a deliberately broken case that must fail;
               on a GPU also 16k-33k contexts, block sizes 8/16/32, block ids near the top of a pool of
               more than 2^31 elements (``gpu.kernel_cases``)
  bandwidth    a warm-up burn; copy and read-only streaming ceilings (each the best of several ways);
               decode attention, paged and contiguous in alternation at the default pipeline depth and at
               3 stages, batch {1..256} x context {512..32k} (what fits), CUDA-graph timed; the paging overhead at matched num_stages/tile/warps and best against best (block
               ids prefetched one tile ahead, and not); each compiled kernel's registers, shared memory,
               spills (``gpu.bench``)
  calibration  a Llama-3-8B-shaped model (``--layers`` of its 32) measured over the replay's range and
               fitted (``gpu.calibrate``); decode steps as CUDA graphs; host vs GPU time per step
  replay       closed-loop replay of an Azure conv slice under vllm and orca-max on the same KV pool, the
               number of requests sized from the profile's own prediction of the time it takes
  validation   the calibrated simulation against that replay

then the issue's targets, each with its measured figure (reported, never asserted). If a kernel fails its
check, calibration and replay use the PyTorch attention path and say so. ``--inject-failure SECTION``
(or ``KVSIM_INJECT_FAILURE=a,b``) raises at the start of a section, to prove the isolation.

On the CPU every shape shrinks (the Triton interpreter runs the kernels) and the model is the 2-layer
tiny one: the figures say the pipeline works, nothing about a GPU. On a GPU a missing trace or package is
an error naming it; on the CPU a missing trace skips the trace sections with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AZURE = "traces/azure_2023/AzureLLMInferenceTrace_conv.csv"
BUNDLE_TRACE = ".device/azure_conv.csv"  # written by gpu/device_bundle.py
AZURE_HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens"  # the trace's first line (gpu/device_bundle.py checks it too)
SECTIONS = ("kernels", "bandwidth", "calibration", "replay", "validation")
# Share of the time left that each section may use (the rest flows to later sections when unused).
WEIGHTS = {"kernels": 1.0, "bandwidth": 1.5, "calibration": 0.5, "replay": 0.8, "validation": 0.3}
# The kernels a replay runs: Triton is used only if each of these passed its check (bf16, both layouts).
REPLAY_KERNELS = {(k, layout, "bfloat16") for k in ("store_kv", "decode_attention", "decode_attention_split_k",
                                                     "prefill_attention") for layout in ("paged", "contiguous")}
RESERVE_S = 10.0  # kept back from the budget for the last write
GRACE = 1.5  # a section's hard limit (SIGALRM) is its share times this (never past the budget)
# Packages each section needs beyond torch/triton/numpy (the device image has numpy, pandas, pyarrow, typer,
# rich, nvidia-ml-py; pydantic, simpy and yaml travel as wheels: gpu/device_bundle.py).
NEEDS = {"kernels": (), "bandwidth": (),
         "calibration": ("pydantic", "simpy", "yaml", "pandas"), "replay": ("pydantic", "simpy", "yaml", "pandas"),
         "validation": ("pydantic", "simpy", "yaml", "pandas", "pyarrow")}
PACKAGES = ("torch", "triton", "numpy", "pandas", "pyarrow", "pydantic", "simpy", "yaml", "pynvml")

# Per device: shapes and sizes. GPU figures come from these runs; CPU ones only exercise the pipeline.
SETTINGS = {
    "cuda": {
        "burn_s": 3.0, "ceiling_bytes": 2 << 30, "rep_ms": 20, "rounds": 2,
        "decode_heads": (32, 8, 128), "decode_batches": (1, 8, 32, 64, 128, 256),
        "decode_contexts": (512, 2048, 4096, 8192, 32768),
        "matched_shape": (64, 4096),
        # (num_stages, keys per tile, warps): the default tile first at every depth, then the others
        "matched": ((1, 64, 4), (2, 64, 4), (3, 64, 4), (1, 128, 4), (2, 128, 4), (3, 128, 4), (2, 64, 8),
                    (3, 64, 8), (2, 32, 4)),
        "model": "llama-3-8b", "layers": 8,
        # replay: lengths capped, the model's max_model_len cut to 4096, a pool of 16 x max_model_len
        "max_model_len": 4096, "orca_concurrency": 16, "max_requests": 400, "min_requests": 40,
        "max_prompt": 2048, "max_output": 256, "time_scale": 50.0, "quick": False,
    },
    "cpu": {  # the interpreter runs a program in tens of milliseconds: few heads, short contexts
        "burn_s": 0.0, "ceiling_bytes": 256 << 10, "rep_ms": 20, "rounds": 1,
        "decode_heads": (8, 2, 32), "decode_batches": (1, 4), "decode_contexts": (64, 256),
        "matched_shape": (2, 64), "matched": ((1, 64, 4), (2, 32, 4)),
        "model": str(ROOT / "gpu" / "configs" / "tiny-llama.json"), "layers": None,
        "max_model_len": 256, "orca_concurrency": 8, "max_requests": 12, "min_requests": 4,
        "max_prompt": 128, "max_output": 12, "time_scale": 10.0, "quick": True,
    },
}
# --quick (the tests): the CPU settings, fewer kernel cases and the smallest replay
QUICK = {"decode_heads": (4, 1, 16), "decode_batches": (2,), "decode_contexts": (64,), "matched": ((1, 64, 4),),
         "max_requests": 6, "min_requests": 3, "max_prompt": 64, "max_output": 6, "ceiling_bytes": 64 << 10}


class InjectedFailure(RuntimeError):
    """Raised at the start of a section named by --inject-failure (a test of the isolation)."""


class BudgetExceeded(RuntimeError):
    """SIGALRM: a section ran past its hard limit."""


def find_trace(explicit: str | None) -> tuple[Path | None, list[str]]:
    """The Azure conv CSV: ``--trace``, the bundle's slice, ``$KVSIM_TRACES``, or the shared traces (the
    order of ``sim.trace_paths``, read here without importing the simulator); and where it looked."""
    if explicit:
        return Path(explicit), [explicit]
    rel = AZURE.removeprefix("traces/")
    env = os.environ.get("KVSIM_TRACES", "").strip()
    places = [ROOT / BUNDLE_TRACE] + ([Path(env).expanduser() / rel] if env else []) + [
        ROOT / "shared" / AZURE, ROOT.parent / "shared" / AZURE]
    for p in places:
        if p.exists():
            return p, [str(x) for x in places]
    return None, [str(x) for x in places]


def azure_trace_problem(path: Path) -> str | None:
    """Why ``path`` is not the Azure conv trace (its header and a row), or None. NOTE: a --trace given with a typo
    skipped the trace sections (exit 0 on the CPU); an empty file was a pandas EmptyDataError naming no file; a
    header alone, a "no requests" naming a file the check had derived."""
    if not path.is_file():
        return "no such file" if not path.exists() else "not a file"
    try:
        with open(path, "rb") as f:
            header, row = f.readline(), f.readline()
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    if not header.startswith(AZURE_HEADER):
        return f"not the Azure LLM inference trace (expected the header {AZURE_HEADER.decode()}, got {header[:60]!r})"
    if not row.strip():
        return "no requests after the header"
    return None


def missing_packages() -> list[str]:
    return [p for p in PACKAGES if importlib.util.find_spec(p) is None]


def model_config(spec, num_layers: int | None, max_model_len: int | None = None) -> dict:
    """A Hugging Face style config.json of a catalog model, optionally with fewer layers and a shorter
    ``max_model_len`` (what orca-max reserves per request)."""
    layers = num_layers or spec.num_layers
    return {"_name_or_path": f"{spec.name}-{layers}l" if num_layers else spec.name, "model_type": "llama",
            "num_hidden_layers": layers, "hidden_size": spec.hidden_size, "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "intermediate_size": spec.ffn_size,
            "vocab_size": spec.vocab_size, "max_position_embeddings": max_model_len or spec.max_model_len,
            "tie_word_embeddings": spec.tie_embeddings}


def write_json(path: Path, fig: dict) -> None:
    """Atomically: a reader (or a kill) sees the previous file or this one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(fig, indent=1, default=str))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ sections


def run_kernels(ctx: "Check") -> dict:
    """``python -m gpu.kernel_cases`` in a child process (a CUDA fault there cannot poison this one),
    killed at the section's hard limit; its rows are read back even when it did not finish."""
    out = ctx.work / "kernels.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "gpu.kernel_cases", "--device", ctx.device.type, "--out", str(out)]
    if ctx.quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    timeout = max(5.0, ctx.hard_limit - time.perf_counter())
    log = ctx.work / "kernels.log"
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc, timed_out = p.returncode, False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    data = json.loads(out.read_text()) if out.exists() else {"rows": [], "complete": False}
    rows = data["rows"]
    tail = log.read_text()[-3000:]
    res = {"rows": rows, "complete": data["complete"], "returncode": rc, "timed_out": timed_out,
           "num_cases": sum(1 for r in rows if not r.get("skipped")),
           "num_failed": sum(1 for r in rows if r.get("ok") is False),
           "num_skipped": sum(1 for r in rows if r.get("skipped")),
           "broken_case_caught": next((r["caught"] for r in rows if r.get("must_fail")), None)}
    if not data["complete"]:
        raise RuntimeError(f"the kernel checks stopped after {len(rows)} cases "
                           f"({'timed out' if timed_out else f'exit code {rc}'}); log tail:\n{tail}", res)
    return res


def run_bandwidth(ctx: "Check") -> dict:
    from gpu import bench

    s, dev = ctx.s, ctx.device
    out: dict = {"burn": bench.warmup_burn(dev, s["burn_s"])}
    ceil = out["ceilings"] = bench.ceilings(dev, s["ceiling_bytes"], s["rep_ms"])
    ctx.save()
    # the grid gets 60 % of what is left of the section, the matched comparison the rest
    grid_deadline = time.perf_counter() + 0.6 * (ctx.deadline - time.perf_counter())
    out["decode_attention"] = bench.decode_grid(dev, s["decode_heads"], s["decode_batches"], s["decode_contexts"],
                                                ceil, rounds=s["rounds"], rep_ms=s["rep_ms"], deadline=grid_deadline)
    ctx.save()
    out["matched_overhead"] = bench.matched_overhead(dev, s["decode_heads"], s["matched_shape"], list(s["matched"]),
                                                     ceil, rounds=s["rounds"], rep_ms=s["rep_ms"],
                                                     deadline=ctx.deadline)
    out["compiled_kernels"] = bench.compiled_resources()
    return out


def replay_scenario(ctx: "Check", num_requests: int):
    """The replay's scenario in ``work`` (re-runnable with ``sim validate``): the model with its layers
    and max_model_len cut, a device whose memory leaves a KV pool of ``orca_concurrency x max_model_len``
    tokens, vllm and orca-max, the first ``num_requests`` of the Azure conv trace as a request table."""
    import yaml

    from gpu.azure import azure_requests
    from gpu.calibrate import resolve_model
    from gpu.replay import memory_gib_for_pool
    from kvsim import read_trace  # this script is an entry point: it wires the trace readers as the CLI does
    from sim.config import load_scenario
    from sim.workload import load_requests

    s, work = ctx.s, ctx.work
    spec = resolve_model(s["model"])
    (work / "model_config.json").write_text(json.dumps(model_config(spec, s["layers"], s["max_model_len"]), indent=1))
    spec = resolve_model(str(work / "model_config.json"))
    requests = azure_requests(ctx.trace, num_requests, max_prompt_tokens=s["max_prompt"],
                              max_output_tokens=s["max_output"], time_scale=s["time_scale"])
    requests.to_frame().to_csv(work / "requests.csv", index=False)
    ctx.slice_source = requests.source
    pool_tokens = s["orca_concurrency"] * s["max_model_len"]
    scenario = {
        "name": f"device-check-{spec.name}",
        "description": f"{requests.source}; KV pool of about {pool_tokens} tokens",
        "model": "model_config.json",
        # roofline inputs unused (the check simulates with the measured profile); the memory sizes the pool
        "gpu": {"name": "check-device", "memory_gib": memory_gib_for_pool(spec, pool_tokens),
                "hbm_gb_per_s": 4800, "tflops": 989},
        "gpu_memory_utilization": 0.9, "runtime_overhead_gib": 0, "activation_reserve_tokens": 2048,
        "workload": {"kind": "table", "path": "requests.csv"},
        "policies": ["vllm", "orca-max"],
        "record_steps": True,
    }
    (work / "scenario.yaml").write_text(yaml.safe_dump(scenario, sort_keys=False))
    scenario = load_scenario(work / "scenario.yaml")
    return scenario, load_requests(scenario, read_trace)


def pool_sizing(ctx: "Check", scenario, requests) -> dict:
    """How the pool was sized, and what it lets each policy batch."""
    from sim.run import policy_pool

    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    pools = {p.name: policy_pool(scenario, model, gpu, p).num_slots for p in scenario.policies}
    pool = min(pools.values())
    mean_final = float((requests.prompt_tokens + requests.output_tokens).mean())
    max_seqs = max(p.max_num_seqs for p in scenario.policies)
    return {
        "rule": (f"pool = {ctx.s['orca_concurrency']} x max_model_len ({model.max_model_len}); orca-max reserves "
                 f"max_model_len per request, so it runs {pool // model.max_model_len} at once; vllm holds only "
                 f"what each request has written (block by block), about pool / mean final length at once; "
                 f"lengths are capped at {ctx.s['max_prompt']} prompt and {ctx.s['max_output']} output tokens so "
                 f"every request fits, and arrivals are compressed x{ctx.s['time_scale']:g} so both stay full"),
        "max_model_len": model.max_model_len, "kv_pool_tokens": pools,
        "orca_max_concurrent": pool // model.max_model_len,
        "vllm_concurrent_estimate": int(min(max_seqs, pool // max(mean_final, 1))),
        "mean_final_tokens": mean_final,
        "usable_device_memory": ctx.fig["provenance"].get("memory"),
    }


def check_fits(ctx: "Check", scenario) -> dict | None:
    """On a GPU: the weights and the largest pool must fit in the memory the driver reports free."""
    from gpu.device import usable_memory
    from sim.run import policy_pool

    mem = usable_memory(ctx.device)
    if mem is None:
        return None
    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    pool = max((policy_pool(scenario, model, gpu, p) for p in scenario.policies), key=lambda p: p.num_slots)
    need = pool.kv_bytes + pool.weights_bytes  # (as the pool counts them: quantised weights at their size)
    if need > 0.8 * mem["free_bytes"]:
        raise RuntimeError(f"the replay needs {need / 2**30:.1f} GiB (weights and KV pool) but the device has "
                           f"{mem['free_gib']:.1f} GiB free (torch.cuda.mem_get_info): lower the pool or layers")
    return {"need_gib": need / 2**30, "free_gib": mem["free_gib"], "total_gib": mem["total_gib"]}


def run_calibration(ctx: "Check") -> dict:
    from gpu.calibrate import calibrate, grid_for_scenario
    from gpu.executor import step_log_summary
    from sim.run import policy_pool

    scenario, requests = replay_scenario(ctx, ctx.s["max_requests"])
    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    fits = check_fits(ctx, scenario)
    pool_tokens = max(policy_pool(scenario, model, gpu, p).num_slots for p in scenario.policies)
    quick = ctx.s["quick"] or (ctx.deadline - time.perf_counter()) < 45
    grid = grid_for_scenario(scenario, requests, pool_tokens, quick)
    t0 = time.perf_counter()
    logs: list = []
    profile = calibrate(model, str(ctx.device), grid=grid, out=ctx.work / "profile.json", attention=ctx.attention,
                        step_logs=logs)
    ctx.profile_path = ctx.work / "profile.json"
    return {"model": {"name": model.name, "num_layers": model.num_layers, "num_params": model.num_params},
            "attention": ctx.attention, "quick_grid": quick, "device_memory": fits,
            "profile": str(ctx.profile_path), "num_points": len(profile["points"]),
            "fit": {k: v["fit"] for k, v in profile["layouts"].items()},
            "coefficients": {k: v["coefficients"] for k, v in profile["layouts"].items()},
            "swap_block_s": profile["swap_block_s"], "steps": step_log_summary(logs),
            "measure_s": time.perf_counter() - t0}


def predict_replay_s(ctx: "Check", n: int, per_step_s: float) -> tuple[float, dict]:
    """Seconds a replay of the first ``n`` requests should take, by the calibrated profile: the simulated
    busy time of both policies plus a host cost per step (the calibration's median preparation)."""
    from sim.config import ProfileConfig
    from sim.run import run

    scenario, requests = replay_scenario(ctx, n)
    sim = run(scenario.model_copy(update={"step_time": ProfileConfig(kind="profile", path=str(ctx.profile_path)),
                                          "exact": True, "record_steps": True}), requests=requests)
    per = {}
    for name, r in sim.policies.items():
        busy = r.steps[r.steps.num_seqs > 0]
        per[name] = {"busy_s": float(busy.duration_s.sum()), "num_steps": int(busy.num_steps.sum())}
    total = sum(p["busy_s"] + p["num_steps"] * per_step_s for p in per.values())
    return total, per


def run_replay(ctx: "Check") -> dict:
    from gpu.executor import step_log_summary
    from gpu.replay import replay

    s = ctx.s
    left = ctx.deadline - time.perf_counter()
    sizing: dict = {"seconds_available": left}
    n = s["max_requests"]
    cal = ctx.fig.get("calibration") or {}
    if ctx.profile_path is not None and ctx.profile_path.exists():
        steps = cal.get("steps") or {}
        preps = [v["median_prep_s"] for v in steps.values()]
        per_step = (max(preps) if preps else 0.0) + 5e-4  # host preparation + the engine's own bookkeeping
        tried = []
        while True:
            total, per = predict_replay_s(ctx, n, per_step)
            tried.append({"num_requests": n, "predicted_s": total, "policies": per})
            if total <= 0.6 * left or n <= s["min_requests"]:
                break
            n = max(s["min_requests"], n // 2)
        sizing.update(rule="the most requests (halving from max_requests) whose replay the profile predicts "
                           "within 60 % of the time left", per_step_host_s=per_step, tried=tried)
    else:
        n = s["min_requests"]
        sizing["rule"] = "no calibrated profile (calibration failed): the minimum number of requests"
    scenario, requests = replay_scenario(ctx, n)
    sizing["num_requests"] = n
    ctx.replay_inputs = (scenario, requests)
    t0 = time.perf_counter()
    rep, executors = replay(scenario, str(ctx.device), requests=requests, attention=ctx.attention)
    wall = time.perf_counter() - t0
    ctx.replay_result = rep
    replayed = {name: {k: r.summary.get(k) for k in ("request_throughput", "output_throughput", "median_ttft_ms",
                                                     "median_tpot_ms", "num_finished", "num_preemptions",
                                                     "kv_capacity_tokens", "memory.token_states")}
                for name, r in rep.policies.items()}
    thr = {k: v["request_throughput"] for k, v in replayed.items()}
    return {"requests": {"source": ctx.slice_source, "num_requests": len(requests)}, "sizing": sizing,
            "pool_sizing": pool_sizing(ctx, scenario, requests), "attention": ctx.attention,
            "policies": replayed,
            "steps": {name: step_log_summary(ex.step_log) for name, ex in executors.executors.items()},
            "decode_graphs": {name: getattr(ex, "graph_info", None) or (ex.graphs.info() if ex.graphs else None)
                              for name, ex in executors.executors.items()},
            "vllm_over_orca_max_throughput": thr["vllm"] / thr["orca-max"] if thr.get("orca-max") else None,
            "wall_s": wall,
            "predicted_s": sizing["tried"][-1]["predicted_s"] if sizing.get("tried") else None}


def run_validation(ctx: "Check") -> dict:
    from gpu.validate import compare, write_validation
    from sim.config import ProfileConfig
    from sim.run import run
    from sim.steptime import load_profile

    need = [name for name, ok in (("calibration", ctx.profile_path is not None), ("replay", ctx.replay_result))
            if not ok]
    if need:
        raise RuntimeError(f"validation compares the calibrated simulation with the replay: no result from "
                           f"{' and '.join(need)} (see its section)")
    scenario, requests = ctx.replay_inputs
    profile = load_profile(ctx.profile_path, scenario.model_spec())
    sim = run(scenario.model_copy(update={"step_time": ProfileConfig(kind="profile", path=str(ctx.profile_path)),
                                          "exact": True}), requests=requests)
    policies, table = compare(sim, ctx.replay_result, profile)
    result = {"scenario": scenario.name, "requests": {"source": requests.source, "num_requests": len(requests)},
              "profile": str(ctx.profile_path), "policies": policies}
    write_validation(ctx.work / "validation", result, table, sim, ctx.replay_result, report=False)
    return {"policies": {n: {"metrics": {m: v["relative_error"] for m, v in p["metrics"].items()},
                             "step_time_mape": p["step_time"]["mape"], "identical_schedule": p["identical_schedule"]}
                         for n, p in policies.items()},
            "validation_json": str(ctx.work / "validation" / "validation.json")}


RUNNERS = {"kernels": run_kernels, "bandwidth": run_bandwidth, "calibration": run_calibration,
           "replay": run_replay, "validation": run_validation}


def bundle_source() -> dict | None:
    """The commit (and files changed since it) that ``gpu/device_bundle.py`` recorded in the bundle's
    MANIFEST.json when it was prepared; None without a bundle."""
    try:
        return json.loads((ROOT / Path(BUNDLE_TRACE).parent / "MANIFEST.json").read_text()).get("source")
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------------------------------ targets


def targets(fig: dict) -> list[dict]:
    """The issue's targets with the measured figure each is judged on (None where not measured)."""
    bw = fig.get("bandwidth") or {}
    dec = {(r["batch"], r["context"], r["layout"]): r for r in bw.get("decode_attention", [])
           if "time_s" in r and r.get("variant", r["layout"]) == r["layout"]}  # the default launch's rows
    at = dec.get((64, 4096, "paged"))
    matched = bw.get("matched_overhead") or {}
    rep = fig.get("replay") or {}
    val = (fig.get("validation") or {}).get("policies", {})

    def worst(metric: str):
        v = [abs(p["metrics"][metric]) for p in val.values() if p["metrics"].get(metric) is not None]
        return max(v) if v else None

    rows = [
        ("decode attention >= 80% of copy bandwidth at 64 x 4k (paged)", 0.8, at and at["fraction_of_copy"], ">="),
        ("paging overhead <= 5% at 64 x 4k (default launch)", 1.05, at and at["paging_overhead"], "<="),
        ("paging overhead <= 5% at 64 x 4k (best paged over best contiguous)", 1.05,
         matched.get("best_paged_over_best_contiguous"), "<="),
        ("replayed vllm throughput >= 2x orca-max", 2.0, rep.get("vllm_over_orca_max_throughput"), ">="),
        ("calibrated simulation within 5% of replayed throughput", 0.05, worst("request_throughput"), "<="),
        ("calibrated simulation within 10% of replayed median TTFT", 0.10, worst("median_ttft_ms"), "<="),
        ("calibrated simulation within 10% of replayed median TPOT", 0.10, worst("median_tpot_ms"), "<="),
    ]
    return [{"target": name, "bound": bound, "measured": got,
             "met": None if got is None else bool(got >= bound if op == ">=" else got <= bound)}
            for name, bound, got, op in rows]


# ------------------------------------------------------------------------------------------ the run


class Check:
    """State shared by the sections, and the runner that isolates and times them."""

    def __init__(self, device, s: dict, out: Path, work: Path, budget_s: float, inject: set[str],
                 trace: Path | None, trace_places: list[str], quick: bool) -> None:
        self.device, self.s, self.out, self.work, self.quick = device, s, out, work, quick
        self.inject, self.trace, self.trace_places = inject, trace, trace_places
        self.t0 = time.perf_counter()
        self.end = self.t0 + budget_s - RESERVE_S
        self.deadline = self.hard_limit = self.end
        self.attention: str | None = None
        self.profile_path: Path | None = None
        self.replay_result = None
        self.replay_inputs = None
        self.slice_source: str | None = None
        self.fig: dict = {}

    def save(self) -> None:
        self.fig["wall_s"] = time.perf_counter() - self.t0
        write_json(self.out, self.fig)

    def blocked(self, name: str) -> str | None:
        """Why ``name`` cannot run (a missing package or trace), or None."""
        miss = [p for p in NEEDS[name] if p in self.fig["preflight"]["missing_packages"]]
        if miss:
            return (f"needs {', '.join(miss)}, not installed here: install the bundle's wheels "
                    f"(python gpu/device_bundle.py, then the README's device command)")
        if name in ("calibration", "replay", "validation") and self.trace is None:  # validation reads the replay
            return ("the Azure conv trace is in none of " + ", ".join(self.trace_places)
                    + ": give --trace, or carry .device (python gpu/device_bundle.py)")
        return None

    def choose_attention(self) -> None:
        """Triton kernels on a GPU unless a case failed its check, or the kernels the replay runs were not
        all checked (the section failed or was cut short before them): then the PyTorch path, and the
        JSON says why."""
        from gpu.device import default_attention

        k = self.fig["sections"].get("kernels", {})
        kernels = self.fig.get("kernels") or {}
        passed = {(r["kernel"], r.get("layout"), r.get("dtype")) for r in kernels.get("rows", []) if r.get("ok")}
        unchecked = REPLAY_KERNELS - passed
        default = default_attention(self.device)
        if default == "triton" and (kernels.get("num_failed") or unchecked):
            why = (f"{kernels.get('num_failed')} kernel check(s) failed" if kernels.get("num_failed")
                   else f"the kernel checks did not complete ({k.get('status')}): "
                        f"{len(unchecked)} of the replay's kernels unchecked")
            self.attention = "torch"
            self.fig["attention"] = {"backend": "torch", "fallback": True, "reason": why + ": replay and "
                                     "calibration use the PyTorch attention path"}
        else:
            self.attention = default
            self.fig["attention"] = {"backend": default, "fallback": False}

    def section(self, name: str, left: list[str]) -> None:
        from gpu.device import clocks

        now = time.perf_counter()
        weights = sum(WEIGHTS[n] for n in left)
        share = max(0.0, self.end - now) * WEIGHTS[name] / weights
        self.deadline = min(self.end, now + share)
        self.hard_limit = min(self.end, now + GRACE * share)
        rec = self.fig["sections"][name] = {"status": "running", "budget_s": share,
                                            "clocks_before": clocks(self.device)}
        self.save()
        if share < 1.0 and name not in self.inject:
            rec.update(status="not_run", error="the budget is spent (--budget-s)")
            self.save()
            return
        why = self.blocked(name)
        if why is not None:
            rec.update(status="skipped" if self.device.type == "cpu" and "trace" in why else "error", error=why)
            self.fig[name] = None
            print(f"{name}: {rec['status']}: {why}", flush=True)
            self.save()
            return
        use_alarm = hasattr(signal, "setitimer") and name != "kernels"  # kernels: the child has a timeout

        def alarm(_sig, _frame):
            raise BudgetExceeded(f"{name} ran past its hard limit ({GRACE * share:.0f} s)")

        old = signal.signal(signal.SIGALRM, alarm) if use_alarm else None
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, max(0.1, self.hard_limit - time.perf_counter()))
        try:
            if name in self.inject:
                raise InjectedFailure(f"injected failure in {name} (--inject-failure)")
            self.fig[name] = RUNNERS[name](self)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded with its traceback; the next section runs
            partial = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], dict) else None
            # (a section's error carries its partial results after its message; any other, str: an
            # OSError's args[0] is its errno, "IsADirectoryError: 21", without the path)
            rec.update(status="error", error=f"{e.__class__.__name__}: {e.args[0] if partial is not None else e}",
                       traceback=traceback.format_exc())
            self.fig[name] = partial
            if self.device.type == "cuda":
                import torch

                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception as e2:  # noqa: BLE001 - a broken context: say so, later sections will too
                    rec["cuda_after_error"] = f"{e2.__class__.__name__}: {e2}"
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
        rec["wall_s"] = time.perf_counter() - now
        rec["clocks_after"] = clocks(self.device)
        print(f"{name}: {rec['status']} in {rec['wall_s']:.1f} s"
              + (f": {rec['error'].splitlines()[0][:200]}" if rec["status"] != "ok" else ""), flush=True)
        self.save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (a GPU) or cpu (small shapes, Triton interpreter)")
    ap.add_argument("--out", default=None, help="the JSON of figures (default: reports/device_check.json on a GPU, "
                    "runs/device_check_cpu.json on the CPU, so a CPU run leaves the committed GPU record alone)")
    ap.add_argument("--work", default=None, help="folder for the profile and validation runs (default: next to --out)")
    ap.add_argument("--trace", default=None, help=f"the Azure conv CSV (default: {BUNDLE_TRACE}, then shared/{AZURE})")
    ap.add_argument("--layers", type=int, default=None, help="model layers (GPU default 8 of Llama-3-8B's 32)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole check's time, seconds (default 420)")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--inject-failure", action="append", default=[], choices=SECTIONS, metavar="SECTION",
                    help=f"raise at the start of SECTION (repeatable; {', '.join(SECTIONS)})")
    ap.add_argument("--quick", action="store_true", help="CPU only: fewer cases, the smallest replay (the tests)")
    a = ap.parse_args(argv)
    kind = "cpu" if a.device == "cpu" else "cuda"
    if a.quick and kind != "cpu":
        ap.error("--quick is for --device cpu")
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (here and in children)
    sys.path.insert(0, str(ROOT))
    inject = set(a.inject_failure) | {x for x in os.environ.get("KVSIM_INJECT_FAILURE", "").split(",") if x}
    bad = inject - set(SECTIONS)
    if bad:
        ap.error(f"KVSIM_INJECT_FAILURE: unknown section(s) {sorted(bad)}; expected {', '.join(SECTIONS)}")
    # absolute: the replay's scenario is written in ``work`` and reads the profile by this path, which a
    # scenario resolves against its own folder (a relative default sent it to work/work/profile.json)
    # NOTE: checked before anything runs: a bad --out failed only when the figures were written at the end
    # (a folder: IsADirectoryError), after a GPU's whole budget; a budget of 0, nan or inf ran nothing, exit 0
    if not (math.isfinite(a.budget_s) and a.budget_s > 0):
        ap.error(f"--budget-s {a.budget_s}: expected seconds above 0")
    why = azure_trace_problem(Path(a.trace)) if a.trace is not None else None
    if why:
        ap.error(f"--trace {a.trace}: {why}")
    if a.layers is not None:
        from sim.catalog import MODELS, model_from_hf_config

        model = {**SETTINGS[kind], **(QUICK if a.quick else {})}["model"]
        most = (MODELS[model] if model in MODELS else model_from_hf_config(model)).num_layers
        if not 1 <= a.layers <= most:
            ap.error(f"--layers {a.layers}: expected 1 to {most}, the layers of {Path(model).name} to keep")
    out = Path(a.out or ("runs/device_check_cpu.json" if kind == "cpu" else "reports/device_check.json")).absolute()
    work = Path(a.work).absolute() if a.work else out.with_name(out.stem + "_files")
    from sim.config import ScenarioError
    from sim.outputs import out_dir, out_file

    try:  # (the checks sim run makes of its own --out)
        out_file(out, "--out")
        out_dir(work, "--work")
    except ScenarioError as e:
        ap.error(str(e))
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    missing = missing_packages()
    fig: dict = {"preflight": {"missing_packages": missing, "python": sys.version.split()[0],
                               "argv": sys.argv if argv is None else argv}}
    if "torch" in missing or "triton" in missing:
        fig["error"] = f"torch and triton are required: missing {', '.join(p for p in ('torch', 'triton') if p in missing)}"
        write_json(out, fig)
        print(fig["error"], file=sys.stderr)
        return 2

    import torch

    from gpu.device import configure_cpu, provenance, resolve_device

    try:
        device = resolve_device(a.device)
    except Exception as e:  # no CUDA device, or a bad --device: said, and written down, never a traceback
        fig["error"] = str(e)
        write_json(out, fig)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if kind == "cpu":
        configure_cpu(1)
    s = dict(SETTINGS[kind])
    if a.quick:
        s.update(QUICK)
    if a.layers is not None:
        s["layers"] = a.layers
    trace, places = find_trace(a.trace)
    if trace is not None and not trace.exists():
        trace = None
    ctx = Check(device, s, out, work, a.budget_s, inject, trace, places, a.quick)
    ctx.fig = fig
    fig.update(provenance={**provenance(device), "source": bundle_source()}, settings=s, budget_s=a.budget_s,
               trace=str(trace) if trace else None, injected_failures=sorted(inject), sections={})
    if kind == "cuda":
        errors = [f"package {p} is not installed" for p in missing if p != "pynvml"]
        if "pynvml" in missing:
            errors.append("package nvidia-ml-py (pynvml) is not installed: no clocks in the provenance")
        if trace is None:
            errors.append("the Azure conv trace is in none of " + ", ".join(places))
        fig["preflight"]["errors"] = errors
    todo = [n for n in SECTIONS if n not in a.skip]

    def terminated(signum, _frame):  # `timeout` sends SIGTERM: keep what was done, say where it stopped
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        for i, name in enumerate(todo):
            if name == "calibration":
                ctx.choose_attention()
            ctx.section(name, todo[i:])
    except (SystemExit, KeyboardInterrupt) as e:
        for rec in fig["sections"].values():
            if rec.get("status") == "running":
                rec.update(status="terminated", error=f"{e.__class__.__name__} {getattr(e, 'code', '')}".strip())
        fig["targets"] = targets(fig)
        ctx.save()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    fig["targets"] = targets(fig)
    ctx.save()
    k = fig.get("kernels") or {}
    status = {n: fig["sections"][n]["status"] for n in todo}
    print(f"sections: {status}; kernel checks: {k.get('num_cases')} run, {k.get('num_failed')} failed, broken case "
          f"caught: {k.get('broken_case_caught')}; wrote {out} ({fig['wall_s']:.0f} s, torch {torch.__version__})",
          flush=True)
    failed = [n for n, v in status.items() if v == "error"] + (["kernel checks"] if k.get("num_failed") else [])
    if kind == "cuda" and fig["preflight"].get("errors"):
        failed.append("preflight")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
