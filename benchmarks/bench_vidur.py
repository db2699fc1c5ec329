"""kvsim against Vidur 0.0.26, side by side: whole-command seconds on the same trace, model, GPU and scheduler.

    python benchmarks/bench_vidur.py                       # 3 alternating rounds per side
    python benchmarks/bench_vidur.py --rounds 5 --cold     # also time Vidur's predictor training once
    VIDUR_PYTHON=/path/to/python benchmarks/bench_vidur.py # Vidur installed in another interpreter

Vidur (Agrawal et al., MLSys 2024; ``pip install vidur==0.0.26``, best in its own venv: its pins clash with
kvsim's) is found in this interpreter, else in ``--vidur-python`` / ``$VIDUR_PYTHON``, else in
``../vidur-venv/bin/python`` beside the project; without it, or without the trace or the profiles, the script says why and
exits 0.

Setup. The Azure LLM inference 2023 conversation trace (19,366 requests at their own rate), read and cut
to the model's 4,096 tokens exactly as ``sim run`` does (``cap_lengths: truncate``), so both sides get the
same requests; Vidur gets them as its trace-replay CSV (``Date,Time,PromptTokenCount,CompletionTokenCount``,
scale factors 1). Llama-2-70B, tensor parallel 4 on A100-80GB (DGX all-reduce): the one model of
``../shared/profiles/vidur`` that kvsim's catalog also has (phi-2, CodeLlama-34B and Qwen-72B are not in
it; Llama-2-7B is not profiled there). vLLM's scheduler on both sides (prefill-only steps, paged blocks of
16, recompute preemption), at most 128 sequences and 4,096 tokens per step (Vidur's defaults), 80 % of
GPU memory (Vidur's default). At the trace's own rate this deployment serves about 3 of its 5.5 requests/s,
so a queue builds up: the same overload on both sides. Vidur uses its default predictor (random forest,
grid search, 10-fold CV), its prediction tables sized to this model (4,096 tokens, 128 sequences), not 2 M
tokens. (Its linear-regression predictor cannot be built in 0.0.26: an abstract method is left undefined.)

Profiles. Vidur 0.0.26 downloads its profiling data from Hugging Face datasets; here it reads
``mlp.csv`` and ``all_reduce.csv`` from ``../shared/profiles/vidur`` (or ``--profiles``; Vidur's own
measurements, unchanged) through symlinks in a temporary folder, and tries no download. Those files have no
attention kernel times, and Vidur has no fallback (it needs ``attention.csv`` for prefill, decode and
KV-cache-save attention). The script writes one, at Vidur's profiler's columns, from kvsim's own roofline
attention model (``RooflineStepTime.breakdown``: prefill pairs at 40 % of peak FLOP/s, decode keys at 80 % of
HBM bandwidth): the speed comparison needs Vidur to run, not its attention accuracy, and it keeps both
sides' step times alike.

Runtime fix. Vidur 0.0.26 dies at the first preemption under vLLM: ``Request.restart`` turns the processed
tokens into the new prompt and zeroes ``_num_processed_tokens``, but keeps the per-stage counters
``_num_stage_processed_tokens`` and ``_is_prefill_stage_complete``. The recomputed prefill is then counted
on top of the old count, and ``on_batch_stage_end``'s assertion ``_num_stage_processed_tokens <=
total_tokens`` fails (AssertionError) before the restarted request can finish. The script wraps ``restart``
in Vidur's process (site-packages untouched) to zero both first.

Measurement. Each run is a fresh process (``sim run --no-report``; ``python -m vidur.main``'s ``main``
under the patches), pinned to one core with ``taskset`` when present, kvsim and Vidur alternating; the
figure is the child's CPU time (user + system, children included) and wall time, median over ``--rounds``.
Vidur's first run is timed apart: with an empty predictor cache (``--cache-dir``, default
``~/.cache/kvsim-bench-vidur``, never the repository; ``--cold``: a fresh temporary one) it trains its
random forests (13 grid searches; tens of minutes on one core), else it is one more cached run.
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
DEFAULT_VIDUR_PYTHON = ROOT.parent / "vidur-venv" / "bin" / "python"  # a venv beside the project, like ../shared
PROFILES_ENV = "KVSIM_PROFILES"
DEFAULT_PROFILES = ROOT.parent / "shared" / "profiles" / "vidur"  # beside the project, as traces are
DEFAULT_CACHE = Path.home() / ".cache" / "kvsim-bench-vidur"
TRACE = "azure_2023/AzureLLMInferenceTrace_conv.csv"
VIDUR_DATE = "2023-11-16"  # the trace's day: Vidur's trace replay keeps the rows of one ``Date``

# The comparison's one configuration, both sides. kvsim names first, then Vidur's.
MODEL, VIDUR_MODEL, MODEL_PROFILE = "llama-2-70b", "meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"
GPU, VIDUR_DEVICE, VIDUR_NETWORK = "a100-80gb", "a100", "a100_dgx"
TP = 4
BLOCK_SIZE = 16
MAX_SEQS = 128  # Vidur's vllm batch_size_cap default
MAX_TOKENS = 4096  # Vidur's vllm max_tokens_in_batch default; kvsim's default budget for a 4,096-token model
GPU_MEMORY_UTILIZATION = 0.8  # Vidur's default


# ---------------------------------------------------------------------------------------------- Vidur's side
# Runs in Vidur's interpreter: standard library and vidur only (kvsim's packages may be absent there).

def _patch_vidur(input_files: tuple[str, str, str, str]) -> list:
    """Patch Vidur 0.0.26 in this process: local profile files instead of Hugging Face, and the restart fix.
    Returns a list that will hold the generated requests (to count the finished ones afterwards)."""
    from vidur.entities.request import Request
    from vidur.execution_time_predictor.sklearn_execution_time_predictor import SklearnExecutionTimePredictor
    from vidur.request_generator.base_request_generator import BaseRequestGenerator

    def no_hub(self):
        raise RuntimeError("kvsim bench: predictions are not downloaded")

    SklearnExecutionTimePredictor._load_predictions_from_hf = no_hub
    SklearnExecutionTimePredictor._get_input_files = lambda self: input_files

    restart = Request.restart

    def restart_with_stage_reset(self):
        # NOTE: the fix. restart() resets _num_processed_tokens but not these two, so the re-prefill
        # (all processed tokens as the new prompt) would be added to the old stage count.
        self._num_stage_processed_tokens = 0
        self._is_prefill_stage_complete = False
        restart(self)

    Request.restart = restart_with_stage_reset

    requests: list = []
    generate = BaseRequestGenerator.generate

    def keep(self):
        out = generate(self)
        requests.extend(out)
        return out

    BaseRequestGenerator.generate = keep
    return requests


def vidur_child(input_files: list[str], vidur_args: list[str]) -> None:
    """One Vidur simulation in this process; prints a JSON line with its request counts."""
    requests = _patch_vidur(tuple(input_files))
    from vidur.config import SimulationConfig
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    sys.argv = ["vidur.main", *vidur_args]
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)
    Simulator(config).run()
    print(json.dumps({"requests": len(requests), "finished": sum(r.completed for r in requests),
                      "restarts": sum(r.num_restarts for r in requests)}))


# ---------------------------------------------------------------------------------------------- kvsim's side

def scenario(trace: Path) -> dict:
    """The kvsim scenario of the comparison (one policy: vLLM with Vidur's batch limits)."""
    return {"name": "bench-vidur", "model": MODEL, "gpu": GPU, "tensor_parallel": TP,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "workload": {"kind": "trace", "path": str(trace), "cap_lengths": "truncate"},
            "policies": [{"preset": "vllm", "block_size": BLOCK_SIZE, "max_num_seqs": MAX_SEQS,
                          "max_num_batched_tokens": MAX_TOKENS}],
            "record_steps": False}


def write_vidur_trace(arrival_s, prompt_tokens, output_tokens, path: Path, date: str = VIDUR_DATE) -> None:
    """Requests as Vidur 0.0.26's trace-replay CSV: ``Date`` (one day: Vidur keeps the rows of its
    configured date), ``Time`` (arrival, seconds), ``PromptTokenCount``, ``CompletionTokenCount``."""
    with open(path, "w") as f:
        f.write("Date,Time,PromptTokenCount,CompletionTokenCount\n")
        for a, p, o in zip(arrival_s, prompt_tokens, output_tokens):
            f.write(f"{date},{float(a)!r},{int(p)},{int(o)}\n")


def scenario_requests(spec: dict):
    """The requests ``sim run`` simulates for ``spec`` (trace read, then cut to the model's length)."""
    from sim.config import parse_scenario
    from traces.workload import load_trace

    s = parse_scenario(spec)
    return load_trace(s.workload, s.resolve_path(s.workload.path), s.model_spec().max_model_len)


def write_attention_profile(path: Path) -> None:
    """An ``attention.csv`` in Vidur's profiler's columns (ms per layer), priced by kvsim's roofline
    attention model: prefill chunks over cached tokens, decode batches of equal contexts, KV-cache save."""
    from sim.catalog import resolve_gpu, resolve_model
    from sim.config import RooflineConfig
    from sim.steptime import RooflineStepTime

    m, g, cfg = resolve_model(MODEL), resolve_gpu(GPU), RooflineConfig()
    st = RooflineStepTime(m, g, TP, cfg, paged=True)
    save_ms_per_token = m.kv_bytes_per_token(TP) / m.num_layers / (g.hbm_bytes_per_s * cfg.bandwidth_efficiency) * 1e3

    def attn_ms(n: int, context: int) -> float:
        return st.breakdown(n, context, BLOCK_SIZE)["attention_ms"]

    rows = []
    for chunk in [32, 64, *range(128, MAX_TOKENS + 1, 128)]:  # prefill: Vidur's q chunk over kv cached tokens
        for kv in range(0, m.max_model_len - chunk + 1, 256):
            rows.append((1, chunk, kv, attn_ms(chunk, kv), 0.0, chunk))
    for batch in [1, 2, 4, 8, *range(16, MAX_SEQS + 1, 16)]:  # decode: batch sequences of kv tokens each
        for kv in range(256, m.max_model_len + 1, 256):
            rows.append((batch, 0, kv, 0.0, batch * attn_ms(1, kv - 1), batch))
    head = ("n_embd,n_q_head,n_kv_head,block_size,num_tensor_parallel_workers,batch_size,prefill_chunk_size,"
            "kv_cache_size,time_stats.attn_prefill.median,time_stats.attn_decode.median,"
            "time_stats.attn_kv_cache_save.median")
    with open(path, "w") as f:
        f.write(head + "\n")
        for b, chunk, kv, pre, dec, tokens in rows:
            f.write(f"{m.hidden_size},{m.num_heads},{m.num_kv_heads},{BLOCK_SIZE},{TP},{b},{chunk},{kv},"
                    f"{pre!r},{dec!r},{tokens * save_ms_per_token!r}\n")


# ---------------------------------------------------------------------------------------------- driver

def find_vidur_python(given: str | None) -> tuple[str | None, str]:
    """An interpreter that imports vidur (this one, else ``given`` / $VIDUR_PYTHON, else the default venv),
    or None and why not."""
    import importlib.util

    if importlib.util.find_spec("vidur") is not None:
        return sys.executable, ""
    cand = given or os.environ.get("VIDUR_PYTHON") or (str(DEFAULT_VIDUR_PYTHON) if DEFAULT_VIDUR_PYTHON.exists()
                                                       else None)
    if cand is None:
        return None, (f"vidur is not importable here, and neither --vidur-python, $VIDUR_PYTHON nor "
                      f"{DEFAULT_VIDUR_PYTHON} names an interpreter (pip install vidur==0.0.26 in its own venv)")
    try:
        ok = subprocess.run([cand, "-c", "import vidur"], capture_output=True).returncode == 0
    except OSError:
        ok = False
    return (cand, "") if ok else (None, f"{cand} cannot import vidur (pip install vidur==0.0.26 there)")


def vidur_args(trace_csv: Path, cache_dir: Path, out_dir: Path, profiles: Path) -> list[str]:
    p = "--random_forrest_execution_time_predictor_config_"
    return ["--replica_config_model_name", VIDUR_MODEL, "--replica_config_device", VIDUR_DEVICE,
            "--replica_config_network_device", VIDUR_NETWORK, "--replica_config_tensor_parallel_size", str(TP),
            "--replica_config_num_pipeline_stages", "1", "--cluster_config_num_replicas", "1",
            "--replica_config_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION),
            "--cache_config_block_size", str(BLOCK_SIZE),
            "--replica_scheduler_config_type", "vllm", "--vllm_scheduler_config_batch_size_cap", str(MAX_SEQS),
            "--vllm_scheduler_config_max_tokens_in_batch", str(MAX_TOKENS),
            "--request_generator_config_type", "trace_replay",
            "--trace_request_generator_config_trace_file", str(trace_csv),
            "--trace_request_generator_config_date", VIDUR_DATE,
            "--trace_request_generator_config_max_tokens", str(MAX_TOKENS),
            "--trace_request_generator_config_prefill_scale_factor", "1",
            "--trace_request_generator_config_decode_scale_factor", "1",
            "--trace_request_generator_config_time_scale_factor", "1",
            "--execution_time_predictor_config_type", "random_forrest",
            p + "cache_dir", str(cache_dir),
            # names only (they key Vidur's cache): the files come from _get_input_files
            p + "model_profiling_dataset", f"{profiles}/compute/{VIDUR_DEVICE}/{MODEL_PROFILE}",
            p + "network_profiling_dataset", f"{profiles}/network/{VIDUR_NETWORK}",
            p + "prediction_max_tokens_per_request", str(MAX_TOKENS),
            p + "prediction_max_batch_size", str(MAX_SEQS),
            p + "prediction_max_prefill_chunk_size", str(MAX_TOKENS),
            "--no-metrics_config_write_metrics", "--no-metrics_config_enable_chrome_trace",
            "--no-metrics_config_store_plots", "--metrics_config_output_dir", str(out_dir),
            "--log_level", "warning"]


def timed(cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> dict:
    """Run ``cmd`` pinned to core 0 (when taskset exists); its CPU (children included) and wall seconds."""
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({out.returncode}):\n{out.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "stdout": out.stdout}


def kvsim_run(scenario_file: Path, out: Path) -> dict:
    r = timed([sys.executable, str(ROOT / "cli.py"), "run", str(scenario_file), "--out", str(out), "--no-report"],
              env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r


def kvsim_counts(out: Path) -> dict:
    """Requests finished, rejected, unfinished and preemptions, from the run's summary.json."""
    p = next(iter(json.loads((out / "summary.json").read_text())["policies"].values()))
    return {k: p[f"num_{k}"] for k in ("finished", "rejected", "unfinished", "preemptions")}


def vidur_run(python: str, input_files: list[str], args: list[str], tmp: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    r = timed([python, str(Path(__file__).resolve()), "--vidur-child", json.dumps(input_files), "--", *args],
              env=env, cwd=tmp)
    r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per side (median reported)")
    ap.add_argument("--vidur-python", help="interpreter with vidur 0.0.26 (default $VIDUR_PYTHON, then "
                    f"{DEFAULT_VIDUR_PYTHON})")
    ap.add_argument("--profiles", type=Path, default=Path(os.environ.get(PROFILES_ENV) or DEFAULT_PROFILES),
                    help="Vidur-layout profiles (compute/<gpu>/<org>/<model>/mlp.csv, network/<topology>/"
                    f"all_reduce.csv); default ${PROFILES_ENV}, then {DEFAULT_PROFILES}")
    ap.add_argument("--traces-dir", help="folder holding azure_2023/ (default $KVSIM_TRACES, ../shared/traces)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="Vidur's predictor cache")
    ap.add_argument("--cold", action="store_true", help="time Vidur's predictor training once, in a fresh cache")
    ap.add_argument("--vidur-child", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args()
    if a.vidur_child:
        vidur_child(json.loads(a.vidur_child), rest[1:] if rest[:1] == ["--"] else rest)
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")

    sys.path.insert(0, str(ROOT))
    from sim.trace_paths import locate

    python, why = find_vidur_python(a.vidur_python)
    trace = locate(TRACE, a.traces_dir)
    mlp = a.profiles / "compute" / VIDUR_DEVICE / MODEL_PROFILE / "mlp.csv"
    all_reduce = a.profiles / "network" / VIDUR_NETWORK / "all_reduce.csv"
    if not why and not trace.is_file():
        why = f"trace {trace} not found (sim trace fetch azure-2023-conv, or --traces-dir)"
    if not why and not (mlp.is_file() and all_reduce.is_file()):
        why = f"profiles {mlp} and {all_reduce} not found (--profiles or ${PROFILES_ENV})"
    if why:
        print(f"skipped: {why}")
        return

    import yaml

    with tempfile.TemporaryDirectory(prefix="bench-vidur-") as tmp_name:
        tmp = Path(tmp_name)
        spec = scenario(trace)
        scenario_file = tmp / "scenario.yaml"
        scenario_file.write_text(yaml.safe_dump(spec))
        t = scenario_requests(spec)
        vidur_trace = tmp / "vidur_trace.csv"
        write_vidur_trace(t.arrival_s, t.prompt_tokens, t.output_tokens, vidur_trace)
        profiles = tmp / "profiles"  # Vidur's input files: symlinks to the shared ones, and attention.csv
        profiles.mkdir()
        (profiles / "mlp.csv").symlink_to(mlp.resolve())
        (profiles / "all_reduce.csv").symlink_to(all_reduce.resolve())
        write_attention_profile(profiles / "attention.csv")
        input_files = [str(profiles / n) for n in ("mlp.csv", "attention.csv", "all_reduce.csv", "send_recv.csv")]

        cut = t.truncated
        print(f"{len(t):,} requests of {trace.name} ({cut.get('prompt_tokens', 0):,} prompts and "
              f"{cut.get('output_tokens', 0):,} outputs cut to fit {MAX_TOKENS:,} tokens); {MODEL} TP {TP} on "
              f"{GPU}, vLLM, {MAX_SEQS} seqs, {MAX_TOKENS:,} tokens/step; Vidur at {python}")

        def vidur(cache: Path, tag: str) -> dict:
            out = tmp / f"vidur-{tag}"
            return vidur_run(python, input_files, vidur_args(vidur_trace, cache, out, a.profiles), tmp)

        # The first Vidur run trains its predictors when the cache is empty (--cold: a fresh one); timed apart.
        cache = tmp / "cold-cache" if a.cold else a.cache_dir
        cold = a.cold or not (cache / "predictions").is_dir()
        first = vidur(cache, "first")
        print(f"Vidur first run ({'cache empty: trains its predictors' if cold else 'cache already filled'}): "
              f"cpu {first['cpu_s']:.1f} s, wall {first['wall_s']:.1f} s")

        ks, vs = [], []
        for i in range(a.rounds):
            out = tmp / f"kvsim-{i}"
            k = kvsim_run(scenario_file, out)
            k.update(kvsim_counts(out))
            v = vidur(cache, str(i))
            ks.append(k)
            vs.append(v)
            print(f"  round {i + 1}: kvsim cpu {k['cpu_s']:6.2f} s wall {k['wall_s']:6.2f} s | "
                  f"Vidur cpu {v['cpu_s']:6.2f} s wall {v['wall_s']:6.2f} s")

        def med(rs: list[dict], key: str) -> float:
            return statistics.median(r[key] for r in rs)

        kc, vc = med(ks, "cpu_s"), med(vs, "cpu_s")
        k, v = ks[0], vs[0]
        print(f"kvsim (sim run --no-report): median cpu {kc:.2f} s, wall {med(ks, 'wall_s'):.2f} s; "
              f"{k['finished']:,} of {len(t):,} requests finished, {k['preemptions']:,} preemptions")
        print(f"Vidur (predictors cached):   median cpu {vc:.2f} s, wall {med(vs, 'wall_s'):.2f} s; "
              f"{v['finished']:,} of {v['requests']:,} finished, {v['restarts']:,} restarts (preemptions)")
        if k["finished"] != v["finished"]:
            print(f"  finished counts differ: kvsim rejected {k['rejected']:,} and left {k['unfinished']:,} "
                  "unfinished (its requests.parquet says why); Vidur rejects none and runs all to the end")
        # NOTE: the median of per-round ratios too: on a shared machine the load drifts between rounds
        per_round = statistics.median(vr["cpu_s"] / kr["cpu_s"] for kr, vr in zip(ks, vs))
        print(f"ratio (Vidur / kvsim, CPU): {vc / kc:.1f}x of the medians, {per_round:.1f}x median of rounds")


if __name__ == "__main__":
    main()
