"""The simulator's Python API: ``run(scenario) -> RunResult``, and writing a run's result files.

    from sim import run
    result = run("scenarios/quickstart.yaml")
    result.summary()["policies"]["vllm"]["request_throughput"]

The trace readers and the HTML report are other packages, above this one: a caller passes them in
(``read_trace``, ``report``); the command line and the ``kvsim`` facade (``kvsim.run``, ``kvsim.run_to_dir``)
do.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from sim.catalog import GIB, GpuSpec, ModelSpec
from sim.config import PolicyConfig, ProfileConfig, Scenario, ScenarioError, load_scenario
from sim.engine import Engine, PolicyResult
from sim.kv import KvPool
from sim.outputs import Columns, ReportWriter, concat_columns, write_parquet
from sim.outputs import claim, out_dir as out_dir_checked
from sim.policy import ResolvedPolicy, resolve_policy, token_budget
from sim.schema import MEMORY_CLASSES, RUN_MARK, plural
from sim.steptime import Executor, ProfileStepTime, RooflineStepTime, load_profile
from sim.workload import RequestTable, TraceReader, load_requests

# Builds the executor for one policy's run: the step-time model here; the GPU backend passes its own.
ExecutorFactory = Callable[[Scenario, ModelSpec, GpuSpec, ResolvedPolicy, RequestTable], Executor]


def model_executor(scenario: Scenario, model: ModelSpec, gpu: GpuSpec, policy: ResolvedPolicy,
                   requests: RequestTable) -> Executor:
    """The scenario's step-time model (the simulator's executor): the roofline, or a calibrated profile."""
    paged = policy.paged
    st = scenario.step_time
    if isinstance(st, ProfileConfig):
        if scenario.tensor_parallel != 1:
            raise ScenarioError(f"{scenario.name}: step_time profiles are measured on one GPU; "
                                f"tensor_parallel must be 1, not {scenario.tensor_parallel}")
        prof = load_profile(scenario.resolve_path(st.path), model, gpu.name, policy.policy.kv_cache_dtype)
        return ProfileStepTime.from_profile(prof, paged)
    return RooflineStepTime(model, gpu, scenario.tensor_parallel, st, paged=paged, layout=policy.layout)


@dataclass
class RunResult:
    scenario: Scenario
    model: ModelSpec
    gpu: GpuSpec
    requests: RequestTable
    policies: dict[str, PolicyResult] = field(default_factory=dict)
    decomposition: dict | None = None  # sim.decompose: each policy's difference from the first, knob by knob

    def workload_summary(self) -> dict:
        r = self.requests
        n = len(r)
        span = float(r.arrival_s[-1] - r.arrival_s[0]) if n > 1 else 0.0
        return {
            "source": r.source,
            "num_rows_read": r.num_rows_read,  # = num_requests + the dropped rows
            "num_requests": n,
            "span_s": span,
            "mean_request_rate": (n - 1) / span if span > 0 else None,
            "mean_prompt_tokens": float(r.prompt_tokens.mean()) if n else None,
            "mean_output_tokens": float(r.output_tokens.mean()) if n else None,
            "max_prompt_tokens": int(r.prompt_tokens.max()) if n else None,
            "max_output_tokens": int(r.output_tokens.max()) if n else None,
            "dropped_rows": dict(r.dropped),
            "num_beyond_horizon": r.beyond_horizon,  # not generated; each policy counts them unfinished
            "truncated_requests": dict(r.truncated),
        }

    def summary(self) -> dict:
        """``{"scenario": ..., "policies": {name: {metric: value}}}``, as written to summary.json."""
        s = self.scenario
        m = self.model
        pools = {}
        for name, res in self.policies.items():
            p = res.pool
            pools[name] = {"num_blocks": p.num_blocks, "block_size": p.block_size, "kv_capacity_tokens": p.num_slots,
                           "kv_capacity_gib": p.kv_bytes / GIB, "kv_bytes_per_token": p.kv_bytes_per_token,
                           "weights_gib": p.weights_bytes / GIB, "activation_gib": p.activation_bytes / GIB,
                           "budget_gib": p.budget_bytes / GIB,
                           "max_num_batched_tokens": token_budget(res.policy, m)}
            lay = res.layout
            if lay is not None and not lay.single:  # several KV groups (sim/layouts.py): a slot is one group's token
                pools[name]["kv_groups"] = [{"kind": g.kind, "layers": g.layers, "window": g.window,
                                             "state_pages": g.state_pages} for g in lay.groups]
        scenario = {
            **s.model_dump(mode="json", exclude={"cluster"} if s.cluster is None else None),  # unchanged without a fleet
            "resolved": {
                "model": {"name": m.name, "num_params": m.num_params, "num_layers": m.num_layers,
                          "hidden_size": m.hidden_size, "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads,
                          "max_model_len": m.max_model_len, "kv_bytes_per_token": m.kv_bytes_per_token(1)},
                "gpu": {"name": self.gpu.name, "memory_gib": self.gpu.memory_bytes / GIB,
                        "hbm_gb_per_s": self.gpu.hbm_bytes_per_s / 1e9, "tflops": self.gpu.flops_per_s / 1e12},
                "kv_pools": pools,
                "workload": self.workload_summary(),
            },
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
        }
        out = {"scenario": scenario, "policies": {n: r.summary for n, r in self.policies.items()}}
        if self.decomposition is not None:
            out["decomposition"] = self.decomposition
        fleet = {n: r.fleet for n, r in self.policies.items() if r.fleet is not None}
        if fleet:
            out["fleet"] = fleet
        return out


def policy_pool(scenario: Scenario, model: ModelSpec, gpu: GpuSpec, policy: PolicyConfig) -> KvPool:
    """The KV pool one policy gets: the same memory for every policy, split into its block size."""
    return resolve_policy(scenario, model, gpu, policy).pool


def run(scenario: Scenario | str | Path, *, progress: Callable[[str, int, int], None] | None = None,
        executor: ExecutorFactory = model_executor, requests: RequestTable | None = None,
        decompose: bool = False, read_trace: TraceReader | None = None) -> RunResult:
    """Simulate every policy of the scenario on the same requests (``requests``, else the scenario's
    workload, a trace read by ``read_trace``); with ``decompose``, also the knob-by-knob decomposition of
    each policy's difference from the first (``sim.decompose``), which runs the intermediate policies it
    needs (``sim run`` asks for it unless the scenario says ``decompose: false``; the Python API, sweeps
    and the GPU replay do not)."""
    # (the Python API's mistakes, named: a dict went to pathlib, a list of requests failed deep in the engine)
    if not isinstance(scenario, (Scenario, str, Path)):
        raise TypeError(f"run: scenario is a {type(scenario).__name__}; expected a Scenario (sim.config."
                        "parse_scenario makes one from a mapping) or a scenario file's path")
    if requests is not None and not isinstance(requests, RequestTable):
        raise TypeError(f"run: requests is a {type(requests).__name__}; expected a sim.workload.RequestTable "
                        "(kvsim.load_requests gives a scenario's)")
    for name, fn, what in (("progress", progress, "(policy, done, total)"),
                           ("read_trace", read_trace, "(workload, path, max_model_len)"),
                           ("executor", executor, "(scenario, model, gpu, policy, requests)")):
        if fn is not None and not callable(fn):  # (an int was "'int' object is not callable", deep inside)
            raise TypeError(f"run: {name} is a {type(fn).__name__}; expected a function {what}")
    if not isinstance(decompose, bool):
        raise TypeError(f"run: decompose is a {type(decompose).__name__}; expected true or false")
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    model = scenario.model_spec()
    gpu = scenario.gpu_spec()
    if requests is None:
        requests = load_requests(scenario, read_trace)
    if len(requests) == 0:
        raise ScenarioError(f"{scenario.name}: the workload has no requests")
    result = RunResult(scenario, model, gpu, requests)
    resolve_all(scenario, model, gpu)  # every policy runnable, before any runs

    runs = [(p, None) for p in scenario.policies]
    if scenario.cluster is not None:  # a fleet: replicas behind a router (sim.cluster)
        from sim.cluster import fleet_runs, run_fleet
        from sim.cluster.router import check_routers

        check_routers(scenario.cluster.routers, requests)
        runs = fleet_runs(scenario)

    def one(policy: PolicyConfig, record_steps: bool, router: str | None = None) -> PolicyResult:
        if scenario.cluster is not None:
            if progress:
                progress(policy.name, 0, len(requests))
            res = run_fleet(scenario, model, policy, router or scenario.cluster.routers[0], requests, executor,
                            record_steps)
            if progress:
                progress(policy.name, len(requests), len(requests))
            return res
        resolved = resolve_policy(scenario, model, gpu, policy)
        cb = (lambda done, total, _n=policy.name: progress(_n, done, total)) if progress else None
        engine = Engine(requests, resolved, executor(scenario, model, gpu, resolved, requests),
                        horizon_s=scenario.horizon_s, exact=scenario.exact, record_steps=record_steps,
                        timeline_bin_s=scenario.timeline_bin_s, sampling=scenario.sampling, progress=cb,
                        startup_s=scenario.startup_s)
        if progress:  # a first call when the policy starts, a last one (done == total) when it ends
            progress(policy.name, 0, len(requests))
        res = engine.run()
        if progress:  # NOTE: the engine reports every 512 loops only; rejected and unfinished requests are settled
            progress(policy.name, len(requests), len(requests))
        return res

    for policy, router in runs:
        result.policies[policy.name] = one(policy, scenario.record_steps, router)
    if decompose and len(scenario.policies) > 1 and len(runs) == len(scenario.policies):
        from sim.decompose import decompose as decompose_policies  # (imported only when asked for)

        result.decomposition = decompose_policies(
            scenario.policies, {n: r.summary for n, r in result.policies.items()},
            lambda policy: one(policy, record_steps=False).summary)
    return result


def write_results(result: RunResult, out_dir: str | Path, report: ReportWriter | None = None) -> dict[str, Path]:
    """summary.json, requests.parquet and steps.parquet (all policies, a ``policy`` column); report.html
    by ``report`` (``reports.html.write_report``; ``kvsim.write_results`` passes it) when given."""
    if not isinstance(result, RunResult):
        raise TypeError(f"write_results: result is a {type(result).__name__}; expected what run returns (a RunResult)")
    out = claim(out_dir_checked(out_dir, "out_dir"), "run", result.scenario.name)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / RUN_MARK, "requests": out / "requests.parquet", "steps": out / "steps.parquet",
             "snapshots": out / "kv_snapshots.parquet", "timeline": out / "timeline.parquet"}
    # NOTE: a folder reused for another run keeps none of the old run's files (a table this run does not
    # write, or a stale report, would be read as this run's)
    groups = {name: res.table("groups") for name, res in result.policies.items() if res.table("groups") is not None}
    if groups:  # several KV groups (sim/hybrid.py): slots per group class over time
        paths["groups"] = out / "kv_groups.parquet"
    for p in [*paths.values(), out / "replicas.parquet", out / "kv_groups.parquet", out / "report.html"]:
        p.unlink(missing_ok=True)
    paths["summary"].write_text(json.dumps(result.summary(), indent=2))
    tables: dict[str, dict] = {"requests": {}, "steps": {}, "snapshots": {}, "timeline": {}, "replicas": {}}
    for name, res in result.policies.items():
        for key in ("timeline", "requests", "steps"):
            tables[key][name] = res.table(key)
        if res.replicas is not None:  # a fleet's (sim.cluster)
            tables["replicas"][name] = res.replicas
        snap = res.snapshot
        if snap is not None:
            seg = snap["segments"]
            n = len(seg)
            tables["snapshots"][name] = Columns({
                "time_s": np.full(n, snap["time_s"], dtype=np.float64),
                "num_waiting": np.full(n, snap["num_waiting"], dtype=np.int64),
                "num_running": np.full(n, snap["num_running"], dtype=np.int64), "start": seg[:, 0],
                "length": seg[:, 1], "memory_class": seg[:, 2],
                **({"replica": np.full(n, snap["replica"], dtype=np.int16)} if "replica" in snap else {})},
                {"memory_class": list(MEMORY_CLASSES)})
    if groups:
        tables["groups"] = groups
    for key, by_policy in tables.items():
        if not by_policy:
            continue
        paths.setdefault(key, out / f"{key}.parquet")
        codes, names = _policy_codes(by_policy)
        parts = list(by_policy.values())
        if all(isinstance(t, Columns) for t in parts):  # written by pyarrow alone: no pandas imported
            write_parquet(concat_columns(parts, "policy", codes, names, first=key == "snapshots"), paths[key])
            continue
        import pandas as pd

        df = pd.concat([t.frame() if isinstance(t, Columns) else t for t in parts], ignore_index=True)
        df.insert(0 if key == "snapshots" else len(df.columns), "policy",
                  pd.Categorical.from_codes(codes, pd.Index(names, dtype="str")))
        write_parquet(df, paths[key])
    if report:
        paths["report"] = report(out)
    return paths


def _policy_codes(by_policy: dict) -> tuple[np.ndarray, list[str]]:
    """The ``policy`` column of the policies' tables laid end to end, as codes and categories (the names
    with rows, sorted, as ``astype("category")`` of the names would give them)."""
    lengths = [len(t) for t in by_policy.values()]
    names = sorted(n for n, k in zip(by_policy, lengths) if k)
    code = {n: i for i, n in enumerate(names)}
    return np.repeat([code.get(n, -1) for n in by_policy], lengths).astype(np.int64), names


def run_to_dir(scenario_path: str | Path, out_dir: str | Path | None = None, *, exact: bool = False,
               report: ReportWriter | None = None, read_trace: TraceReader | None = None,
               console=None) -> tuple[dict, dict[str, Path]]:
    """``sim run``: load, simulate with a progress bar, write the result files (and the report, by
    ``report``); returns (summary, paths)."""
    scenario = load_scenario(scenario_path)
    if exact:
        scenario = scenario.model_copy(update={"exact": True})
    # (checked, not Path(out_dir): an empty path was the current folder, which the results were written into)
    out = claim(out_dir_checked(out_dir, "out_dir") if out_dir is not None else default_out(scenario.name), "run",
                scenario.name, default=out_dir is None)
    from rich.console import Console

    console = console or Console(stderr=True)
    live = console.is_terminal
    if live:  # NOTE: imported only for a terminal (a bar): 14 ms of a run's start otherwise
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bars = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                        TextColumn("{task.completed:,}/{task.total:,} requests"), TimeElapsedColumn(), console=console)
    else:
        bars = nullcontext()
    with bars as bar:
        tasks: dict[str, int] = {}
        started: dict[str, float] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total) if live else 0
                started[name] = time.perf_counter()
            if live:
                bar.update(tasks[name], completed=done)
            if done == total and name in started:  # the last call: the bar at 100 %, its clock stopped
                wall = time.perf_counter() - started.pop(name)
                if live:
                    bar.stop_task(tasks[name])
                else:  # no bar outside a terminal: one line per finished policy
                    console.print(f"{name}: {plural(total, 'request')} simulated in {wall:,.1f} s "
                                  f"({total / max(wall, 1e-9):,.0f} requests/s)", highlight=False, markup=False)

        try:
            result = run(scenario, progress=progress, decompose=scenario.decompose, read_trace=read_trace)
        except ScenarioError as e:
            raise ScenarioError(in_file(str(e), scenario_path, scenario.name)) from None
    paths = write_results(result, out, report=report)
    return result.summary(), paths


def in_file(message: str, path: str | Path, name: str) -> str:
    """A check's message after the file was read (a policy a GPU cannot run, a trace's problem) as one
    naming the scenario's file, like the file's own mistakes: ``s.yaml: policy vllm: ...``."""
    p = str(path)
    if message.startswith(p):
        return message
    if message.startswith(f"{name}: "):
        message = message[len(name) + 2:]
    return f"{p}: {message}"


SLUG_BYTES = 100  # a folder name's UTF-8 bytes at most (file systems allow 255; replay adds "-open-loop-cuda")


def default_out(name: str, kind: str = "run", suffix: str = "") -> Path:
    """Where a command writes when no ``--out`` is given: ``runs/<slug of name><suffix>`` (``kind``: the
    folder name of a name that leaves nothing)."""
    return Path("runs") / f"{slug(name, kind)}{suffix}"


def slug(name: str, default: str = "run") -> str:
    """A name made safe as a folder name (``runs/<slug>``): letters, digits, ``-_.``; ``default`` if nothing
    is left. A longer one is cut to ``SLUG_BYTES`` bytes of UTF-8, ending in a hash of the whole name (names
    that share their first 90 bytes stay apart)."""
    s = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    if len(s.encode()) > SLUG_BYTES:
        tag = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        head = s.encode()[:SLUG_BYTES - len(tag) - 1].decode("utf-8", "ignore").rstrip("-.")
        s = f"{head}-{tag}"
    return s or default


def resolve_all(scenario: Scenario, model: ModelSpec, gpu: GpuSpec) -> list[tuple[Scenario, PolicyConfig, ResolvedPolicy]]:
    """Every policy as the run resolves it, on every kind of server the scenario has: (its scenario, the
    policy, resolved), the lone server's; or each pool's of a disaggregated fleet (prefill, then decode); or
    each replica group's, in order. A policy a server cannot run is an error here, before anything is simulated (a
    run used to simulate the policies before it, then stop)."""
    if scenario.cluster is None:
        return [(scenario, policy, resolve_policy(scenario, model, gpu, policy)) for policy in scenario.policies]
    if scenario.cluster.disaggregated:
        from sim.cluster.disagg import pool_policy, pool_scenarios

        return [(sc, policy, pool_policy(name, sc, model, policy)) for name, _, sc in pool_scenarios(scenario)
                for policy in scenario.policies]
    from sim.cluster.fleet import replica_policy, replica_scenarios

    return [(sc, policy, replica_policy(scenario, gi, sc, model, policy))
            for gi, sc in dict(replica_scenarios(scenario)).items() for policy in scenario.policies]


def check_scenario(scenario_path: str | Path, read_trace: TraceReader | None = None) -> list[str]:
    """``sim check``: validate everything a run would need, without simulating (a sweep or plan file: every
    point or configuration, as ``sim sweep`` and ``sim plan`` do before they run)."""
    from sim.config import file_kind, read_yaml
    from sim.userfile import user_path

    kind = file_kind(read_yaml(user_path(scenario_path, "scenario file", ScenarioError))[0])
    if kind in ("sweep", "plan"):  # each distinct scenario it runs, as a scenario file's (model fit, trace, ...)
        if kind == "sweep":
            from sim.sweep.spec import load_sweep

            sweep = load_sweep(scenario_path)
            runs = [(f"point {p.index}", p.scenario) for p in sweep.points]
            what = f"a sweep: {plural(len(sweep.points), 'point')}"
        else:
            from sim.plan import load_plan

            plan = load_plan(scenario_path)
            first = plan.rate_values[0]
            runs = [(f"shape {s.label}", plan.scenario(first, s, s.counts(plan.spec)[0])) for s in plan.shapes]
            what = f"a plan: {plural(len(plan.shapes), 'shape')}, {plural(len(plan.rate_values), 'rate')}"
        seen = set()
        for where, sc in runs:
            key = sc.model_dump_json()
            if key not in seen:
                seen.add(key)
                try:
                    _check(sc, scenario_path, read_trace)
                except ScenarioError as e:
                    raise ScenarioError(f"{scenario_path}: {where}: {str(e).removeprefix(f'{scenario_path}: ')}") \
                        from None
        return [f"{scenario_path}: ok ({what}; {plural(len(seen), 'scenario')} checked)"]
    scenario = load_scenario(scenario_path)
    try:
        return _check(scenario, scenario_path, read_trace)
    except ScenarioError as e:
        raise ScenarioError(in_file(str(e), scenario_path, scenario.name)) from None


def _length_pairs(requests: RequestTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (prompt, output) lengths of ``requests`` and how many requests have each: what decides a
    rejection up front, for far fewer rows than requests (a contiguous policy's check is Python per row)."""
    pairs = np.asarray(requests.prompt_tokens, np.int64) << 32 | np.asarray(requests.output_tokens, np.int64)
    uniq, counts = np.unique(pairs, return_counts=True)
    return uniq >> 32, uniq & 0xFFFFFFFF, counts


def _rejected_up_front(r: ResolvedPolicy, lengths: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[int, str] | None:
    """The requests ``r`` rejects before serving any (``rejection_reasons``, as the engine does), of the
    ``_length_pairs``: how many, and by reason in words; None when none. (A token budget below every prompt, or a watermark that leaves no room, rejects every
    request: the run counts them, and sim check says so before it.)"""
    from sim.policy import make_kv, rejection_reasons
    from sim.schema import EXCEEDS_KV_POOL, EXCEEDS_MAX_MODEL_LEN, PREFILL_EXCEEDS_TOKEN_BUDGET

    prompt, output, weight = lengths
    reason = rejection_reasons(r, make_kv(r), prompt, output)
    counts = np.bincount(reason, weights=weight, minlength=PREFILL_EXCEEDS_TOKEN_BUDGET + 1).astype(np.int64)
    why = {EXCEEDS_MAX_MODEL_LEN: f"longer than the model's {r.max_model_len:,} tokens",
           EXCEEDS_KV_POOL: "that never fit the KV pool, even alone",
           PREFILL_EXCEEDS_TOKEN_BUDGET: f"with a prefill over max_num_batched_tokens ({r.max_num_batched_tokens:,})"}
    total = int(counts[1:].sum())
    return (total, ", ".join(f"{counts[k]:,} {text}" for k, text in why.items() if counts[k])) if total else None


def _slabs(r: ResolvedPolicy) -> str | None:
    """A contiguous policy that reserves the maximum length: how many requests its pool holds at once, and how
    near the pool sits to one slab more or less (a whole slab of concurrency turns on a fraction of a GiB:
    README, KV memory model); None for other policies (their slabs vary by request). The slab is the
    manager's own (``slab_for``: over every KV group of a hybrid model), a buddy allocator's rounded up to a
    power of two; the aligned roots hold ``capacity // slab`` of them, as first fit does (a test counts
    them by allocating). A request of several samples or beams reserves one slab per sequence."""
    from sim.core import Sequence
    from sim.policy import make_kv

    a = r.policy.allocator
    if a.kind != "contiguous" or a.reserve != "max":
        return None
    kv = make_kv(r)
    slab = kv.slab_for(Sequence(0, 0.0, 1, 1))  # (reserving the maximum: the same for every request)
    rounded = getattr(kv.allocator, "rounded", None)  # (a buddy allocator's)
    unit = rounded(slab) if rounded is not None else slab
    capacity = r.pool.num_slots
    n = capacity // unit
    gib = r.pool.kv_bytes / capacity / GIB if capacity else 0.0
    over, short = capacity - n * unit, (n + 1) * unit - capacity
    each = f", {r.width} per request" if r.width > 1 else ""
    cap = r.policy.max_num_seqs
    capped = f"; max_num_seqs caps it at {cap:,}" if cap is not None and cap * r.width < n else ""
    return (f"    holds {plural(n // r.width, 'request')} at once ({plural(n, 'slab')} of {unit:,} tokens{each}): "
            f"{over:,} tokens ({over * gib:.2f} GiB) above {n:,} slabs, {short:,} ({short * gib:.2f} GiB) short of "
            f"{n + 1:,}{capped}")


def _check(scenario: Scenario, scenario_path: str | Path, read_trace: TraceReader | None) -> list[str]:
    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    requests = load_requests(scenario, read_trace)
    if len(requests) == 0:
        raise ScenarioError(f"{scenario_path}: the workload has no requests")
    lines = [f"{scenario_path}: ok", f"model {model.name} on {scenario.tensor_parallel} x {gpu.name}; "
             f"{plural(len(requests), 'request')} from {requests.source}"]
    for what, counts in (("dropped rows", requests.dropped), ("truncated", requests.truncated)):
        if any(counts.values()):
            lines.append(f"  {what}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    if scenario.cluster is not None:
        from sim.cluster.router import check_routers

        try:
            check_routers(scenario.cluster.routers, requests)
        except ScenarioError as e:
            raise ScenarioError(f"{scenario_path}: {e}") from None
    resolved = {}
    disaggregated = scenario.cluster is not None and scenario.cluster.disaggregated
    for sc, policy, r in resolve_all(scenario, model, gpu):  # the step-time model as a run builds it (a profile
        model_executor(sc, model, sc.gpu_spec(), r, requests)  # file is read here)
        if disaggregated or policy.name not in resolved:  # printed: the server's, a decode replica's, the first
            resolved[policy.name] = r  # replica's
    pools = {name: r.pool for name, r in resolved.items()}

    def kv(pool: KvPool) -> str:
        return f"{pool.num_slots:,} tokens ({pool.kv_bytes / GIB:.2f} GiB), {pool.num_blocks:,} blocks of {pool.block_size}"

    if scenario.cluster is not None and scenario.cluster.disaggregated:  # the pools in one line
        from sim.cluster.disagg import pool_scenarios

        c = scenario.cluster
        parts = [f"{n}: {plural(cfg.replicas, 'replica')} of {sc.tensor_parallel} x {sc.gpu_spec().name}"
                 for n, cfg, sc in pool_scenarios(scenario)]
        lines.append(f"fleet, disaggregated: {'; '.join(parts)}; KV transfer {c.link.name} "
                     f"{c.link.bytes_per_s / 1e9:g} GB/s + {c.link.latency_s * 1e3:g} ms; "
                     f"router {', '.join(c.routers)}")
    elif scenario.cluster is not None:  # the fleet in one line
        kinds = ", ".join(f"{plural(g.count, 'replica')} of {g.tensor_parallel or scenario.tensor_parallel} x "
                          f"{(g.gpu if isinstance(g.gpu, str) else g.gpu.name) if g.gpu else gpu.name}"
                          for g in scenario.cluster.groups)
        lines.append(f"fleet: {kinds}; router {', '.join(scenario.cluster.routers)}")
    whose = "" if scenario.cluster is None else " (a decode replica's)" if disaggregated else " (the first replica's)"
    same = len({kv(p) for p in pools.values()}) == 1  # one KV line for all: the policy lines stay short
    if same:
        lines.append(f"KV pool{whose}: {kv(next(iter(pools.values())))}, for every policy")
    lines.append("policies:")
    lengths = _length_pairs(requests) if scenario.cluster is None else None
    for policy in scenario.policies:
        lines.append(f"  {policy.name}: {policy.batching} batching, {policy.allocator.kind} allocator")
        if not same:
            lines.append(f"    KV pool{whose} {kv(pools[policy.name])}")
        slabs = _slabs(resolved[policy.name])
        if slabs:
            lines.append(slabs)
        rejected = _rejected_up_front(resolved[policy.name], lengths) if lengths is not None else None
        if rejected:
            lines.append(f"    rejected before any step: {rejected[0]:,} of {plural(len(requests), 'request')} "
                         f"({rejected[1]})")
        lay = resolved[policy.name].layout
        if lay is not None and not lay.single:
            kinds: dict[str, int] = {}
            for g in lay.groups:
                label = f"{g.kind} {g.window}" if g.window else g.kind
                kinds[label] = kinds.get(label, 0) + 1
            lines.append(f"    KV groups: {', '.join(f'{n} {k}' for k, n in kinds.items())}; a page is "
                         f"{lay.block_size} tokens of {lay.group_size} layers, a token slot one token of one group")
    return lines
