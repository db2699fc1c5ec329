"""The calibrated step-time model (``step_time: {kind: profile}``): needs no torch."""

import json

import numpy as np
import pytest

from sim.catalog import MODELS
from sim.config import ScenarioError
from sim.core import StepPlan
from sim.run import run
from sim.steptime import PROFILE_FORMAT, PROFILE_TERMS, ProfileStepTime, load_profile, profile_model
from test_engine import assert_same_requests

COEF = {"prefill_s": 2e-3, "prefill_token_s": 5e-5, "prefill_pair_s": 1e-8, "decode_s": 1e-3, "decode_seq_s": 4e-5,
        "decode_key_s": 2e-7}


def write_profile(path, model="opt-13b", paged_scale=1.1, **over):
    prof = {"format": PROFILE_FORMAT, "model": profile_model(MODELS[model]), "swap_block_s": 1e-5,
            "provenance": {"device": "test", "date": "2026-01-01"},
            "layouts": {"paged": {"coefficients": {k: v * paged_scale for k, v in COEF.items()}, "fit": {}},
                        "contiguous": {"coefficients": dict(COEF), "fit": {}}}}
    prof.update(over)
    path.write_text(json.dumps(prof))
    return path


def test_mixed_step_is_the_sum_of_its_parts():
    p = ProfileStepTime(COEF, swap_block_s=1e-5)
    # two prefill chunks (100 new over 0 cached, 50 new over 30 cached) and three decodes
    plan = StepPlan.from_entries((0, 1, 2, 3, 4), (100, 50, 1, 1, 1), (0, 30, 9, 19, 29), 4, 16, swap_in=((0, 1),))
    pre = COEF["prefill_s"] + 150 * COEF["prefill_token_s"] + (5050 + 50 * 30 + 1275) * COEF["prefill_pair_s"]
    dec = COEF["decode_s"] + 3 * COEF["decode_seq_s"] + (10 + 20 + 30) * COEF["decode_key_s"]
    assert p.step_time_s(plan) == pytest.approx(pre + dec + 1e-5, rel=1e-12)


def test_decode_span_matches_step_by_step():
    p = ProfileStepTime(COEF)
    plan = StepPlan.from_entries((0, 1), (1, 1), (10, 20), 2, 16)
    span = p.decode_span_s(plan, 4)
    each = [p.step_time_s(StepPlan.from_entries((0, 1), (1, 1), (10 + j, 20 + j), 2, 16)) for j in range(4)]
    np.testing.assert_allclose(span, each, rtol=1e-12)


def test_scenario_with_a_profile_runs_and_spans_equal_exact(tmp_path, make_scenario):
    write_profile(tmp_path / "p.json")
    s = make_scenario(step_time={"kind": "profile", "path": "p.json"},
                      workload={"arrival": {"kind": "poisson", "rate": 4.0}, "lengths": "alpaca", "num_requests": 80})
    s._base_dir = tmp_path
    fast = run(s)
    exact = run(s.model_copy(update={"exact": True}))
    for name, f in fast.policies.items():  # spans give stepping's answers, request by request
        e = exact.policies[name]
        assert_same_requests(e.requests, f.requests)
        assert f.summary["num_steps"] == e.summary["num_steps"] and f.summary["num_finished"] == 80
        assert f.steps.duration_s.sum() == pytest.approx(e.steps.duration_s.sum(), rel=1e-9)
    # the paged coefficients are 10% larger: with them equal, vllm's steps (paged) are priced lower and
    # the contiguous policies' are unchanged
    write_profile(tmp_path / "p.json", paged_scale=1.0)
    same = run(s)
    for name in ("fastertransformer", "orca-max", "orca-oracle"):
        assert_same_requests(same.policies[name].requests, fast.policies[name].requests)
    busy = {r: x.policies["vllm"].steps.duration_s.sum() for r, x in (("1.1", fast), ("1.0", same))}
    assert busy["1.0"] < busy["1.1"], busy


def test_profile_errors_name_the_problem(tmp_path):
    spec = MODELS["opt-13b"]
    with pytest.raises(ScenarioError, match="no such step-time profile"):
        load_profile(tmp_path / "missing.json", spec)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ScenarioError, match="not valid JSON"):
        load_profile(tmp_path / "bad.json", spec)
    with pytest.raises(ScenarioError, match="expected format"):
        load_profile(write_profile(tmp_path / "f.json", format="other"), spec)
    with pytest.raises(ScenarioError, match="is not the model priced"):
        load_profile(write_profile(tmp_path / "m.json", model="llama-3-8b"), spec)
    bare = json.loads(write_profile(tmp_path / "b.json").read_text())
    del bare["model"]
    (tmp_path / "b.json").write_text(json.dumps(bare))
    with pytest.raises(ScenarioError, match="b.json: model: missing"):  # (was "profiled model None is not ...")
        load_profile(tmp_path / "b.json", spec)
    neg = {"paged": {"coefficients": {**COEF, "decode_s": -1.0}}, "contiguous": {"coefficients": COEF}}
    with pytest.raises(ScenarioError, match=r"coefficients: decode_s: expected a finite number >= 0 of seconds \(got -1.0\)"):
        load_profile(write_profile(tmp_path / "n.json", layouts=neg), spec)
    assert set(PROFILE_TERMS) == set(COEF)


@pytest.mark.parametrize("over,message", [
    ({"layouts": []}, "layouts: expected a mapping, got list"),
    ({"layouts": {"paged": "x", "contiguous": {"coefficients": COEF}}}, "layouts.paged: expected a mapping, got str"),
    ({"layouts": {"paged": {"coefficients": [1]}, "contiguous": {"coefficients": COEF}}},
     "layouts.paged.coefficients: expected a mapping, got list"),
    ({"layouts": {"paged": {"coefficients": {**COEF, "decode_s": float("nan")}}, "contiguous": {"coefficients": COEF}}},
     "coefficients: decode_s: expected a finite number >= 0 of seconds (got nan)"),
    ({"layouts": {"paged": {"coefficients": {**COEF, "prefill_s": True}}, "contiguous": {"coefficients": COEF}}},
     "coefficients: prefill_s: expected a finite number >= 0 of seconds (got True)"),
    ({"model": "opt-13b"}, "model: expected a mapping, got str"),
    # each read without a word: a term the model lacks (its cost left out), another model's terms, no model
    ({"layouts": {"paged": {"coefficients": {**COEF, "extra_s": 1.0}}, "contiguous": {"coefficients": COEF}}},
     "layouts.paged.coefficients: unknown term 'extra_s'; the profile's terms are prefill_s,"),
    ({"terms": ["x"]}, "terms: ['x']; this step-time model's are"),
    ({"model": None}, "model: expected a mapping, got NoneType"),
    ({"swap_block_s": "abc"}, "swap_block_s: expected a finite number of seconds from 0 to 1,000 (got 'abc')"),
    ({"swap_block_s": -1e-5}, "swap_block_s: expected a finite number of seconds from 0 to 1,000 (got -1e-05)"),
    ({"swap_block_s": 1e300}, "swap_block_s: expected a finite number of seconds from 0 to 1,000 (got 1e+300)"),
    ({"paged_block_cost_tokens": float("inf")}, "paged_block_cost_tokens: expected a finite number of tokens from 0"),
    ({"paged_block_cost_tokens": 1e9}, "paged_block_cost_tokens: expected a finite number of tokens from 0 to 65,536"),
    ({"block_size": 0}, "block_size: expected a whole number of tokens from 1 to 65,536 (got 0)"),
    ({"block_size": "16"}, "block_size: expected a whole number of tokens from 1 to 65,536 (got '16')"),
    ({"block_size": 10**30}, "block_size: expected a whole number of tokens from 1 to 65,536"),
    # a ZeroDivisionError traceback in the engine (a decode step of no time)
    ({"layouts": {"paged": {"coefficients": dict.fromkeys(COEF, 0.0)}, "contiguous": {"coefficients": COEF}}},
     "layouts.paged.coefficients: prefill_s, prefill_token_s, prefill_pair_s are all 0: a prefill step would take"),
    ({"layouts": {"paged": {"coefficients": COEF}, "contiguous": {"coefficients": {
        **COEF, "decode_s": 0, "decode_seq_s": 0, "decode_key_s": 0}}}},
     "layouts.contiguous.coefficients: decode_s, decode_seq_s, decode_key_s are all 0: a decode step would take no"),
    # ran, every step 1e300 s
    ({"layouts": {"paged": {"coefficients": {**COEF, "decode_s": 1e300}}, "contiguous": {"coefficients": COEF}}},
     "layouts.paged.coefficients: decode_s: more than 1,000 s per unit (got 1e+300)"),
])
def test_a_malformed_profile_is_one_error_naming_the_key(tmp_path, over, message):
    """Each was a traceback (AttributeError, TypeError, ZeroDivisionError) or, for NaN, a nan step time."""
    import re

    path = write_profile(tmp_path / "p.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **over}))
    with pytest.raises(ScenarioError, match=re.escape(message)):
        load_profile(path, MODELS["opt-13b"])


def test_profile_kind_in_scenario_files(tmp_path, make_scenario):
    from sim.config import ProfileConfig

    s = make_scenario(step_time={"kind": "profile", "path": "x.json"})
    assert isinstance(s.step_time, ProfileConfig)
    with pytest.raises(ScenarioError, match="step_time.path"):
        make_scenario(step_time={"kind": "profile"})
    with pytest.raises(ScenarioError, match="no such step-time profile"):
        run(s)


def test_a_profile_measured_on_another_gpu_is_refused(tmp_path):
    """A profile prices its own GPU's steps: an H100's applied to an L4 replica (or a plan's L4) gave the L4
    the H100's step times, and a plan picked the L4 for it. A device the catalog cannot name (a CPU, a test
    device) is not checked."""
    import yaml

    from sim.plan import load_plan
    from sim.run import check_scenario
    from sim.steptime import measured_gpu

    assert [measured_gpu(d) for d in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe",
                                      "NVIDIA L40S", "test")] == ["h100", "a100-40gb", "a100-80gb", None, None]
    write_profile(tmp_path / "p.json", model="llama-3-8b", provenance={"device": "NVIDIA H100 80GB HBM3"})
    base = {"model": "llama-3-8b", "step_time": {"kind": "profile", "path": "p.json"},
            "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "alpaca", "num_requests": 10}}
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump({"name": "ok", "gpu": "h100", "policies": ["vllm"], **base}))
    check_scenario(tmp_path / "ok.yaml")
    inline = {"name": "h100-40g", "memory_gib": 40, "hbm_gb_per_s": 3350, "tflops": 989}  # no device names it
    (tmp_path / "inline.yaml").write_text(yaml.safe_dump({"name": "i", "gpu": inline, "policies": ["vllm"], **base}))
    check_scenario(tmp_path / "inline.yaml")
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({
        "name": "fleet", "gpu": "h100", "policies": ["vllm"], **base,
        "cluster": {"replicas": [{"gpu": "h100", "count": 1}, {"gpu": "l4", "count": 1}]}}))
    with pytest.raises(ScenarioError, match=r"measured on 'NVIDIA H100 80GB HBM3' \(h100\), and this run's GPU is l4"):
        check_scenario(tmp_path / "fleet.yaml")
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({
        "base": base, "rates": [2.0], "slo": {"p99_ttft_ms": 5000}, "gpus": ["h100", "l4"], "prices": {"l4": 1.0},
        "replicas": {"min": 1, "max": 2}}))
    with pytest.raises(ScenarioError, match=r"gpus: l4: .*measured on 'NVIDIA H100 80GB HBM3'"):
        load_plan(tmp_path / "plan.yaml")


def test_sim_steptime_with_a_profile_says_its_figures_are_the_profiles(tmp_path):
    """Its footer said "operators: datasheet roofline" under a table of the profile's measured step times."""
    from typer.testing import CliRunner

    from cli import app

    path = write_profile(tmp_path / "p.json")
    r = CliRunner().invoke(app, ["steptime", "opt-13b", "--gpu", "h100", "--step-time", str(path), "--tokens", "1,64"])
    assert r.exit_code == 0, r.output
    assert f"operators: a calibration profile's measured step times ({path})" in r.output.replace("\n", "")
    assert "datasheet roofline" not in r.output
    write_profile(path, provenance={"device": "NVIDIA H100 80GB HBM3"})
    r = CliRunner().invoke(app, ["steptime", "opt-13b", "--gpu", "l4", "--step-time", str(path), "--tokens", "1"])
    assert r.exit_code == 2 and "and this run's GPU is l4" in r.output, r.output  # (printed H100's figures as L4's)


def test_a_profile_does_not_price_fp8_kv(tmp_path):
    """The profile's KV cache is in the model's dtype: an fp8 policy ran at its bf16 step times, saying nothing."""
    import yaml

    from sim.run import check_scenario

    write_profile(tmp_path / "p.json", model="llama-3-8b", provenance={"device": "NVIDIA H100 80GB HBM3"})
    scenario = {"name": "f", "model": "llama-3-8b", "gpu": "h100", "step_time": {"kind": "profile", "path": "p.json"},
                "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "alpaca", "num_requests": 10},
                "policies": ["vllm", {"preset": "vllm", "name": "fp8", "kv_cache_dtype": "fp8"}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    with pytest.raises(ScenarioError, match=r"p.json: measured with the KV cache in the model's dtype .* stores it as "
                                            r"fp8 \(kv_cache_dtype\)"):
        check_scenario(tmp_path / "s.yaml")
    scenario["policies"] = ["vllm"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    check_scenario(tmp_path / "s.yaml")
