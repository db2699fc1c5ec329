"""sim replay / calibrate / validate from the command line, on the CPU; and what `sim replay` wrote."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from gpu_helpers import require_backend
from sim.config import load_scenario
from sim.run import run

ROOT = Path(__file__).resolve().parents[1]
TINY_SCENARIO = str(ROOT / "scenarios" / "tiny-cpu.yaml")
runner = CliRunner()


SMALL_REQUESTS = 12


@pytest.fixture(scope="module")
def small_tiny(tmp_path_factory) -> str:
    """scenarios/tiny-cpu.yaml with its first 12 requests: these tests check the commands and what they
    write; the 30 requests of an Azure slice replay, calibrate and validate in tests/test_gpu_pipeline.py."""
    text = Path(TINY_SCENARIO).read_text()
    model = str(ROOT / "gpu" / "configs" / "tiny-llama.json")
    assert "num_requests: 30" in text and "model: ../gpu/configs/tiny-llama.json" in text
    path = tmp_path_factory.mktemp("tiny-scenario") / "tiny-cpu.yaml"
    path.write_text(text.replace("num_requests: 30", f"num_requests: {SMALL_REQUESTS}")
                    .replace("model: ../gpu/configs/tiny-llama.json", f"model: {model}"))
    return str(path)


@pytest.fixture(scope="module")
def tiny_replays(tmp_path_factory, small_tiny) -> dict:
    """``sim replay`` of the small tiny scenario on the CPU, closed loop (``--device cpu``) and open loop
    (``--open-loop``), each run once for this module: the command test checks the commands, the two tests
    after it the files they wrote. ``{mode: (CliRunner result, out dir)}``."""
    require_backend()
    from cli import app

    d = tmp_path_factory.mktemp("tiny-replay")
    runs = {}
    for mode, args in (("closed-loop", ["--device", "cpu"]), ("open-loop", ["--open-loop"])):
        r = runner.invoke(app, ["replay", small_tiny, *args, "--out", str(d / mode), "--no-report"])
        runs[mode] = (r, d / mode)
    return runs


def test_replay_calibrate_validate_commands(tmp_path, tiny_replays, small_tiny):
    require_backend()
    from cli import app

    r, out = tiny_replays["closed-loop"]  # `sim replay TINY --device cpu --out ... --no-report`
    assert r.exit_code == 0, r.output
    assert (out / "summary.json").exists() and "replayed on cpu" in r.output

    r, out = tiny_replays["open-loop"]  # `sim replay TINY --open-loop --out ... --no-report`
    assert r.exit_code == 0, r.output
    info = json.loads((out / "replay.json").read_text())
    assert info["mode"] == "open-loop" and set(info["open_loop"]) == {"orca-max", "vllm"}
    assert "per-step MAPE" in r.output

    prof = tmp_path / "p.json"
    r = runner.invoke(app, ["calibrate", "--scenario", small_tiny, "--quick", "--out", str(prof)])
    assert r.exit_code == 0, r.output
    assert "held-back MAPE" in r.output and json.loads(prof.read_text())["model"]["name"] == "tiny-llama"

    r = runner.invoke(app, ["validate", small_tiny, "--profile", str(prof), "--out", str(tmp_path / "v")])
    assert r.exit_code == 0, r.output
    v = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert set(v["policies"]) == {"orca-max", "vllm"} and "request_throughput" in r.output
    assert (tmp_path / "v" / "validation.parquet").exists() and (tmp_path / "v" / "replay" / "report.html").exists()


def test_closed_loop_replay_writes_the_files_of_sim_run(tiny_replays, small_tiny):
    """What ``replay_to_dir`` (``sim replay TINY --device cpu``, the fixture's) wrote."""
    r, out = tiny_replays["closed-loop"]
    assert r.exit_code == 0, r.output
    for f in ("summary.json", "requests.parquet", "steps.parquet", "replay.json"):
        assert (out / f).is_file(), f
    summary = json.loads((out / "summary.json").read_text())
    sim = run(load_scenario(small_tiny))
    assert set(summary["policies"]) == set(sim.policies)
    for name, m in summary["policies"].items():
        assert m["num_finished"] == m["num_requests"] == SMALL_REQUESTS
        assert m["kv_capacity_tokens"] == sim.policies[name].summary["kv_capacity_tokens"]
        assert m["request_throughput"] > 0
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps[steps.num_steps > 0].num_steps == 1).all()  # measured one at a time, no spans
    info = json.loads((out / "replay.json").read_text())
    assert info["mode"] == "closed-loop" and info["device_type"] == "cpu" and info["attention"] == "torch"


def test_open_loop_replays_the_recorded_plans(tiny_replays):
    """``open_loop`` as ``sim replay TINY --open-loop`` ran it (the fixture): the simulation's
    tables (summary.json, steps.parquet) against the replayed plans (open_loop.parquet)."""
    r, out = tiny_replays["open-loop"]
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())["policies"]
    sim_steps, steps = pd.read_parquet(out / "steps.parquet"), pd.read_parquet(out / "open_loop.parquet")
    assert set(summary) == set(steps.policy.astype(str)) == {"orca-max", "vllm"}
    for name, m in summary.items():
        g, res_steps = steps[steps.policy == name], sim_steps[sim_steps.policy == name]
        assert len(g) == m["num_steps"] > 0
        assert g.predicted_s.sum() == pytest.approx(res_steps.duration_s[res_steps.num_steps > 0].sum(), rel=1e-9)
        assert (g.measured_s > 0).all()
        assert g.num_prefill_tokens.sum() == res_steps.num_prefill_tokens.mul(res_steps.num_steps).sum()


def test_user_errors_exit_2(tmp_path):
    require_backend()
    import torch

    from cli import app

    r = runner.invoke(app, ["calibrate", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "--model or --scenario" in r.output
    r = runner.invoke(app, ["calibrate", "--model", "gpt-9", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "expected one of" in r.output
    # --out the scenario itself: the profile was written over it after the measurements
    scenario = tmp_path / "s.yaml"
    text = Path(TINY_SCENARIO).read_text().replace("../gpu/configs/", f"{ROOT / 'gpu' / 'configs'}/")
    scenario.write_text(text)
    r = runner.invoke(app, ["calibrate", "--scenario", str(scenario), "--quick", "--out", str(scenario)])
    assert r.exit_code == 2 and "the profile is written as JSON; name it *.json" in r.output, r.output
    assert scenario.read_text() == text
    config = tmp_path / "m.json"  # --out the model's config.json: the model was replaced by its profile
    config.write_text((ROOT / "gpu" / "configs" / "tiny-llama.json").read_text())
    r = runner.invoke(app, ["calibrate", "--model", str(config), "--quick", "--out", str(config)])
    assert r.exit_code == 2 and "exists and is not a step-time profile" in r.output, r.output
    assert config.read_text() == (ROOT / "gpu" / "configs" / "tiny-llama.json").read_text()
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["replay", TINY_SCENARIO, "--device", "cuda"])
        assert r.exit_code == 2 and "no CUDA device" in r.output
    r = runner.invoke(app, ["validate", TINY_SCENARIO, "--profile", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "no such step-time profile" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("cluster", ["{replicas: 2}", "{prefill: {replicas: 1}, decode: {replicas: 1}, kv_transfer: nvlink}"])
def test_a_fleet_is_refused_by_the_replay(tmp_path, cluster):
    """Replicas interleave their steps while the replay holds one KV pool at a time: an AttributeError
    ('NoneType' object has no attribute 'swap_out') in the middle of the run before."""
    require_backend()
    from cli import app

    s = tmp_path / "fleet.yaml"
    s.write_text(Path(TINY_SCENARIO).read_text().replace("../gpu/configs/tiny-llama.json",
                                                         str(ROOT / "gpu" / "configs" / "tiny-llama.json"))
                 + f"cluster: {cluster}\n")
    for args in (["replay", str(s), "--device", "cpu", "--no-report"], ["validate", str(s), "--device", "cpu"]):
        r = runner.invoke(app, [*args, "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and "cluster (a fleet of replicas) is simulator-only" in r.output, r.output


def test_triton_attention_on_the_cpu_is_a_user_error(tmp_path, monkeypatch):
    """Without Triton's interpreter (the tests run with it: conftest.py), a RuntimeError traceback from the
    first kernel launch (store_kv) before."""
    require_backend()
    import gpu.executor
    from cli import app

    monkeypatch.setattr(gpu.executor, "interpreting", lambda: False)
    r = runner.invoke(app, ["replay", TINY_SCENARIO, "--device", "cpu", "--attention", "triton",
                            "--out", str(tmp_path / "o"), "--no-report"])
    assert r.exit_code == 2 and "--attention triton on the CPU needs Triton's interpreter" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_what_the_device_cannot_hold_is_refused_before_allocating(tmp_path, monkeypatch):
    """On the CPU the weights and the KV pool are allocated in host memory: opt-13b's 48 GiB of fp32 weights,
    or tiny-llama's pool sized for an H100 (143 GiB), ran the machine out of memory instead of an error.
    Here the host is made to have 64 MiB free: more than tiny-llama's weights (9.3 MiB), less than its pool."""
    require_backend()
    import gpu.device
    from cli import app

    monkeypatch.setattr(gpu.device, "free_memory_bytes", lambda device: 64 << 20)
    model = str(ROOT / "gpu" / "configs" / "tiny-llama.json")
    big = tmp_path / "big.yaml"
    big.write_text(f"name: big\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {{arrival: {{kind: poisson, rate: 5}}, "
                   f"lengths: alpaca, num_requests: 3}}\npolicies: [vllm]\n")
    r = runner.invoke(app, ["replay", str(big), "--device", "cpu", "--out", str(tmp_path / "o1"), "--no-report"])
    assert r.exit_code == 2 and "opt-13b: its random weights in float32: 47.8 GiB, more than the 64.0 MiB free in " \
        "host memory" in r.output.replace("\n", ""), r.output
    r = runner.invoke(app, ["calibrate", "--model", "opt-175b", "--device", "cpu", "--quick",
                            "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "opt-175b: its random weights in float32: 650.3 GiB" in r.output, r.output
    pool = tmp_path / "pool.yaml"
    pool.write_text(big.read_text().replace("model: opt-13b", f"model: {model}").replace("a100-40gb", "h100"))
    r = runner.invoke(app, ["replay", str(pool), "--device", "cpu", "--out", str(tmp_path / "o2"), "--no-report"])
    out = r.output.replace("\n", "")
    assert r.exit_code == 2 and "tiny-llama: the KV pool of 149,907,040 tokens in float32: 143.0 GiB, more than " \
        "the 64.0 MiB free in host memory" in out and "gpu_memory_utilization" in out, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_commands_without_torch_say_how_to_install(tmp_path):
    """No torch: one line naming the missing extra, exit code 2 (sim run keeps working: test_cli)."""
    for cmd in (["replay", TINY_SCENARIO], ["calibrate", "--model", "opt-13b", "--out", str(tmp_path / "p.json")],
                ["validate", TINY_SCENARIO]):
        code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
                f"from cli import app\napp({cmd!r})")
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2, (cmd, p.stderr)
        assert "pip install -e '.[gpu]'" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("model, why", [("deepseek-v3", "layers of kind ['mla'] are simulator-only"),
                                        ("gpt-oss-120b", "mixture-of-experts layers are simulator-only")])
def test_a_simulator_only_model_is_one_line(tmp_path, model, why):
    """A ValueError traceback (exit 1) before."""
    require_backend()
    from cli import app

    r = runner.invoke(app, ["calibrate", "--model", model, "--device", "cpu", "--quick", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output


def test_replay_and_validate_refuse_before_measuring(tmp_path):
    """A replay into a sweep's folder was refused after the whole replay, and a validation wrote beside the
    sweep's files; an fp8 policy was refused by validate after a calibration (its profile left behind)."""
    require_backend()
    from cli import app

    s = tmp_path / "s.yaml"
    text = Path(TINY_SCENARIO).read_text().replace("../gpu/configs/tiny-llama.json",
                                                   str(ROOT / "gpu" / "configs" / "tiny-llama.json"))
    s.write_text(text)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    for command in ("replay", "validate"):
        r = runner.invoke(app, [command, str(s), "--device", "cpu", "--out", str(sweep)])
        assert r.exit_code == 2 and "holds the results of a `sim sweep`" in r.output, r.output
    assert sorted(p.name for p in sweep.iterdir()) == ["sweep.json"]
    s.write_text(text.replace("policies: [", "policies: [{preset: vllm, name: f8, kv_cache_dtype: fp8}, "))
    r = runner.invoke(app, ["validate", str(s), "--device", "cpu", "--quick", "--out", str(tmp_path / "v")])
    assert r.exit_code == 2 and "kv_cache_dtype: fp8 is simulator-only" in r.output, r.output
    assert not (tmp_path / "v").exists()  # no calibration ran
