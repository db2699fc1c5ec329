"""The knob-by-knob decomposition (sim/decompose.py) and the fair presets it relies on."""

import json

import pytest

from reports import figures
from reports.console import decomposition_lines
from reports.html import decomposition_table
from sim.config import POLICY_PRESETS, PolicyConfig, _expand_policy, parse_scenario
from sim.decompose import DECOMPOSED_METRICS, KNOBS, chain, decompose, policy_fields, policy_key
from sim.run import run, run_to_dir, write_results


def preset(which: str, **over) -> PolicyConfig:
    return PolicyConfig.model_validate(_expand_policy({"preset": which, **over}))


# ------------------------------------------------------------------------------------- the fair presets


@pytest.mark.parametrize("reserve", ["max", "pow2", "oracle"])
def test_fair_orca_presets_differ_from_vllm_only_in_the_kv_manager(reserve):
    orca, vllm = policy_fields(preset(f"orca-{reserve}")), policy_fields(preset("vllm"))
    assert orca["allocator"] == {"kind": "contiguous", "reserve": reserve, "placement": "buddy"}
    assert vllm["allocator"]["kind"] == "paged"
    assert {k: v for k, v in orca.items() if k != "allocator"} == {k: v for k, v in vllm.items() if k != "allocator"}
    # the decomposition agrees: from orca-* to vllm, only the allocator changes
    steps, _ = chain(preset(f"orca-{reserve}"), preset("vllm"))
    assert [s.knobs for s in steps] == [("paged allocation",)]


@pytest.mark.parametrize("reserve", ["max", "pow2", "oracle"])
def test_mixed_orca_presets_differ_from_the_fair_ones_only_in_prefill(reserve):
    fair, mixed = policy_fields(preset(f"orca-{reserve}")), policy_fields(preset(f"orca-{reserve}-mixed"))
    assert fair["prefill"] == "separate" and mixed["prefill"] == "mixed"
    assert {k: v for k, v in fair.items() if k != "prefill"} == {k: v for k, v in mixed.items() if k != "prefill"}


def test_every_preset_is_a_valid_policy():
    for name in POLICY_PRESETS:
        assert preset(name).name == name


# ------------------------------------------------------------------------------------- chains


def test_chain_changes_one_knob_at_a_time_in_order_and_ends_at_the_target():
    target = preset("vllm-v1", block_size=32, max_num_seqs=64)
    steps, unchanged = chain(preset("fastertransformer"), target)
    assert [s.label for s in steps] == ["batching", "paged allocation", "prefill", "block size", "other"]
    assert unchanged == ["reservation"]
    assert steps[0].changes == {"batching": ["static", "continuous"]}
    assert steps[-1].changes == {"max_num_seqs": [256, 64]}
    assert policy_key(steps[-1].policy) == policy_key(target)


def test_a_knob_that_alone_gives_no_valid_policy_is_merged_with_the_next():
    # vllm -> fastertransformer: static batching with paged blocks does not exist
    steps, unchanged = chain(preset("vllm"), preset("fastertransformer"))
    assert [s.knobs for s in steps] == [("batching", "paged allocation")]
    assert unchanged == ["reservation", "prefill", "block size", "other"]
    assert policy_key(steps[0].policy) == policy_key(preset("fastertransformer"))


def test_identical_policies_have_no_steps():
    steps, unchanged = chain(preset("vllm"), preset("vllm", name="again"))
    assert steps == [] and unchanged == list(KNOBS)


# ------------------------------------------------------------------------------------- shares


def fake_summary(p: PolicyConfig) -> dict:
    """A made-up but deterministic function of the policy, with interactions between knobs."""
    paged = p.allocator.kind == "paged"
    reserve = {"max": 1.0, "pow2": 2.0, "oracle": 3.0}.get(getattr(p.allocator, "reserve", ""), 5.0)
    cont = 2.0 if p.batching == "continuous" else 1.0
    x = cont * reserve * (1.3 if p.prefill == "mixed" else 1.0) + 0.01 * p.block_size + (0.7 if paged else 0.0)
    return {"request_throughput": x, "output_throughput": 300 * x, "mean_normalized_latency_s": 1 / x,
            "median_ttft_ms": 1000 / x ** 2, "median_tpot_ms": None if p.block_size == 64 else 20 + x}


def test_shares_add_up_to_the_total_difference_and_intermediates_run_once():
    policies = [preset("fastertransformer"), preset("orca-pow2-mixed"), preset("orca-oracle"),
                preset("vllm-v1", block_size=32), preset("vllm", name="v-sw", preemption="swap", swap_space_gib=1)]
    summaries = {p.name: fake_summary(p) for p in policies}
    calls = []

    def run_policy(p):
        calls.append(policy_key(p))
        return fake_summary(p)

    d = decompose(policies, summaries, run_policy)
    assert len(calls) == len(set(calls)) == d["num_intermediate_runs"] > 0  # each distinct intermediate once
    assert not set(calls) & {policy_key(p) for p in policies}  # the scenario's own policies never run again
    for name, t in d["targets"].items():
        for m in DECOMPOSED_METRICS:
            total = t["total"][m]
            assert total == pytest.approx(summaries[name][m] - summaries["fastertransformer"][m], rel=1e-12)
            assert sum(s["share"][m] for s in t["steps"]) == pytest.approx(total, rel=1e-9, abs=1e-12), (name, m)
        assert t["steps"][-1]["same_as"] == name
    assert [s["label"] for s in d["targets"]["orca-pow2-mixed"]["steps"]] == ["batching", "reservation", "prefill"]
    assert d["targets"]["orca-pow2-mixed"]["steps"][0]["same_as"] is None  # orca-max (fair) is not in the scenario


def test_a_missing_value_gives_no_share_rather_than_a_wrong_one():
    policies = [preset("vllm"), preset("vllm", name="b64", block_size=64)]
    d = decompose(policies, {p.name: fake_summary(p) for p in policies}, fake_summary)
    t = d["targets"]["b64"]
    assert t["total"]["median_tpot_ms"] is None and t["steps"][0]["share"]["median_tpot_ms"] is None


def test_unknown_metric_is_named():
    with pytest.raises(ValueError, match="'mean_batch'"):
        decompose([preset("vllm"), preset("orca-max")], {}, fake_summary, metrics=["mean_batch"])


# ------------------------------------------------------------------------------------- real runs


def small(**over):
    return parse_scenario(small_data(**over))


def small_data(**over) -> dict:
    data = {"name": "d", "model": "opt-13b", "gpu": "a100-40gb",
            "workload": {"arrival": {"kind": "poisson", "rate": 5.0}, "lengths": "sharegpt", "num_requests": 60,
                         "seed": 4},
            "policies": ["orca-max-mixed", "vllm", {"preset": "vllm-v1", "name": "v1-bs32", "block_size": 32},
                         {"preset": "vllm", "name": "v-idle-knobs", "swap_space_gib": 1, "max_num_seqs": 255}]}
    data.update(over)
    return data


def test_real_runs_telescope_and_a_knob_without_effect_has_zero_share(tmp_path):
    r = run(small(), decompose=True)
    d = r.decomposition
    s = {n: p.summary for n, p in r.policies.items()}
    assert d["base"] == "orca-max-mixed" and d["num_intermediate_runs"] >= 1
    assert [x["label"] for x in d["targets"]["v1-bs32"]["steps"]] == ["paged allocation", "prefill", "block size"]
    for name, t in d["targets"].items():
        for m in DECOMPOSED_METRICS:
            total = s[name][m] - s["orca-max-mixed"][m]
            assert t["total"][m] == total
            assert sum(x["share"][m] for x in t["steps"]) == pytest.approx(total, rel=1e-9, abs=1e-9), (name, m)
    # swap space under recompute, and a sequence cap that never binds: the "other" step changes nothing
    other = d["targets"]["v-idle-knobs"]["steps"][-1]
    assert other["knobs"] == ["other"] and set(other["changes"]) == {"swap_space_gib", "max_num_seqs"}
    assert all(v == 0.0 for v in other["share"].values())
    # summary.json carries it, and the report draws it (the whole page: tests/test_report_page.py)
    write_results(r, tmp_path, report=False)
    saved = json.loads((tmp_path / "summary.json").read_text())["decomposition"]
    assert saved["targets"]["vllm"]["total"] == d["targets"]["vllm"]["total"]
    table = decomposition_table(saved)
    assert table.count("<tr>") == 1 + sum(len(t["steps"]) + 2 for t in saved["targets"].values())
    assert "+ prefill" in table and "swap_space_gib: 4.0 → 1.0" in table
    lines = decomposition_lines(saved)  # what sim run prints under its table
    assert lines[0].startswith("what each knob explains, from orca-max-mixed") and len(lines) == 4
    assert lines[-1].startswith("  v-idle-knobs: ") and "other +0 req/s, +0 s/token" in lines[-1]
    fig = figures.decomposition(saved)
    bars = [tr for tr in fig.data if tr.type == "bar"]
    assert {tr.name for tr in bars} == {"paged allocation", "prefill", "block size", "other"}


def test_sim_run_decomposes_unless_the_scenario_says_not_to(tmp_path):
    path = tmp_path / "s.yaml"
    data = small_data(workload={"arrival": {"kind": "poisson", "rate": 5.0}, "lengths": "alpaca", "num_requests": 10})
    path.write_text(json.dumps(data))
    summary, _ = run_to_dir(path, tmp_path / "on", report=False)
    assert set(summary["decomposition"]["targets"]) == {"vllm", "v1-bs32", "v-idle-knobs"}
    path.write_text(json.dumps({**data, "decompose": False}))
    summary, _ = run_to_dir(path, tmp_path / "off", report=False)
    assert "decomposition" not in summary
    assert run(small()).decomposition is None  # the Python API (sweeps, the GPU replay) only when asked
