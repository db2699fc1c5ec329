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


@pytest.mark.parametrize("args, message", [
    (["/nowhere.json"], "no such step-time profile"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--gpu", "nope"], "unknown gpu 'nope'"),
    (["--model", "llama-2-7b"], "is not the profiled shape"),
])
def test_bench_device_profile_bad_input_is_one_line(args, message):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_device_profile as bench

    with pytest.raises(SystemExit, match=message):
        bench.main(args)


def test_bench_device_profile_refuses_a_profile_without_steps(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_device_profile as bench

    prof = json.loads(PROFILE.read_text())
    del prof["points"]
    (tmp_path / "p.json").write_text(json.dumps(prof))
    with pytest.raises(SystemExit, match="no measured steps"):
        bench.main([str(tmp_path / "p.json")])


def test_gemm_profile_bad_input_is_one_line(tmp_path, capsys):
    from gpu import gemm_profile

    with pytest.raises(SystemExit):
        gemm_profile.main(["--out", str(tmp_path / "o"), "--tokens", "a,b"])
    assert "--tokens 'a,b': expected comma-separated positive integers" in capsys.readouterr().err
    run = ROOT / "reports" / "h200_gemm"

    def combine(*runs, out=tmp_path / "o") -> str:
        """--combine RUNS --out OUT: exit 2, nothing written, the error line."""
        assert gemm_profile.main(["--out", str(out), "--combine", *map(str, runs)]) == 2
        assert not (tmp_path / "o").exists()
        return capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert "no compute/<gpu>/<org>/<model>/mlp.csv" in combine(tmp_path / "empty")
    assert "--combine " + str(tmp_path / "nowhere") + ": not a folder" in combine(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    assert "is a file; expected the folder to write" in combine(run, out=tmp_path / "file")
    broken = tmp_path / "broken" / "compute" / "h200" / "microsoft" / "phi-2"
    broken.mkdir(parents=True)
    (broken / "mlp.csv").write_text("num_tokens,num_tensor_parallel_workers\n1,1\n")
    assert "not a run of this script" in combine(run, tmp_path / "broken")  # the other models' files are missing
    assert "its columns differ" in combine(tmp_path / "broken", run)
    # Vidur's own layout (more columns): was a DictWriter ValueError after a partial folder was written
    rel = Path("compute/h200/microsoft/phi-2/mlp.csv")
    vidur = tmp_path / "vidur" / rel
    vidur.parent.mkdir(parents=True)
    text = (run / rel).read_text().splitlines()
    vidur.write_text("\n".join([text[0] + ",time_stats.emb.max"] + [r + ",1.0" for r in text[1:]]) + "\n")
    assert "extra ['time_stats.emb.max']" in combine(tmp_path / "vidur")
    negative = tmp_path / "neg" / rel  # negative times were written through
    negative.parent.mkdir(parents=True)
    head, first, *rest = text
    cells = first.split(",")
    cells[head.split(",").index("time_stats.attn_pre_proj.median")] = "-1"
    negative.write_text("\n".join([head, ",".join(cells), *rest]) + "\n")
    for other in sorted((run / "compute").glob("*/*/*/mlp.csv")):
        (tmp_path / "neg" / other.relative_to(run)).parent.mkdir(parents=True, exist_ok=True)
        if other.relative_to(run) != rel:
            (tmp_path / "neg" / other.relative_to(run)).write_text(other.read_text())
    assert "time_stats.attn_pre_proj.median missing, negative or not a number" in combine(run, tmp_path / "neg")
    damaged = tmp_path / "damaged"  # an unreadable provenance: was a JSONDecodeError after mlp.csv was written
    for other in sorted((run / "compute").glob("*/*/*/mlp.csv")):
        (damaged / other.relative_to(run)).parent.mkdir(parents=True, exist_ok=True)
        (damaged / other.relative_to(run)).write_text(other.read_text())
    (damaged / "provenance.json").write_text("{trunc")
    assert "provenance.json: unreadable" in combine(run, damaged)
