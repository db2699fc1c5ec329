"""Replay a scenario for real, through the simulator's own scheduler and allocator.

closed loop  ``sim.run.run(scenario, executor=ReplayExecutors(device))``: every step the scheduler plans
             runs on the device and the engine clock advances by its measured time, so arrivals meet
             the real system. Writes the same result files as ``sim run`` (the report compares them).
open loop    a simulation records every plan it makes (stepping one at a time); the device then runs
             those plans in order and each step's predicted and measured seconds are kept side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gpu.device import configure_cpu, provenance
from gpu.executor import ReplayExecutors
from sim.catalog import GIB, GpuSpec, ModelSpec
from sim.config import Scenario, load_scenario
from sim.core import StepPlan
from sim.kv import activation_bytes, weights_bytes
from sim.policy import ResolvedPolicy, resolve_policy
from sim.run import RunResult, default_out, model_executor, run, write_results
from sim.outputs import ReportWriter, claim
from sim.workload import RequestTable, TraceReader, load_requests


def replay(scenario: Scenario, device: str, *, requests: RequestTable | None = None, attention: str | None = None,
           dtype: torch.dtype | None = None, seed: int = 0) -> tuple[RunResult, ReplayExecutors]:
    """Closed-loop replay of every policy; returns the results and the executors (generated tokens)."""
    ReplayExecutors.check_scenario(scenario)
    executors = ReplayExecutors(device, dtype=dtype, attention=attention, seed=seed)
    return run(scenario, executor=executors, requests=requests), executors


def replay_info(executors: ReplayExecutors, mode: str) -> dict:
    return {"mode": mode, **provenance(executors.device), "dtype": str(executors.dtype).removeprefix("torch."),
            "attention": executors.attention, "seed": executors.seed}


def memory_gib_for_pool(model: ModelSpec, kv_pool_tokens: int, *, activation_tokens: int = 2048,
                        gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256) -> float:
    """The device memory (GiB, no runtime overhead) whose KV pool, as the simulator sizes it (``kv_pool``,
    one GPU), holds ``kv_pool_tokens`` tokens (rounded down to whole blocks of up to 16): for scenarios that
    want a given memory pressure on a model smaller than a real GPU. The defaults are a scenario's and a
    policy's."""
    need = (weights_bytes(model, 1) + activation_bytes(model, 1, activation_tokens, max_num_seqs)
            + (kv_pool_tokens + 16) * model.kv_bytes_per_token(1))
    return need / gpu_memory_utilization / GIB


# ------------------------------------------------------------------------------------------ open loop


class _Recording:
    """The step-time model, recording each plan it prices (block tables copied: the scheduler's are
    views; several KV groups: the hybrid allocator's per-group tables, in ``extra["group_tables"]``).
    No spans: every step is planned, and so recorded, on its own."""

    def __init__(self, inner, log: list) -> None:
        self.inner = inner
        self.log = log
        self.kv = None

    def bind_kv(self, kv) -> None:
        self.kv = kv

    def step_time_s(self, plan: StepPlan) -> float:
        t = self.inner.step_time_s(plan)
        snap = plan.snapshot()
        if hasattr(self.kv, "group_tables"):
            snap.extra["group_tables"] = self.kv.group_tables(plan.seq_ids)
        self.log.append((snap, t))
        return t

    def decode_span_s(self, plan: StepPlan, k: int) -> None:
        return None


class PlanRecorder:
    """An ``ExecutorFactory`` that prices steps with the scenario's model and keeps every plan, per policy."""

    def __init__(self) -> None:
        self.plans: dict[str, list[tuple[StepPlan, float]]] = {}

    def __call__(self, scenario: Scenario, model: ModelSpec, gpu: GpuSpec, policy: ResolvedPolicy,
                 requests: RequestTable) -> _Recording:
        return _Recording(model_executor(scenario, model, gpu, policy, requests),
                          self.plans.setdefault(policy.name, []))


def replay_plans(scenario: Scenario, plans: dict[str, list[tuple[StepPlan, float]]], requests: RequestTable,
                 executors: ReplayExecutors) -> pd.DataFrame:
    """Run recorded plans on the device in order; one row per step with predicted and measured seconds."""
    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    frames = []
    for policy in scenario.policies:
        steps = plans.get(policy.name, [])
        ex = executors(scenario, model, gpu, resolve_policy(scenario, model, gpu, policy), requests)
        measured = [ex.step_time_s(plan) for plan, _ in steps]
        frames.append(pd.DataFrame({
            "policy": policy.name,
            "step_index": np.arange(len(steps)),
            "num_seqs": [p.num_seqs for p, _ in steps],
            "num_prefill_tokens": [p.num_prefill_tokens for p, _ in steps],
            "prefill_attention_pairs": [p.prefill_attention_pairs for p, _ in steps],
            "num_decode_tokens": [p.num_decode_tokens for p, _ in steps],
            "num_context_tokens": [p.decode_context_tokens for p, _ in steps],
            "num_swap_blocks": [len(p.swap_in) + len(p.swap_out) for p, _ in steps],
            "predicted_s": [t for _, t in steps],
            "measured_s": measured,
        }))
    df = pd.concat(frames, ignore_index=True)
    df["policy"] = df["policy"].astype("category")
    return df


def open_loop(scenario: Scenario, device: str, *, requests: RequestTable | None = None, attention: str | None = None,
              dtype: torch.dtype | None = None, seed: int = 0) -> tuple[RunResult, pd.DataFrame, ReplayExecutors]:
    """Simulate (recording plans), then replay the plans; returns the simulation, the step table, executors."""
    ReplayExecutors.check_scenario(scenario)
    requests = load_requests(scenario) if requests is None else requests
    recorder = PlanRecorder()
    sim = run(scenario, executor=recorder, requests=requests)
    executors = ReplayExecutors(device, dtype=dtype, attention=attention, seed=seed)
    return sim, replay_plans(scenario, recorder.plans, requests, executors), executors


def open_loop_summary(steps: pd.DataFrame) -> dict:
    """Per policy: steps, predicted and measured total seconds, and the per-step MAPE."""
    out = {}
    for name, g in steps.groupby("policy", observed=True):
        err = (g.predicted_s - g.measured_s).abs() / g.measured_s
        out[str(name)] = {"num_steps": int(len(g)), "predicted_s": float(g.predicted_s.sum()),
                          "measured_s": float(g.measured_s.sum()), "step_time_mape": float(err.mean())}
    return out


# ------------------------------------------------------------------------------------------ command


def replay_to_dir(scenario_path: str | Path, device: str, out_dir: str | Path | None = None, *, open_loop_mode: bool = False,
                  attention: str | None = None, seed: int = 0, cpu_threads: int | None = 1,
                  read_trace: TraceReader | None = None, report: ReportWriter | None = None
                  ) -> tuple[dict, dict[str, Path]]:
    """``sim replay``: closed loop (the results of ``sim run``, measured) or open loop (the simulation's
    results plus ``open_loop.parquet``). Both write ``replay.json`` (where and how it ran); ``read_trace``
    and ``report`` as ``sim.run.run_to_dir`` takes them."""
    configure_cpu(cpu_threads if str(device) == "cpu" else None)
    scenario = load_scenario(scenario_path)
    mode = "open-loop" if open_loop_mode else "closed-loop"
    kind = "open-loop" if open_loop_mode else "replay"
    # claimed before the measurements (a sweep's folder was refused after the whole replay); a replay's folder
    # holds a run's files
    out = claim(Path(out_dir) if out_dir is not None else default_out(scenario.name,
                                                                      suffix=f"-{kind}-{device.split(':')[0]}"),
                "run", scenario.name, default=out_dir is None)
    ReplayExecutors.check_scenario(scenario)
    requests = load_requests(scenario, read_trace)
    if open_loop_mode:
        result, steps, executors = open_loop(scenario, device, requests=requests, attention=attention, seed=seed)
    else:
        (result, executors), steps = replay(scenario, device, requests=requests, attention=attention, seed=seed), None
    paths = write_results(result, out, report=report)
    info = replay_info(executors, mode)
    if steps is not None:
        paths["open_loop"] = out / "open_loop.parquet"
        steps.to_parquet(paths["open_loop"], index=False)
        info["open_loop"] = open_loop_summary(steps)
    paths["replay"] = out / "replay.json"
    paths["replay"].write_text(json.dumps(info, indent=2))
    return result.summary(), paths
