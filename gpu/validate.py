"""Validation: the calibrated simulation against the replay, on the same requests.

    profile (given, the scenario's, or calibrated now over the scenario's range)
      -> sim run with step_time: {kind: profile}, stepping every iteration     -> <out>/sim/
      -> closed-loop replay on the device                                     -> <out>/replay/
      -> per policy: relative error (simulated - replayed) / replayed of throughput, mean/median/p99
         TTFT and TPOT; the profile's per-step error on the replayed steps (MAPE); and whether both
         runs made the same steps, in which case their per-step memory must be identical
      -> <out>/validation.json and <out>/validation.parquet

``validation.parquet`` (for the report): one row per (policy, metric) with columns ``policy``, ``metric``,
``simulated``, ``replayed``, ``relative_error``; the metric ``step_time`` has the mean predicted and mean
measured step seconds and, as its ``relative_error``, the per-step MAPE.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gpu.calibrate import calibrate, grid_for_scenario
from gpu.device import configure_cpu
from gpu.executor import ReplayExecutors
from gpu.replay import replay, replay_info
from sim.config import ProfileConfig, Scenario, load_scenario
from sim.outputs import ReportWriter, claim
from sim.schema import MEMORY_CLASSES
from sim.run import RunResult, default_out, policy_pool, run, write_results
from sim.steptime import ProfileStepTime, load_profile
from sim.workload import RequestTable, TraceReader, load_requests

METRICS = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")
# What a step did: equal in both runs, step for step, when both made the same schedule.
SHAPE_COLUMNS = ("num_steps", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_sampled",
                 "prefill_attention_pairs", "num_context_tokens", "num_preempted", "num_swap_blocks")
MEMORY_COLUMNS = tuple(f"mem_{c}" for c in MEMORY_CLASSES)


def relative_error(simulated, replayed) -> float | None:
    if simulated is None or replayed is None or replayed == 0:
        return None
    return (simulated - replayed) / replayed


def step_time_error(steps: pd.DataFrame, predictor: ProfileStepTime) -> dict:
    """The profile's prediction of each measured (non-idle) step against its measured time."""
    s = steps[steps.num_steps == 1]
    pred = predictor.predict(s.num_prefill_tokens, s.prefill_attention_pairs, s.num_decode_tokens,
                             s.num_context_tokens, s.num_swap_blocks)
    meas = s.duration_s.to_numpy()
    return {"num_steps": int(len(s)), "mean_predicted_s": float(pred.mean()) if len(s) else None,
            "mean_measured_s": float(meas.mean()) if len(s) else None,
            "mape": float(np.mean(np.abs(pred - meas) / meas)) if len(s) else None}


def same_schedule(sim_steps: pd.DataFrame, replay_steps: pd.DataFrame) -> tuple[bool, float | None]:
    """Whether both runs made the same steps (idle gaps aside) and, if so, the largest difference of
    per-step memory (token slots; 0 up to the rounding of time weighting)."""
    a = sim_steps[sim_steps.num_steps > 0].reset_index(drop=True)
    b = replay_steps[replay_steps.num_steps > 0].reset_index(drop=True)
    if len(a) != len(b) or not a[list(SHAPE_COLUMNS)].equals(b[list(SHAPE_COLUMNS)]):
        return False, None
    if len(a) == 0:
        return True, 0.0
    return True, float(np.abs(a[list(MEMORY_COLUMNS)].to_numpy() - b[list(MEMORY_COLUMNS)].to_numpy()).max())


def compare(sim: RunResult, rep: RunResult, profile: dict) -> tuple[dict, pd.DataFrame]:
    """Per policy: metric errors, per-step error, schedule and memory agreement."""
    policies, rows = {}, []
    for name, r in rep.policies.items():
        s = sim.policies[name]
        metrics = {}
        for m in METRICS:
            a, b = s.summary.get(m), r.summary.get(m)
            metrics[m] = {"simulated": a, "replayed": b, "relative_error": relative_error(a, b)}
            rows.append((name, m, a, b, metrics[m]["relative_error"]))
        st = step_time_error(r.steps, ProfileStepTime.from_profile(profile, r.policy.allocator.kind == "paged"))
        rows.append((name, "step_time", st["mean_predicted_s"], st["mean_measured_s"], st["mape"]))
        identical, mem_diff = same_schedule(s.steps, r.steps)
        policies[name] = {
            "metrics": metrics, "step_time": st, "identical_schedule": identical,
            "memory_max_abs_difference_slots": mem_diff,
            "kv_capacity_tokens": {"simulated": s.summary["kv_capacity_tokens"], "replayed": r.summary["kv_capacity_tokens"]},
            "num_finished": {"simulated": s.summary["num_finished"], "replayed": r.summary["num_finished"]},
            "memory": {c: {"simulated": s.summary[f"memory.{c}"], "replayed": r.summary[f"memory.{c}"]}
                       for c in MEMORY_CLASSES},
        }
    table = pd.DataFrame(rows, columns=["policy", "metric", "simulated", "replayed", "relative_error"])
    return policies, table


def validate(scenario: Scenario, device: str, profile_path: str | Path, *, requests: RequestTable | None = None,
             attention: str | None = None, dtype: torch.dtype | None = None, seed: int = 0):
    """Simulate with the profile and replay on ``device``; returns (validation dict, table, sim, replay)."""
    requests = load_requests(scenario) if requests is None else requests
    profile_path = Path(profile_path).resolve()
    profile = load_profile(profile_path, scenario.model_spec())
    # both runs record every step (the schedules are compared step for step); the simulation takes no spans
    scenario = scenario.model_copy(update={"record_steps": True})
    calibrated = scenario.model_copy(update={"step_time": ProfileConfig(kind="profile", path=str(profile_path)),
                                             "exact": True})
    sim = run(calibrated, requests=requests)
    rep, executors = replay(scenario, device, requests=requests, attention=attention, dtype=dtype, seed=seed)
    policies, table = compare(sim, rep, profile)
    # (what the profile says of itself, where it says it: a profile without provenance or fit prices a run as
    # well, and its absence was a KeyError or TypeError after the whole replay)
    prov = profile.get("provenance") if isinstance(profile.get("provenance"), dict) else {}
    result = {
        "scenario": scenario.name,
        "requests": {"source": requests.source, "num_requests": len(requests)},
        "replay": replay_info(executors, "closed-loop"),
        "profile": {"path": str(profile_path), "device": prov.get("device"), "date": prov.get("date"),
                    "fit": {k: v.get("fit") for k, v in profile["layouts"].items()}},
        "policies": policies,
    }
    return result, table, sim, rep


def _clean(x):
    """JSON without NaN: None for missing figures."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_validation(out: Path, result: dict, table: pd.DataFrame, sim: RunResult, rep: RunResult,
                     report: ReportWriter | None = None) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"validation": out / "validation.json", "table": out / "validation.parquet"}
    paths["validation"].write_text(json.dumps(_clean(result), indent=2))
    table.to_parquet(paths["table"], index=False)
    paths["sim"] = write_results(sim, out / "sim", report=report)["summary"].parent
    paths["replay"] = write_results(rep, out / "replay", report=report)["summary"].parent
    return paths


def validate_to_dir(scenario_path: str | Path, device: str, out_dir: str | Path | None = None, *,
                    profile_path: str | Path | None = None, quick: bool = False, attention: str | None = None,
                    seed: int = 0, cpu_threads: int | None = 1, requests: RequestTable | None = None,
                    read_trace: TraceReader | None = None, report: ReportWriter | None = None
                    ) -> tuple[dict, dict[str, Path]]:
    """``sim validate``: calibrate if no profile is given (nor named by the scenario), then validate
    (``read_trace`` and ``report`` as ``sim.run.run_to_dir`` takes them)."""
    configure_cpu(cpu_threads if str(device) == "cpu" else None)
    scenario = load_scenario(scenario_path)
    requests = load_requests(scenario, read_trace) if requests is None else requests
    out = claim(Path(out_dir) if out_dir is not None else default_out(scenario.name,
                                                                      suffix=f"-validate-{device.split(':')[0]}"),
                "validate", scenario.name, default=out_dir is None)  # (a sweep's folder took validation.json,
    # sim/ and replay/ beside sweep.json)
    ReplayExecutors.check_scenario(scenario)  # before a calibration (an fp8 policy was refused after one)
    if profile_path is None and isinstance(scenario.step_time, ProfileConfig):
        profile_path = scenario.resolve_path(scenario.step_time.path)
    if profile_path is None:
        model, gpu = scenario.model_spec(), scenario.gpu_spec()
        pool_tokens = max(policy_pool(scenario, model, gpu, p).num_slots for p in scenario.policies)
        profile_path = out / "profile.json"
        calibrate(model, device, grid=grid_for_scenario(scenario, requests, pool_tokens, quick), out=profile_path,
                  attention=attention, seed=seed)
    result, table, sim, rep = validate(scenario, device, profile_path, requests=requests, attention=attention, seed=seed)
    paths = write_validation(out, result, table, sim, rep, report=report)
    paths["profile"] = Path(profile_path)
    return result, paths


def print_validation(result: dict, console) -> None:
    """Per policy: simulated vs replayed figures and their relative error."""
    from rich.table import Table
    from rich.text import Text

    def fmt(v, pct=False):
        return "-" if v is None else (f"{v:+.1%}" if pct else f"{v:.4g}")

    for name, p in result["policies"].items():
        t = Table(title=Text(f"{result['scenario']}: {name} (simulated with the profile vs replayed on "
                             f"{result['replay']['device']})"))  # Text: a name is not markup
        for col in ("metric", "simulated", "replayed", "error"):
            t.add_column(col, justify="left" if col == "metric" else "right")
        for m, v in p["metrics"].items():
            t.add_row(m, fmt(v["simulated"]), fmt(v["replayed"]), fmt(v["relative_error"], True))
        st = p["step_time"]
        t.add_row("step time s (MAPE)", fmt(st["mean_predicted_s"]), fmt(st["mean_measured_s"]),
                  "-" if st["mape"] is None else f"{st['mape']:.1%}")
        console.print(t)
        same = "the same steps; per-step memory identical" if p["identical_schedule"] and \
            p["memory_max_abs_difference_slots"] is not None and p["memory_max_abs_difference_slots"] < 1e-6 \
            else "different steps (timing changed the schedule)"
        console.print(f"  {name}: {same}; KV pool {p['kv_capacity_tokens']['replayed']:,} tokens in both",
                      highlight=False, markup=False)
