"""The whole pipeline on the CPU with real data: an Azure conv slice replayed by the tiny model,
calibrated and validated; and the device check script with --device cpu. What is checked is that each
stage ran on the slice and that the comparison is computed from both sides; the CPU timings themselves
only need to be finite (they are not the point): benchmarks/bench_gpu_cpu.py prints them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
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
    profile = json.loads(paths["profile"].read_text())  # calibrated: both layouts fitted on measured points
    assert profile["points"] and set(profile["layouts"]) == {"paged", "contiguous"}
    for layout in profile["layouts"].values():
        assert layout["fit"]["train"]["num_points"] > 0 and all(c >= 0 for c in layout["coefficients"].values())
    replayed = pd.read_parquet(paths["replay"] / "requests.parquet")  # replayed: the slice as read, all of it
    assert set(replayed.policy) == set(result["policies"])
    for name, rows in replayed.groupby("policy"):
        rows = rows.sort_values("request_id")
        np.testing.assert_array_equal(rows.prompt_tokens, req.prompt_tokens)
        np.testing.assert_array_equal(rows.output_tokens, req.output_tokens)
        np.testing.assert_allclose(rows.arrival_s, req.arrival_s, rtol=1e-12)
        assert (rows.generated_tokens == rows.output_tokens).all(), name
    for name, p in result["policies"].items():  # validated: simulation against replay, same pool
        assert p["num_finished"] == {"simulated": 30, "replayed": 30}, name
        assert p["kv_capacity_tokens"]["simulated"] == p["kv_capacity_tokens"]["replayed"] > 0, name
        for metric, v in p["metrics"].items():
            assert v["relative_error"] is not None and math.isfinite(v["relative_error"]), (name, metric)
            assert v["relative_error"] == pytest.approx((v["simulated"] - v["replayed"]) / v["replayed"]), metric
        assert p["step_time"]["num_steps"] > 0 and math.isfinite(p["step_time"]["mape"])
    assert "AzureLLMInferenceTrace_conv.csv[:30]" in result["requests"]["source"]


def test_device_check_runs_on_cpu(tmp_path):
    """The script as the device runs it (a fresh process; --quick: the smallest cases), every section to
    the end; tests/test_gpu_device_check.py injects failures."""
    require_backend()
    trace = shared_trace(AZURE)  # the replay section needs it: skip here with the reason rather than there silently
    out = tmp_path / "check.json"
    p = subprocess.run([sys.executable, str(ROOT / "gpu" / "check.py"), "--device", "cpu", "--quick", "--out", str(out),
                        "--trace", str(trace)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    fig = json.loads(out.read_text())
    assert fig["provenance"]["device_type"] == "cpu" and fig["provenance"]["triton_interpreter"]
    assert {s["status"] for s in fig["sections"].values()} == {"ok"}, fig["sections"]
    k = fig["kernels"]
    assert k["complete"] and k["num_cases"] > 0 and k["num_failed"] == 0 and k["broken_case_caught"] is True
    assert all(r["per_sequence"] for r in k["rows"] if not r.get("skipped"))
    assert {r["kernel"] for r in k["rows"] if r.get("skipped")} >= {"pool > 2^31 elements"}  # GPU only, said so
    bw = fig["bandwidth"]
    assert {r["layout"] for r in bw["decode_attention"]} == {"paged", "contiguous"}
    assert all(r["gb_per_s"] > 0 and r["paging_overhead"] > 0 for r in bw["decode_attention"])
    assert bw["ceilings"]["copy"]["gb_per_s"] > 0 and bw["ceilings"]["read"]["gb_per_s"] > 0
    assert bw["matched_overhead"]["best_paged_over_best_contiguous"] > 0
    assert fig["attention"] == {"backend": "torch", "fallback": False}  # the CPU's path, not a fallback
    rep, val = fig["replay"], fig["validation"]
    n = rep["requests"]["num_requests"]
    assert n > 0 and "AzureLLMInferenceTrace_conv.csv[:" in rep["requests"]["source"]
    assert set(rep["policies"]) == set(val["policies"]) == {"vllm", "orca-max"}
    assert all(r["num_finished"] == n for r in rep["policies"].values()), rep["policies"]
    throughput = {name: r["request_throughput"] for name, r in rep["policies"].items()}
    assert rep["vllm_over_orca_max_throughput"] == pytest.approx(throughput["vllm"] / throughput["orca-max"])
    assert rep["sizing"]["tried"] and rep["sizing"]["tried"][-1]["predicted_s"] > 0  # sized from the profile
    assert rep["pool_sizing"]["orca_max_concurrent"] >= 8 and "orca-max reserves" in rep["pool_sizing"]["rule"]
    assert all(s["eager"]["num_steps"] > 0 for s in rep["steps"].values())  # host time per step recorded
    assert all(math.isfinite(v["step_time_mape"]) for v in val["policies"].values())
    assert len(fig["targets"]) == 7
    replay_targets = [t for t in fig["targets"] if "replayed" in t["target"]]  # judged on the replay just run
    assert len(replay_targets) == 4 and all(t["measured"] is not None for t in replay_targets), replay_targets
