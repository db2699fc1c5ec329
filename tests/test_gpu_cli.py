"""sim replay / calibrate / validate from the command line, on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpu_helpers import require_backend

ROOT = Path(__file__).resolve().parents[1]
TINY_SCENARIO = str(ROOT / "scenarios" / "tiny-cpu.yaml")
runner = CliRunner()


def test_replay_calibrate_validate_commands(tmp_path, tiny_replays):
    require_backend()
    from cli import app

    r, out = tiny_replays["closed-loop"]  # `sim replay TINY --device cpu --out ... --no-report` (conftest)
    assert r.exit_code == 0, r.output
    assert (out / "summary.json").exists() and "replayed on cpu" in r.output

    r, out = tiny_replays["open-loop"]  # `sim replay TINY --open-loop --out ... --no-report`
    assert r.exit_code == 0, r.output
    info = json.loads((out / "replay.json").read_text())
    assert info["mode"] == "open-loop" and set(info["open_loop"]) == {"orca-max", "vllm"}
    assert "per-step MAPE" in r.output

    prof = tmp_path / "p.json"
    r = runner.invoke(app, ["calibrate", "--scenario", TINY_SCENARIO, "--quick", "--out", str(prof)])
    assert r.exit_code == 0, r.output
    assert "held-back MAPE" in r.output and json.loads(prof.read_text())["model"]["name"] == "tiny-llama"

    r = runner.invoke(app, ["validate", TINY_SCENARIO, "--profile", str(prof), "--out", str(tmp_path / "v")])
    assert r.exit_code == 0, r.output
    v = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert set(v["policies"]) == {"orca-max", "vllm"} and "request_throughput" in r.output
    assert (tmp_path / "v" / "validation.parquet").exists() and (tmp_path / "v" / "replay" / "report.html").exists()


def test_user_errors_exit_2(tmp_path):
    require_backend()
    import torch

    from cli import app

    r = runner.invoke(app, ["calibrate", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "--model or --scenario" in r.output
    r = runner.invoke(app, ["calibrate", "--model", "gpt-9", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "expected one of" in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["replay", TINY_SCENARIO, "--device", "cuda"])
        assert r.exit_code == 2 and "no CUDA device" in r.output
    r = runner.invoke(app, ["validate", TINY_SCENARIO, "--profile", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "no such step-time profile" in r.output and "Traceback" not in r.output


def test_commands_without_torch_say_how_to_install(tmp_path):
    """No torch: one line naming the missing extra, exit code 2 (sim run keeps working: test_cli)."""
    for cmd in (["replay", TINY_SCENARIO], ["calibrate", "--model", "opt-13b", "--out", str(tmp_path / "p.json")],
                ["validate", TINY_SCENARIO]):
        code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
                f"from cli import app\napp({cmd!r})")
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2, (cmd, p.stderr)
        assert "pip install -e '.[gpu]'" in p.stderr and "Traceback" not in p.stderr
