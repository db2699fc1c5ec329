"""The step-time model fitted to measured operator profiles: the reader, the fit, its smoothness,
the host cost, `sim steptime`, and (with ../shared/profiles) the leave-one-model-out targets."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from sim.catalog import GPUS, MODELS, ElementwiseFit, GemmFit, OperatorFit, model_from_hf_config
from sim.config import RooflineConfig
from sim.core import StepPlan
from sim.engines import ENGINES
from sim.profiles import (ELEMENTWISE_OPS, LAYER_OPS, ProfileError, fit_gpu, predict_ops,
                          read_compute_profile, read_profiles, smoothness)
from sim.steptime import RooflineStepTime, decode_step_ms, steptime_rows

SHARED = Path(__file__).resolve().parents[2] / "shared" / "profiles" / "vidur"
TOKENS = np.array([1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096])
SHAPES = {  # n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp
    "org/big": (64, 8, 8192, 28672, 32000, 1), "org/mid": (40, 40, 5120, 13824, 32000, 1),
    "org/small": (32, 32, 2560, 10240, 51200, 0)}
TRUE = OperatorFit(gemm=GemmFit(8e-6, 0.72, 0.85, 2.5, 40.0),
                   elementwise={op: ElementwiseFit(3e-6 + 1e-6 * i, 0.5 + 0.05 * i)
                                for i, op in enumerate(ELEMENTWISE_OPS)})


def write_profile(root: Path, gpu: str, name: str, shape, fit: OperatorFit, spec, tps=(1, 2, 4)) -> Path:
    """A profile in Vidur's layout whose times are the model's own predictions with ``fit``."""
    from sim.profiles import profile_model

    cols = dict(zip(("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp"), shape))
    rows = []
    for tp in tps:
        model = profile_model(pd.DataFrame([cols]), name)
        ops = predict_ops(fit, spec, model, tp, TOKENS)
        for i, n in enumerate(TOKENS):
            r = {**cols, "num_tokens": int(n), "num_tensor_parallel_workers": tp}
            for op in LAYER_OPS:
                r[f"time_stats.{op}.median"] = float(ops[op][i])
            rows.append(r)
    path = root / "compute" / gpu / name / "mlp.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


# ---------------------------------------------------------------------------------------------- reader


def test_reader_reads_vidur_layout(tmp_path):
    for name, shape in SHAPES.items():
        write_profile(tmp_path, "a100", name, shape, TRUE, GPUS["a100-80gb"])
    ps = read_profiles(tmp_path)
    assert ps.gpus() == ["a100"] and len(ps.compute) == 3
    p = ps.compute[0]
    assert set(LAYER_OPS) <= set(p.table.columns) and len(p.table) == 3 * len(TOKENS)
    assert p.model.startswith("org/")


def test_leave_one_model_out_skips_a_gpu_with_one_model_and_says_so(tmp_path):
    from sim.profiles import PROFILE_GPUS, ProfileError, leave_one_model_out

    for name, shape in SHAPES.items():
        write_profile(tmp_path, "a100", name, shape, TRUE, GPUS["a100-80gb"])
    write_profile(tmp_path, "h100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["h100"])
    ps = read_profiles(tmp_path)
    loo = leave_one_model_out(ps, {g: GPUS[PROFILE_GPUS[g]] for g in ps.gpus()})
    assert set(loo.gpu) == {"a100"} and loo.attrs["single_model_gpus"] == ["h100"]
    alone = tmp_path / "alone"
    write_profile(alone, "h100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["h100"])
    with pytest.raises(ProfileError, match="needs at least two models measured on a GPU; h100 has one each"):
        leave_one_model_out(read_profiles(alone), {"h100": GPUS["h100"]})


def test_reader_averages_repeated_measurements(tmp_path):
    path = write_profile(tmp_path, "a100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["a100-80gb"], tps=(1,))
    df = pd.read_csv(path)
    twice = pd.concat([df, df.iloc[:1].assign(**{"time_stats.add.median": df["time_stats.add.median"][0] * 3})])
    twice.to_csv(path, index=False)
    t = read_compute_profile(path).table
    assert len(t) == len(TOKENS)
    assert t[t.num_tokens == TOKENS[0]]["add"].iloc[0] == pytest.approx(2 * df["time_stats.add.median"][0])


@pytest.mark.parametrize("edit, message", [
    (lambda df: df.drop(columns=["time_stats.mlp_up_proj.median"]), "missing column time_stats.mlp_up_proj.median"),
    (lambda df: df.assign(**{"time_stats.attn_pre_proj.median": ["x"] + [1.0] * (len(df) - 1)}),
     "line 2, column 'time_stats.attn_pre_proj.median': expected a time > 0 ms, got 'x'"),
    (lambda df: df.assign(**{"time_stats.mlp_down_proj.median": [1.0] * 4 + [0.0] * (len(df) - 4)}),
     "line 6, column 'time_stats.mlp_down_proj.median': expected a time > 0 ms, got 0.0"),
    (lambda df: df.assign(**{"time_stats.attn_rope.median": [1.0, np.nan] + [1.0] * (len(df) - 2)}),
     "line 3, column 'time_stats.attn_rope.median': expected a time > 0 ms, got nan"),
    (lambda df: df.assign(**{"time_stats.add.median": [1.0, 3.5, -3.5] + [1.0] * (len(df) - 3)}),
     "line 4, column 'time_stats.add.median': expected a time > 0 ms, got -3.5"),
    (lambda df: df.assign(num_tokens=[0] + list(df.num_tokens[1:])), "line 2, column 'num_tokens': expected a positive"),
    (lambda df: df.assign(num_tokens=[1.5] + list(df.num_tokens[1:])), "column 'num_tokens'"),
    (lambda df: df.assign(**{"time_stats.add.median": [-1.0] + [1.0] * (len(df) - 1)}), "column 'time_stats.add.median'"),
    (lambda df: df.assign(n_embd=[8192] * 3 + [4096] * (len(df) - 3)), "line 5: the model's shape columns"),
    (lambda df: df.iloc[0:0], "no rows"),
    # absurd values: the fit ended at its bounds (launch 200 µs, efficiencies 0.05, tile 2,000 tokens)
    (lambda df: df.assign(**{"time_stats.attn_pre_proj.median": 1e300}),
     "line 2, column 'time_stats.attn_pre_proj.median': expected at most 1,000,000 ms (17 minutes for one op of one "
     "layer: no kernel time), got 1e+300"),
    (lambda df: df.assign(use_gated_mlp=2), "line 2, column 'use_gated_mlp': expected 0 or 1 (false or true), got 2"),
    (lambda df: df.assign(num_tensor_parallel_workers=[1, 1, 10**12] + [1] * (len(df) - 3)),
     "line 4, column 'num_tensor_parallel_workers': expected at most 1,024 (a scenario's limit on tensor_parallel), "
     "got 1000000000000"),
    (lambda df: df.assign(num_tokens=list(df.num_tokens[:4]) + [10**15] + list(df.num_tokens[5:])),
     "line 6, column 'num_tokens': expected at most 16,777,216 tokens in one batch, got 1000000000000000"),
    # shapes a model's config.json may not have (they were fitted as given: 5121 / 40 heads read as 128 wide)
    (lambda df: df.assign(n_embd=5121), "line 2, column 'n_embd': 5121 is not a multiple of n_head 40"),
    (lambda df: df.assign(n_kv_head=3), "line 2, column 'n_head': 40 is not a multiple of n_kv_head 3"),
    (lambda df: df.assign(vocab_size=2**40), "line 2, column 'vocab_size': expected at most 2,147,483,647 (as in a "
                                             "model's config.json), got 1099511627776"),
])
def test_reader_names_file_line_and_column(tmp_path, edit, message):
    path = write_profile(tmp_path, "a100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["a100-80gb"], tps=(1,))
    edit(pd.read_csv(path)).to_csv(path, index=False)
    with pytest.raises(ProfileError, match=re.escape(message)) as e:
        read_compute_profile(path)
    assert str(path) in str(e.value) and "np." not in str(e.value)  # plain values, not numpy reprs


def test_reader_heads_must_split_over_tp_and_gated_mlp_may_read_true_false(tmp_path):
    """n_head 7 at TP 2 was fitted as 3 heads per rank; now the error a run gives, naming the line. A
    use_gated_mlp column mixing true/false with 0/1 reads as 0/1."""
    path = write_profile(tmp_path, "a100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["a100-80gb"], tps=(1, 2))
    df = pd.read_csv(path)
    df.assign(n_head=7, n_kv_head=7, n_embd=7 * 128).to_csv(path, index=False)
    with pytest.raises(ProfileError, match=f"line {len(TOKENS) + 2}, column 'num_tensor_parallel_workers': org/mid: "
                                           f"7 attention heads do not split over tensor_parallel=2"):
        read_compute_profile(path)
    df.assign(use_gated_mlp=["true", "0", " False", "1"] * (len(df) // 4) + ["1"] * (len(df) % 4)).to_csv(path,
                                                                                                        index=False)
    with pytest.raises(ProfileError, match="line 3: the model's shape columns"):  # read as 1, 0, 0, 1: two shapes
        read_compute_profile(path)
    df.assign(use_gated_mlp=["true", "1"] * (len(df) // 2)).to_csv(path, index=False)
    assert (read_compute_profile(path).table.use_gated_mlp == 1).all()


def test_reader_rejects_a_zero_time_and_keeps_absent_elementwise_ops(tmp_path):
    """A 0-ms time is no measurement (the fit is in log time): an error, not a row dropped from the fit and a
    MAPE of inf; an elementwise op the model lacks (phi-2: no post-attention norm) is an absent column."""
    from sim.profiles import read_network_profile

    path = write_profile(tmp_path, "a100", "org/mid", SHAPES["org/mid"], TRUE, GPUS["a100-80gb"], tps=(1,))
    pd.read_csv(path).drop(columns=["time_stats.post_attention_layernorm.median"]).to_csv(path, index=False)
    t = read_compute_profile(path).table
    assert t.post_attention_layernorm.isna().all() and (t.mlp_down_proj > 0).all()
    net = tmp_path / "network" / "a100_dgx" / "all_reduce.csv"
    net.parent.mkdir(parents=True)
    net.write_text("num_workers,size,time_stats.all_reduce.median\n2,1024,0.02\n2,2048,0\n")
    with pytest.raises(ProfileError, match=r"all_reduce.csv: line 3, column 'time_stats.all_reduce.median': "
                                           r"expected a time > 0 ms, got 0.0$"):
        read_network_profile(net)


def test_network_file_with_no_single_node_rows_is_an_error(tmp_path):
    """Every row a multi-node group (devices_per_node < num_workers): the reader kept none, and the GPU's fit
    claimed topology a100_dgx with allreduce={}; now an error naming the file and why no row is usable."""
    for name, shape in SHAPES.items():
        write_profile(tmp_path, "a100", name, shape, TRUE, GPUS["a100-80gb"], tps=(1,))
    net = tmp_path / "network" / "a100_dgx" / "all_reduce.csv"
    net.parent.mkdir(parents=True)
    net.write_text("num_workers,size,time_stats.all_reduce.median,devices_per_node\n2,1024,0.02,1\n2,2048,0.03,1\n")
    for args in (["fit", str(tmp_path)], ["validate", str(tmp_path), "--out", str(tmp_path / "out")]):
        r = CliRunner().invoke(app, ["profiles", *args])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert f"{net}: no usable rows: the fit uses all-reduces within one node (devices_per_node ≥ num_workers), " \
               "and every row spans nodes (num_workers/devices_per_node: 2/1)" in r.output


def test_network_files_no_gpu_uses_are_named(tmp_path):
    """A topology no GPU is fitted with (l40s_pcie), or whose GPU has no compute profiles here (h100_dgx), was
    silently unused; now one line names each file and why."""
    for name, shape in SHAPES.items():
        write_profile(tmp_path, "a100", name, shape, TRUE, GPUS["a100-80gb"], tps=(1,))
    for topology in ("a100_dgx", "h100_dgx", "l40s_pcie", "a100_pairwise_nvlink"):
        net = tmp_path / "network" / topology / "all_reduce.csv"
        net.parent.mkdir(parents=True)
        net.write_text("num_workers,size,time_stats.all_reduce.median\n2,1024,0.02\n2,2048,0.03\n2,4096,0.04\n")
    line = ("note: not used by any GPU's fit: network/a100_pairwise_nvlink/all_reduce.csv, network/l40s_pcie/"
            "all_reduce.csv (a GPU's all-reduce comes from a100_dgx for a100-80gb, h100_dgx for h100 only); "
            "network/h100_dgx/all_reduce.csv (no h100 compute profiles)")
    for args in (["fit", str(tmp_path)], ["validate", str(tmp_path), "--out", str(tmp_path / "out")]):
        r = CliRunner().invoke(app, ["profiles", *args])
        assert r.exit_code == 0 and line in r.output.splitlines(), r.output
        assert "topology='a100_dgx'" in r.output or args[0] == "validate"


def test_reader_bad_folders(tmp_path):
    with pytest.raises(ProfileError, match="no such profile folder"):
        read_profiles(tmp_path / "nope")
    with pytest.raises(ProfileError, match="no compute/"):
        read_profiles(tmp_path)
    # a parent of the layout (../shared/profiles holds vidur/): the error names the folder to pass
    net = tmp_path / "up" / "vidur" / "network" / "a100_dgx" / "all_reduce.csv"
    net.parent.mkdir(parents=True)
    net.write_text("num_workers,size,time_stats.all_reduce.median\n2,1024,0.02\n")
    with pytest.raises(ProfileError, match=f"Vidur's layout is in {tmp_path / 'up' / 'vidur'}: pass that folder"):
        read_profiles(tmp_path / "up")
    with pytest.raises(ProfileError, match=f"Vidur's layout is in {tmp_path / 'up' / 'vidur'}: pass that folder"):
        read_profiles(tmp_path)
    (tmp_path / "compute/a100/org/m").mkdir(parents=True)
    (tmp_path / "compute/a100/org/m/mlp.csv").write_bytes(b"\xff\xfe\x00bin")
    with pytest.raises(ProfileError, match="mlp.csv"):
        read_profiles(tmp_path)


def test_cli_profiles_bad_input_exits_2(tmp_path):
    r = CliRunner().invoke(app, ["profiles", "validate", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such profile folder" in r.output and "Traceback" not in r.output


def test_cli_profiles_network_only_folder_says_compute_is_missing(tmp_path):
    """All-reduce files alone fit no GPU: validate and fit both say so (fit printed nothing and exited 0;
    validate said 'needs at least two models measured on a GPU;  have one each')."""
    net = tmp_path / "network" / "a100_dgx" / "all_reduce.csv"
    net.parent.mkdir(parents=True)
    net.write_text("num_workers,size,time_stats.all_reduce.median\n2,1024,0.02\n2,2048,0.03\n")
    for args in (["validate", str(tmp_path), "--out", str(tmp_path / "out")], ["fit", str(tmp_path)]):
        r = CliRunner().invoke(app, ["profiles", *args])
        assert r.exit_code == 2, r.output
        assert f"no compute profiles (compute/<gpu>/<org>/<model>/mlp.csv) under {tmp_path}" in r.output
        assert "a100_dgx" in r.output and "Traceback" not in r.output and "one each" not in r.output


# ---------------------------------------------------------------------------------------------- fit


@pytest.mark.parametrize("tile_rows", [1, 64])
def test_fit_recovers_known_coefficients(tmp_path, tile_rows):
    """Profiles priced by known coefficients, smooth (1) or on whole tiles of 64 rows: the fit finds them, tile
    and all."""
    spec = GPUS["h100"]
    true = replace(TRUE, gemm=replace(TRUE.gemm, tile_rows=tile_rows))
    for name, shape in SHAPES.items():
        write_profile(tmp_path, "h100", name, shape, true, spec)
    fit = fit_gpu(read_profiles(tmp_path).compute, spec)
    g, t = fit.gemm, true.gemm
    assert g.tile_rows == tile_rows
    assert g.compute_efficiency == pytest.approx(t.compute_efficiency, rel=0.02)
    assert g.bandwidth_efficiency == pytest.approx(t.bandwidth_efficiency, rel=0.02)
    assert g.sharpness == pytest.approx(t.sharpness, rel=0.05)
    assert g.launch_s == pytest.approx(t.launch_s, rel=0.05)
    assert g.tile_tokens == pytest.approx(t.tile_tokens, rel=0.1)
    for op in ELEMENTWISE_OPS:
        assert fit.elementwise[op].bandwidth_efficiency == pytest.approx(TRUE.elementwise[op].bandwidth_efficiency,
                                                                         rel=0.02)
        assert fit.elementwise[op].launch_s == pytest.approx(TRUE.elementwise[op].launch_s, rel=0.05)


def test_an_op_measured_on_no_model_is_not_fitted_and_the_roofline_prices_it(tmp_path):
    """attn_rope absent from every model of a GPU: the fit printed the optimizer's starting guess,
    ElementwiseFit(5e-06, 0.5), as fitted coefficients; now the op is left out of the fit, the literal and a
    warning say so, and the step-time model prices it by the datasheet roofline."""
    spec = GPUS["a100-80gb"]
    for name, shape in SHAPES.items():
        path = write_profile(tmp_path, "a100", name, shape, TRUE, spec, tps=(1, 2))
        pd.read_csv(path).drop(columns=["time_stats.attn_rope.median"]).to_csv(path, index=False)
    fit = fit_gpu(read_profiles(tmp_path).compute, spec)
    assert "attn_rope" not in fit.elementwise and set(fit.elementwise) == set(ELEMENTWISE_OPS) - {"attn_rope"}
    model = MODELS["llama-2-7b"]
    ops = predict_ops(fit, spec, model, 1, TOKENS)
    assert np.allclose(ops["attn_rope"], predict_ops(None, spec, model, 1, TOKENS)["attn_rope"])
    r = CliRunner().invoke(app, ["profiles", "fit", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "'attn_rope': ElementwiseFit" not in r.output and "# 'attn_rope': not measured on this GPU" in r.output
    assert "warning: a100-80gb: attn_rope measured on no model" in r.output
    r = CliRunner().invoke(app, ["profiles", "validate", str(tmp_path), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "warning: a100-80gb: attn_rope measured on no model" in r.output
    fits = json.loads((tmp_path / "out" / "fits.json").read_text())
    assert "attn_rope" not in fits["gpus"]["a100-80gb"]["elementwise"]


def test_a_coefficient_ending_at_its_bound_is_a_warning(tmp_path):
    """GEMMs 50x slower than the datasheet allows at any efficiency within bounds: the fit ended at
    compute_efficiency=0.05 and printed it as a fit; now a warning names the GPU and the coefficients. A floor
    (tile_tokens 0: no tile term) is a result, not a warning."""
    from sim.profiles import fit_notes

    spec = GPUS["a100-80gb"]
    slow = replace(TRUE, gemm=GemmFit(8e-6, 0.01, 0.01, 2.5, 0.0))
    for name, shape in SHAPES.items():
        write_profile(tmp_path, "a100", name, shape, slow, spec, tps=(1, 2))
    r = CliRunner().invoke(app, ["profiles", "fit", str(tmp_path)])
    assert r.exit_code == 0, r.output
    warning = [line for line in r.output.splitlines()
               if line.startswith("warning: a100-80gb: the fit ended at its bounds")]
    assert len(warning) == 1 and "GEMM compute_efficiency=0.05 (its lower bound)" in warning[0]
    assert "GEMM bandwidth_efficiency=0.05 (its lower bound)" in warning[0] and "tile_tokens" not in warning[0]
    assert "input_layernorm" not in warning[0]  # the elementwise ops fitted well
    r = CliRunner().invoke(app, ["profiles", "validate", str(tmp_path), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0 and warning[0] in r.output, r.output
    assert fit_notes(read_profiles(tmp_path), {"a100-80gb": TRUE}) == []


@pytest.mark.parametrize("gpu", [g for g in GPUS if GPUS[g].operators is not None])
def test_fitted_layer_time_is_smooth_within_tiles_and_never_falls(gpu):
    """No jump of more than 2 % between adjacent token counts within a GEMM tile, and a token more never costs
    less, for any catalog model and TP degree; past the first tile, whole tiles step up (measured GEMMs do)."""
    for model in ("llama-2-7b", "llama-3-70b", "opt-13b", "mistral-7b"):
        for tp in (1, 2, 4, 8):
            jump, fall = smoothness(GPUS[gpu].operators, GPUS[gpu], MODELS[model], tp)
            assert jump <= 0.02 and fall >= 0.0, (gpu, model, tp, jump, fall)


def test_gemm_compute_is_priced_on_whole_tiles_past_the_first():
    """With 128-row tiles, 129 to 256 tokens compute as 256 do (only the moved bytes grow); up to 128 tokens,
    compute grows with the tokens as on a smooth curve; tile_rows 1 is the smooth curve itself."""
    gpu = replace(GPUS["h100"], hbm_bytes_per_s=1e18)  # memory priced at nothing: compute alone
    tiled = GemmFit(8e-6, 0.7, 0.9, 2.0, 0.0, tile_rows=128)
    smooth = replace(tiled, tile_rows=1)
    n = k = 8192
    assert tiled.time_s(100.0, n, k, gpu) == smooth.time_s(100.0, n, k, gpu)
    assert tiled.time_s(128.0, n, k, gpu) == smooth.time_s(128.0, n, k, gpu)
    assert tiled.time_s(129.0, n, k, gpu) == pytest.approx(smooth.time_s(256.0, n, k, gpu), rel=1e-9)
    assert tiled.time_s(200.0, n, k, gpu) == pytest.approx(smooth.time_s(256.0, n, k, gpu), rel=1e-9)
    arr = tiled.time_s(np.array([100.0, 129.0, 256.0, 257.0]), n, k, gpu)
    assert list(arr) == [tiled.time_s(m, n, k, gpu) for m in (100.0, 129.0, 256.0, 257.0)]
    assert arr[3] > arr[2] * 1.3  # 257 tokens: three tiles


def test_datasheet_and_fitted_prices_differ_only_through_the_catalog():
    m, g = MODELS["llama-2-7b"], GPUS["a100-80gb"]
    fitted = RooflineStepTime(m, g, 1, RooflineConfig(), paged=True)
    bare = RooflineStepTime(m, replace(g, operators=None), 1, RooflineConfig(), paged=True)
    sheet = RooflineStepTime(m, g, 1, RooflineConfig(operators="datasheet"), paged=True)
    assert bare.breakdown(256) == sheet.breakdown(256) != fitted.breakdown(256)


# ---------------------------------------------------------------------------------------------- host cost


def test_large_batch_step_at_tp8_is_not_below_its_host_cost():
    model, gpu, batch = MODELS["llama-3-70b"], GPUS["h100"], 256
    for name, e in ENGINES.items():
        cfg = RooflineConfig(engine=name)
        host = e.serial_step_s + (e.serial_per_seq_s + e.serial_per_token_s) * batch
        hidden = e.overlapped_step_s + (e.overlapped_per_seq_s + e.overlapped_per_token_s) * batch
        ms = decode_step_ms(model, gpu, 8, batch, 1024, cfg)
        assert ms["step_ms"] >= (host + hidden) * 1e3 * (1 - 1e-12) or ms["step_ms"] >= (host * 1e3 + ms["gpu_ms"])
        assert ms["step_ms"] == pytest.approx(host * 1e3 + max(ms["gpu_ms"], hidden * 1e3))


def test_host_cost_keeps_steps_from_shrinking_with_tp():
    """The GPU's part shrinks with TP; the serial host part does not: the step shrinks less than the GPU."""
    m, g = MODELS["llama-3-8b"], GPUS["h100"]
    one = decode_step_ms(m, g, 1, 256, 1024, RooflineConfig(engine="vllm-0.5"))
    eight = decode_step_ms(m, g, 8, 256, 1024, RooflineConfig(engine="vllm-0.5"))
    assert eight["host_ms"] == one["host_ms"] > 0
    assert one["step_ms"] / eight["step_ms"] < one["gpu_ms"] / eight["gpu_ms"]


def test_host_overrides_replace_the_engine_profile():
    cfg = RooflineConfig(engine="none", host={"serial_step_s": 0.01})
    st = RooflineStepTime(MODELS["llama-2-7b"], GPUS["h100"], 1, cfg, paged=True)
    assert st.engine.serial_step_s == 0.01 and st.engine.serial_per_seq_s == 0


# ---------------------------------------------------------------------------------------------- paged cost


def _decode_plan(n: int, ctx: int, block_size: int, paged: bool) -> StepPlan:
    return StepPlan(num_seqs=n, num_tokens=n, num_prefill_tokens=0, num_decode_tokens=n, num_sampled=n,
                    decode_context_tokens=n * ctx, prefill_attention_pairs=0, block_size=block_size, paged=paged)


def test_paged_decode_by_default_reads_only_the_last_blocks_padding_more():
    """The default block cost is 0 (measured: paged decode within 1 % of contiguous on an H200): a paged step
    costs a contiguous one plus the keys of its last blocks' padding, (b - 1) / 2 per sequence on average."""
    m, g = MODELS["llama-2-7b"], GPUS["a100-80gb"]
    cfg = RooflineConfig(engine="none")
    assert cfg.paged_block_cost_tokens == 0
    paged = RooflineStepTime(m, g, 1, cfg, paged=True)
    n, ctx = 64, 300
    base = RooflineStepTime(m, g, 1, cfg, paged=False).step_time_s(_decode_plan(n, ctx, 16, False))
    for b in (1, 16, 64):
        extra = paged.step_time_s(_decode_plan(n, ctx, b, True)) - base
        assert extra == pytest.approx(paged._key_s * n * (b - 1) / 2, rel=1e-9, abs=1e-15)


def test_paged_block_cost_follows_block_size():
    m, g = MODELS["llama-2-7b"], GPUS["a100-80gb"]
    cfg = RooflineConfig(engine="none", paged_block_cost_tokens=3.68)  # the PagedAttention paper's kernel
    paged = RooflineStepTime(m, g, 1, cfg, paged=True)
    contiguous = RooflineStepTime(m, g, 1, cfg, paged=False)
    n, ctx = 64, 300
    base = contiguous.step_time_s(_decode_plan(n, ctx, 16, False))
    extra = {b: paged.step_time_s(_decode_plan(n, ctx, b, True)) - base for b in (1, 4, 16, 64, 256)}
    key_s = paged._key_s
    for b, e in extra.items():  # beta / b per key, plus the mean padding of the last block
        f = 1 + cfg.paged_block_cost_tokens / b
        assert e == pytest.approx(key_s * (n * ctx * (f - 1) + n * (b - 1) / 2 * f), rel=1e-9)
    assert extra[1] > extra[4] > extra[16] > extra[64]  # small blocks pay per block ...
    assert extra[256] > extra[64]  # ... large ones read padding


# ---------------------------------------------------------------------------------------------- sim steptime


def test_steptime_csv_columns_and_sums():
    r = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "a100-80gb", "--tokens", "1,16,256,3996",
                                 "--context", "100", "--csv"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(__import__("io").StringIO(r.stdout))
    assert list(df.columns) == ["tokens", "linear_ms", "elementwise_ms", "attention_ms", "allreduce_ms", "layer_ms",
                                "gpu_ms", "host_ms", "step_ms"]
    assert list(df.tokens) == [1, 16, 256, 3996]
    parts = df.linear_ms + df.elementwise_ms + df.attention_ms + df.allreduce_ms
    assert np.allclose(parts, df.layer_ms, rtol=1e-4)
    assert (df.allreduce_ms == 0).all() and (df.step_ms > df.layer_ms * 32).all()
    assert df.step_ms.is_monotonic_increasing


def test_steptime_matches_the_simulators_step(tmp_path):
    """The table's step_ms is what the simulator charges for that prefill step."""
    m, g = MODELS["llama-3-8b"], GPUS["h100"]
    rows = steptime_rows(m, g, 2, [512], context=100)
    st = RooflineStepTime(m, g, 2, RooflineConfig(), paged=True)
    plan = StepPlan(num_seqs=1, num_tokens=512, num_prefill_tokens=512, num_decode_tokens=0, num_sampled=1,
                    decode_context_tokens=0, prefill_attention_pairs=512 * 100 + 512 * 513 // 2, block_size=16,
                    paged=True)
    assert rows[0]["step_ms"] == pytest.approx(st.step_time_s(plan) * 1e3, rel=1e-12)


def test_steptime_takes_a_scenario_step_time_block(tmp_path):
    f = tmp_path / "st.yaml"
    f.write_text("step_time: {kind: roofline, engine: none, gpu_overhead_s: 0}\n")
    r = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "h100", "--tokens", "8", "--csv",
                                 "--step-time", str(f)])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(__import__("io").StringIO(r.stdout)).iloc[0]
    assert row.host_ms == 0 and row.step_ms == pytest.approx(row.gpu_ms, rel=1e-4)
    whole = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "h100", "--tokens", "8", "--csv",
                                     "--step-time", "scenarios/quickstart.yaml"])  # a scenario without step_time
    default = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "h100", "--tokens", "8", "--csv"])
    assert whole.exit_code == 0 and whole.stdout == default.stdout, whole.output
    f.write_text("step_time: {kind: roofline, engin: none}\n")
    bad = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "h100", "--step-time", str(f)])
    assert bad.exit_code == 2 and "engin" in bad.output
    # a plan or a sweep (they hold `policies` too) was read as a scenario without step_time: the defaults
    for other in ("scenarios/cluster/plan-azure.yaml", "scenarios/vllm-paper/azure-conv.sweep.yaml"):
        r = CliRunner().invoke(app, ["steptime", "llama-2-7b", "--gpu", "h100", "--step-time", other])
        assert r.exit_code == 2 and "a sweep or a plan, not a scenario" in r.output, r.output


@pytest.mark.parametrize("args, message", [
    (["nope-7b", "--gpu", "h100"], "unknown model 'nope-7b'"),
    (["llama-2-7b", "--gpu", "h10"], "did you mean 'h100'"),
    (["llama-2-7b", "--gpu", "h100", "--tokens", "1,x"], "--tokens"),
    (["llama-2-7b", "--gpu", "h100", "--tokens", "0"], "--tokens"),
    (["llama-2-7b", "--gpu", "h100", "--tokens", "1,,2"], "--tokens"),
    (["llama-2-7b", "--gpu", "h100", "--tp", "3"], "--tp: llama-2-7b: 32 attention heads do not split over "
                                                   "tensor_parallel=3"),
    (["llama-2-7b", "--gpu", "h100", "--tokens", "5000"], "--tokens: 5,000 tokens after 0 cached exceed "
                                                          "llama-2-7b's 4,096-token context"),
    (["llama-2-7b", "--gpu", "h100", "--context", "4096"], "--context: 4,096 cached tokens leave no room"),
])
def test_steptime_bad_input(args, message):
    r = CliRunner().invoke(app, ["steptime", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------------------------------------- shapes


def test_head_dim_from_config_json(tmp_path):
    """Mistral-Nemo declares head_dim 128 where hidden / heads is 160: KV bytes follow the declared one."""
    cfg = {"model_type": "mistral", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 131072,
           "max_position_embeddings": 131072}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = model_from_hf_config(p)
    assert m.head_dim == 128 and m.kv_bytes_per_token() == 2 * 40 * 8 * 128 * 2
    assert m.layer_gemms(1)["attn_post_proj"] == (5120, 32 * 128)
    p.write_text(json.dumps({**cfg, "head_dim": None}))
    assert model_from_hf_config(p).head_dim == 160


def test_catalog_models_head_dim_is_their_configs():
    for m in MODELS.values():  # every classic catalog model's config.json has head_dim = hidden / heads
        if not m.modern:  # (Gemma 3, gpt-oss, DeepSeek-V3 declare another head_dim, as their config.json do)
            assert m.head_dim * m.num_heads == m.hidden_size, m.name


# ---------------------------------------------------------------------------------------------- measured


def test_the_tile_is_the_best_physical_fit_and_the_shortest_of_a_tie():
    """``pick_tile``: a fit ending at a bound of the optimizer, or one needing memory faster than the datasheet,
    loses to a worse physical fit; within TILE_MARGIN of the best error the shortest tile wins (the
    optimizer's noise does not pick a tile); with no physical fit, the best of all."""
    from sim.profiles import TILE_MARGIN, pick_tile

    def fit(tile, bw=0.8, p=2.0):
        return GemmFit(8e-6, 0.7, bw, p, 0.0, tile_rows=tile)

    assert pick_tile([fit(1), fit(64, p=20.0)], [2.0, 1.0]).tile_rows == 1  # sharpness at its upper bound
    assert pick_tile([fit(1), fit(64, bw=1.03)], [2.0, 1.0]).tile_rows == 1  # faster than HBM allows
    assert pick_tile([fit(1), fit(64), fit(128)], [2.0, 1.0, 1.0 * (1 - TILE_MARGIN / 2)]).tile_rows == 64
    assert pick_tile([fit(1), fit(64), fit(128)], [2.0, 1.0, 1.0 * (1 - 2 * TILE_MARGIN)]).tile_rows == 128
    assert pick_tile([fit(16, bw=1.1), fit(64, bw=1.2)], [2.0, 1.0]).tile_rows == 64  # none physical: the best


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no measured profiles at {SHARED} (../shared/profiles)")
def test_the_catalog_literals_are_what_the_fit_prints():
    """sim/catalog.py's coefficients are ``sim profiles fit``'s on Vidur's profiles, tile and all."""
    from sim.profiles import PROFILE_GPUS, fit_catalog_literals, fit_literal, profile_origin

    ps = read_profiles(SHARED)
    fits = fit_catalog_literals(ps, {g: GPUS[PROFILE_GPUS[g]] for g in ps.gpus()}, profile_origin(SHARED))
    assert set(fits) == {"a100-80gb", "h100", "a40"}
    for name, fit in fits.items():  # (the source names where the profiles came from: not compared)
        assert fit_literal(replace(fit, source="")) == fit_literal(replace(GPUS[name].operators, source="")), name
    assert [fits[g].gemm.tile_rows for g in ("a100-80gb", "h100", "a40")] == [128, 128, 64]


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no measured profiles at {SHARED} (../shared/profiles)")
def test_leave_one_model_out_meets_the_targets():
    from sim.profiles import PROFILE_GPUS, leave_one_model_out, mape_table

    ps = read_profiles(SHARED)
    loo = leave_one_model_out(ps, {g: GPUS[PROFILE_GPUS[g]] for g in ps.gpus()})
    t = mape_table(loo).set_index(["gpu", "op"])
    target = {"a100": 8.0, "h100": 8.0, "a40": 12.0}
    for gpu, limit in target.items():
        assert t.loc[(gpu, "layer"), "fitted"] <= limit
        assert t.loc[(gpu, "layer"), "fitted_worst_tokens"] <= 20.0  # no token count worse (H100 was 25.8 smooth)
        assert t.loc[(gpu, "layer"), "fitted"] < t.loc[(gpu, "layer"), "roofline"]


def test_the_shipped_h200_gemm_runs_read_and_fit_but_the_catalog_keeps_h100s():
    """reports/h200_gemm (three runs of gpu/gemm_profile.py on an H200) reads and fits like Vidur's folders, and
    its fit's source says who measured it; the catalog keeps H100's coefficients for the H200, because those runs
    evicted the L2 by writing and priced in-step GEMMs 17-25 % slow (README, H200)."""
    from sim.profiles import fit_catalog_literals, gpu_specs, leave_one_model_out, mape_table, profile_origin

    root = Path(__file__).resolve().parents[1] / "reports" / "h200_gemm"
    ps = read_profiles(root)
    fit = fit_catalog_literals(ps, gpu_specs(ps), profile_origin(root))["h200"]
    assert fit.source.startswith("gpu/gemm_profile.py, 3 runs on NVIDIA H200 2026-12-04: h200")
    t = mape_table(leave_one_model_out(ps, {"h200": GPUS["h200"]})).set_index(["gpu", "op"])
    assert t.loc[("h200", "layer"), "fitted"] <= 6.0
    assert GPUS["h200"].operators is GPUS["h100"].operators


def test_gemm_profile_runs_combine_into_one_profile_the_fit_reads(tmp_path):
    """``gpu/gemm_profile.py --combine``: per point the median of the runs' medians (one run's transient slowdown
    does not reach the fit), min and max the extremes; runs that measured different points are an error."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu.gemm_profile import GEMM_OPS, STATS, CombineError, combine, write_csv

    def run(name, scale):
        rows = [{**{f"time_stats.{op}.{s}": scale * (t + 1) * 0.01 for op in GEMM_OPS for s in STATS},
                 "n_head": 4, "n_kv_head": 2, "n_embd": 64, "n_expanded_embd": 128, "vocab_size": 100,
                 "use_gated_mlp": True, "num_tokens": t, "num_tensor_parallel_workers": 1} for t in (1, 8, 64)]
        write_csv(tmp_path / name / "compute" / "h200" / "org" / "tiny" / "mlp.csv", rows)
        (tmp_path / name / "provenance.json").write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-12-04T1"}))
        return tmp_path / name

    runs = [run("a", 1.0), run("b", 5.0), run("c", 1.2)]
    combine(runs, tmp_path / "all")
    ps = read_profiles(tmp_path / "all")
    got = ps.compute[0].table.set_index("num_tokens")["mlp_up_proj"]
    assert got.to_dict() == pytest.approx({1: 0.024, 8: 0.108, 64: 0.78})  # the middle run's, not the slow one's
    from sim.profiles import profile_origin
    assert profile_origin(tmp_path / "all") == "gpu/gemm_profile.py, 3 runs on NVIDIA H200 2026-12-04"
    (runs[2] / "compute" / "h200" / "org" / "tiny" / "mlp.csv").write_text(
        (runs[0] / "compute" / "h200" / "org" / "tiny" / "mlp.csv").read_text().rsplit("\n", 2)[0] + "\n")
    with pytest.raises(CombineError, match="different token counts"):
        combine(runs, tmp_path / "bad")


def test_startup_delays_service_not_arrivals(make_scenario):
    """startup_s: no step before it; requests still arrive (and wait) from t = 0; exact and fast agree."""
    from sim import run

    wl = {"arrival": {"kind": "poisson", "rate": 8.0}, "lengths": "alpaca", "num_requests": 60, "seed": 3}
    base = run(make_scenario(policies=["vllm"], workload=wl)).policies["vllm"].requests
    for exact in (False, True):
        late = run(make_scenario(policies=["vllm"], workload=wl, startup_s=5.0, exact=exact)).policies["vllm"].requests
        assert (late.first_token_s >= 5.0).all() and (base.first_token_s < 5.0).any()
        assert (late.arrival_s == base.arrival_s).all()
        assert late.ttft_ms.iloc[0] >= (5.0 - late.arrival_s.iloc[0]) * 1e3


def test_calibration_recovers_the_block_cost():
    """sim calibrate's fit of the paged block cost recovers beta from steps priced by the same model."""
    pytest.importorskip("torch")
    from gpu.calibrate import fit_block_cost

    key_s, beta = 2e-9, 5.0
    pts = []
    for b in (8, 16, 32, 64):
        for n, keys in ((8, 8000), (32, 64000), (64, 40000)):
            contiguous = 1e-3 + key_s * keys
            paged = 1e-3 + key_s * (keys * (1 + beta / b) + n * (b - 1) / 2 * (1 + beta / b))
            pts.append({"block_size": b, "num_seqs": n, "keys": keys, "paged_s": paged, "contiguous_s": contiguous})
    assert fit_block_cost(pts, key_s) == pytest.approx(beta, rel=1e-9)
    for p in pts:
        p["paged_s"] = p["contiguous_s"]  # a kernel that pays nothing per block
    assert fit_block_cost(pts, key_s) == 0.0


def test_profile_step_time_scales_decode_keys_by_block_size():
    from sim.steptime import PROFILE_TERMS, ProfileStepTime

    coef = dict(zip(PROFILE_TERMS, (1e-3, 1e-6, 1e-9, 2e-3, 1e-5, 4e-9)))
    prof = ProfileStepTime(coef, block_size=16, block_cost_tokens=4.0)
    at16 = prof.step_time_s(_decode_plan(10, 1000, 16, True))
    at64 = prof.step_time_s(_decode_plan(10, 1000, 64, True))
    keys_s = 10 * 1000 * 4e-9
    assert at16 - at64 == pytest.approx(keys_s * (1 - (1 + 4 / 64) / (1 + 4 / 16)), rel=1e-9)
    assert ProfileStepTime(coef).step_time_s(_decode_plan(10, 1000, 64, True)) == pytest.approx(at16)



@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no measured profiles at {SHARED} (../shared/profiles)")
def test_profiles_validate_writes_its_tables_and_report(tmp_path):
    """sim profiles validate end to end on the measured profiles (one GPU's folder, to stay quick)."""
    root = tmp_path / "vidur"
    (root / "compute").mkdir(parents=True)
    (root / "compute" / "a40").symlink_to(SHARED / "compute" / "a40")
    (root / "COMMIT").write_text((SHARED / "COMMIT").read_text())
    r = CliRunner().invoke(app, ["profiles", "validate", str(root), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "a40: layer MAPE" in r.output
    fits = json.loads((tmp_path / "out" / "fits.json").read_text())
    assert fits["commit"] == (SHARED / "COMMIT").read_text().strip() and "a40" in fits["gpus"]
    assert (tmp_path / "out" / "report.html").stat().st_size > 100_000
    # the layer's signed error by token range: each row the mean over exactly its token counts
    bias, loo = pd.read_csv(tmp_path / "out" / "bias.csv"), pd.read_parquet(tmp_path / "out" / "loo.parquet")
    assert list(bias.tokens) == ["1-16", "17-128", "129-512", "513+", "=128", "=256", "=512"]
    layer = loo[(loo.op == "layer") & (loo.kind == "fitted") & (loo.num_tokens <= 16)]
    assert bias.rows[0] == len(layer)
    assert bias.signed_error[0] == pytest.approx(((layer.predicted_ms / layer.measured_ms).mean() - 1) * 100)
    assert bias.rows[:4].sum() == ((loo.op == "layer") & (loo.kind == "fitted")).sum()
    # a full decode batch (256 tokens): its own mean, and the model and TP degree that err most there
    at = loo[(loo.op == "layer") & (loo.kind == "fitted") & (loo.num_tokens == 256)]
    e = at.predicted_ms / at.measured_ms - 1
    by = e.groupby([at.model, at.tp]).mean()
    assert bias.signed_error[5] == pytest.approx(e.mean() * 100) and bias.rows[5] == len(at)
    assert bias.worst[5] == pytest.approx(by.loc[by.abs().idxmax()] * 100) and bias.worst[:4].isna().all()
    assert f"256 tokens {bias.signed_error[5]:+.1f} % (worst model and TP {bias.worst[5]:+.1f} %)" in r.output
    assert "a40: layer MAPE" in r.output and f"1-16 {bias.signed_error[0]:+.1f} %" in r.output
    assert "error by token range" in (tmp_path / "out" / "report.html").read_text()
    r = CliRunner().invoke(app, ["profiles", "fit", str(root)])
    assert r.exit_code == 0 and "OperatorFit(" in r.output


def test_steptime_default_counts_keep_to_the_models_context():
    """OPT's context is 2,048 tokens: the default 4,096-token row would be a prefill no server runs."""
    r = CliRunner().invoke(app, ["steptime", "opt-13b", "--gpu", "a100-40gb", "--csv"])
    assert r.exit_code == 0, r.output
    assert list(pd.read_csv(__import__("io").StringIO(r.stdout)).tokens) == [1, 16, 256]


def test_steptime_prices_a_models_kv_groups_as_a_run_does():
    """`sim steptime` priced every layer of a sliding-window model as full attention (Gemma-3-27B, a 4,096-token
    chunk over 28,672 cached: 653.7 ms against the 390.9 a run charges); now the run's layout: a row's step
    (one sequence, its last token sampled) costs what a run charges for that plan."""
    from sim.catalog import GPUS, MODELS
    from sim.core import Sequence, StepPlan
    from sim.layouts import kv_layout
    from sim.steptime import RooflineConfig, RooflineStepTime, steptime_rows

    for name, gpu, tp in (("gemma-3-27b", "h100", 1), ("gpt-oss-120b", "h100", 1), ("jamba-v0.1", "h100", 2)):
        m, g = MODELS[name], GPUS[gpu]
        st = RooflineStepTime(m, g, tp, RooflineConfig(), paged=True, layout=kv_layout(m, tp, 16))
        for n, c in ((1, 5000), (4096, 28672)):
            s = Sequence(0, 0.0, c + n, 2)
            s._computed = c
            plan = StepPlan(1, n, n if n > 1 else 0, 1 if n == 1 else 0, 1, c + 1 if n == 1 else 0,
                            0 if n == 1 else n * c + n * (n + 1) // 2, 16, True, _entries=[(s, n)])
            row = steptime_rows(m, g, tp, [n], c)[0]
            assert row["step_ms"] == pytest.approx(st.step_time_s(plan) * 1e3, rel=1e-9), (name, n)


def test_steptime_block_size_has_the_scenarios_bound():
    """--block-size 99999999 was priced (382 ms of attention for one token) where a scenario refuses
    block_size above 65,536."""
    r = CliRunner().invoke(app, ["steptime", "opt-13b", "--gpu", "h100", "--block-size", "99999999"])
    assert r.exit_code == 2 and "--block-size" in r.output and "65536" in r.output, r.output
    r = CliRunner().invoke(app, ["steptime", "opt-13b", "--gpu", "h100", "--block-size", "65536", "--tokens", "1"])
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------------------- all-reduce beyond the measured


def test_an_unmeasured_tp_rides_the_slowest_link_of_its_ring():
    """A ring within the GPU-GPU link's span uses it; past it, PCIe within a server (A40's bridge joins
    pairs); past a server (8 GPUs), the network: an H100 TP 16 all-reduce is not priced at NVLink speed."""
    from sim.catalog import LINKS
    from sim.steptime import OpPricer

    a40, h100 = GPUS["a40"], GPUS["h100"]
    assert a40.ring_link(2)[0] == a40.interconnect_bytes_per_s
    assert a40.ring_link(4)[0] == a40.ring_link(8)[0] == a40.host_bytes_per_s
    assert h100.ring_link(8)[0] == h100.interconnect_bytes_per_s
    assert h100.ring_link(16)[:2] == (LINKS["infiniband-400g"].bytes_per_s, LINKS["infiniband-400g"].latency_s)
    nbytes = 4096 * 8192 * 2
    p16 = OpPricer(MODELS["llama-3-70b"], h100, 16, RooflineConfig())
    assert p16.allreduce_s(nbytes) == pytest.approx(20e-6 + 2 * 15 / 16 * nbytes / 50e9)
    assert p16.allreduce_s(nbytes) > OpPricer(MODELS["llama-3-70b"], h100, 8, RooflineConfig()).allreduce_s(nbytes)
    p8 = OpPricer(MODELS["llama-2-70b"], a40, 8, RooflineConfig())
    assert p8.allreduce_s(nbytes) == pytest.approx(1e-5 + 2 * 7 / 8 * nbytes / 32e9)
    assert "not measured (measured at TP 2, 4, 8)" in p16.allreduce_source
    assert OpPricer(MODELS["llama-3-70b"], h100, 8, RooflineConfig()).allreduce_source.startswith("fitted at TP 8")


def test_steptime_says_what_the_fit_does_not_cover():
    r = CliRunner().invoke(app, ["steptime", "llama-3-70b", "--gpu", "h100", "--tp", "16", "--tokens", "1"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "all-reduce: datasheet ring over infiniband-400g between servers" in r.output
    assert "attention: datasheet efficiencies" in r.output and "MoE experts" not in r.output
    assert ("operators: fitted on H100 80GB SXM; GEMMs computed on whole 128-row tiles past the first"
            in r.output.replace("\n", ""))  # (a console 80 wide wraps it)
    r = CliRunner().invoke(app, ["steptime", "gpt-oss-120b", "--gpu", "h100", "--tokens", "64"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "MoE experts: datasheet efficiencies" in r.output and "all-reduce" not in r.output


def test_an_inline_gpu_says_how_many_gpus_its_link_joins():
    """An inline GPU was always an 8-GPU NVLink domain; L4 has no GPU-GPU link (PCIe only)."""
    from sim.config import GpuConfig, ScenarioError

    g = GpuConfig(name="x", memory_gib=48, hbm_gb_per_s=900, tflops=150, interconnect_gb_per_s=100, link_gpus=2).spec()
    assert g.ring_link(2)[0] == 100e9 and g.ring_link(4)[0] == g.host_bytes_per_s == 32e9
    assert GpuConfig(name="y", memory_gib=48, hbm_gb_per_s=900, tflops=150).spec().link_gpus == 8
    with pytest.raises(ValueError, match="link_gpus"):
        GpuConfig(name="z", memory_gib=48, hbm_gb_per_s=900, tflops=150, link_gpus=0)
    assert GPUS["l4"].ring_link(2)[2] == "PCIe, 32 GB/s (no GPU-GPU link)"


def test_full_batch_rows_only_where_those_token_counts_were_measured():
    from sim.profiles import bias_table

    rows = [{"gpu": "g", "model": m, "tp": 1, "num_tokens": t, "op": "layer", "kind": "fitted", "measured_ms": 1.0,
             "predicted_ms": 1.0 + 0.01 * t} for m in ("a", "b") for t in (1, 64, 200)]
    bias = bias_table(pd.DataFrame(rows))
    assert list(bias.tokens) == ["1-16", "17-128", "129-512"] and bias.worst.isna().all()
    rows += [{"gpu": "g", "model": "a", "tp": 1, "num_tokens": 256, "op": "layer", "kind": "fitted",
              "measured_ms": 1.0, "predicted_ms": 1.3}]
    bias = bias_table(pd.DataFrame(rows))
    assert list(bias.tokens)[-1] == "=256" and bias.worst.iloc[-1] == pytest.approx(30.0)
