"""The whole pipeline on the CPU with real data: an Azure conv slice replayed by the tiny model,
calibrated and validated; and the device check script with --device cpu. Figures are only checked to
be finite (CPU timings are not the point): benchmarks/bench_gpu_cpu.py prints them."""

import json
import math
import subprocess
import sys
from pathlib import Path

from conftest import shared_trace
from gpu_helpers import require_backend

ROOT = Path(__file__).resolve().parents[1]
AZURE = "azure_2023/AzureLLMInferenceTrace_conv.csv"


def test_azure_slice_replay_calibrate_validate(tmp_path):
    require_backend()
    from gpu.azure import azure_requests
    from gpu.validate import validate_to_dir

    req = azure_requests(shared_trace(AZURE), 30, max_prompt_tokens=256, max_output_tokens=16, time_scale=4.0)
    assert len(req) == 30 and req.prompt_tokens.max() <= 256 and req.arrival_s[0] == 0.0
    result, paths = validate_to_dir(ROOT / "scenarios" / "tiny-cpu.yaml", "cpu", tmp_path, requests=req, quick=True,
                                    report=False)
    assert json.loads(paths["profile"].read_text())["points"]
    for name, p in result["policies"].items():
        assert p["num_finished"] == {"simulated": 30, "replayed": 30}, name
        for metric, v in p["metrics"].items():
            assert v["relative_error"] is not None and math.isfinite(v["relative_error"]), (name, metric)
        assert math.isfinite(p["step_time"]["mape"])
    assert "AzureLLMInferenceTrace_conv.csv[:30]" in result["requests"]["source"]


def test_device_check_runs_on_cpu(tmp_path):
    require_backend()
    out = tmp_path / "check.json"
    p = subprocess.run([sys.executable, str(ROOT / "gpu" / "check.py"), "--device", "cpu", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    fig = json.loads(out.read_text())
    assert fig["provenance"]["device_type"] == "cpu" and fig["provenance"]["triton_interpreter"]
    assert fig["kernels"] and all(k["ok"] for k in fig["kernels"])
    assert {r["layout"] for r in fig["decode_attention"]} == {"paged", "contiguous"}
    assert all(r["gb_per_s"] > 0 and r["paging_overhead"] > 0 for r in fig["decode_attention"])
    assert fig["copy_bandwidth"]["gb_per_s"] > 0
    rv = fig["replay_validation"]
    if "skipped" not in rv:
        assert set(rv["replay"]) == {"vllm", "orca-max"} and rv["vllm_over_orca_max_throughput"] > 0
        assert set(rv["validation"]) == {"vllm", "orca-max"}
    assert len(fig["targets"]) == 6
