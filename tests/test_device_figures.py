"""The GPU figures the project ships (reports/device_check.json, reports/device_profile_h200.json, measured on a
lent H200) are what the README says, and the simulator reads the profile: a change to the step-time model or to
the files that leaves the README's figures stale fails here."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "reports" / "device_check.json"
PROFILE = ROOT / "reports" / "device_profile_h200.json"
README = (ROOT / "README.md").read_text()


def section() -> str:
    start = README.index("### GPU figures: NVIDIA H200")
    return README[start:README.index("### ", start + 10)]


def percent(text: str) -> float:
    return float(text.replace("−", "-").replace("%", "").strip())


def test_the_readme_targets_table_is_the_checks():
    fig = json.loads(CHECK.read_text())
    assert fig["provenance"]["device"] == "NVIDIA H200" and set(fig["sections"]) == {
        "kernels", "bandwidth", "calibration", "replay", "validation"}
    assert all(s["status"] == "ok" for s in fig["sections"].values())
    rows = [line for line in section().splitlines() if line.startswith("| ") and ("≥" in line or "≤" in line)]
    assert len(rows) == len(fig["targets"]) == 7
    for line, target in zip(rows, fig["targets"]):
        run2 = line.strip("|").split("|")[-1].strip()
        got = float(re.match(r"[\d.]+", run2).group())
        measured = target["measured"] * (100 if "%" in run2 else 1)
        assert got == pytest.approx(measured, abs=0.051 if "%" in run2 else 0.0051), (line, target)
        assert target["met"] is True


def test_the_simulator_reads_the_shipped_profile_and_the_readme_quotes_its_errors():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_device_profile as bench
    from sim.catalog import resolve_gpu
    from sim.steptime import ProfileStepTime, load_profile, measured_gpu

    prof = load_profile(PROFILE)
    assert measured_gpu(prof["provenance"]["device"]) == "h200"
    model = bench.profiled_model("llama-3-8b", prof)
    load_profile(PROFILE, model, "h200")  # the shape and GPU a scenario would check
    assert ProfileStepTime.from_profile(prof, paged=True).predict(0, 0, 64, 64 * 4096) > 0
    rows = bench.compare(prof, model, resolve_gpu("h200"), "none")
    quoted = re.search(r"decode \(graphs\), paged / contiguous \| (\S+ %) / (\S+ %)", section())
    for layout, text in zip(("paged", "contiguous"), quoted.groups()):
        e = [r["predicted_s"] / r["measured_s"] - 1 for r in rows if r["layout"] == layout and r["kind"] == "decode"]
        assert 100 * sum(e) / len(e) == pytest.approx(percent(text), abs=0.051)


def test_the_readme_decode_breakdown_is_the_shipped_measurement():
    from gpu.decode_breakdown import group_of

    assert [group_of(n) for n in ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT", "void cublasLt::splitKreduce_kernel<32>",
                                  "_decode_attention_kernel", "_decode_reduce_kernel", "_store_kv_kernel",
                                  "void at::native::reduce_kernel<512, 1, ArgMaxOps>", "Memcpy HtoD (Pinned -> Device)",
                                  "void at::native::vectorized_elementwise_kernel<8, BinaryFunctor>", "mystery")] == [
        "gemm", "gemm", "attention", "attention", "store_kv", "reduction", "copy", "elementwise", "other"]
    fig = json.loads((ROOT / "reports" / "decode_breakdown_h200.json").read_text())
    assert fig["provenance"]["device"] == "NVIDIA H200"
    text = section()
    for p in fig["points"]:
        g = p["kernel_us_by_group"]
        cells = [p["graph_step_us"], g["gemm"], g["elementwise"], g["reduction"], g["attention"],
                 g["store_kv"] + g["copy"]]
        row = f"| {p['batch']} × {p['mean_context']:,} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |"
        assert row in text, row
