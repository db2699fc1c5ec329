"""``sim plan``: the search finds the brute-force optimum with fewer runs than the grid, resumes, writes its
tables and page, and each mistake in a plan file is one clear error."""

from __future__ import annotations

import re
import textwrap

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from sim.config import ScenarioError
from sim.executors import SerialExecutor
from sim.plan import FAILED_AT_LOWER_RATE, load_plan, run_plan
from sim.run import run

runner = CliRunner()

PLAN = """\
name: small
base:
  model: opt-13b
  workload:
    arrival: {kind: poisson, rate: 1}
    lengths: sharegpt
    num_requests: 40
    seed: 1
rates: [4, 16]
slo: {mean_tpot_ms: 26.2}
gpus: [a100-40gb, h100]
prices: {h100: 9.5}
replicas: {min: 1, max: 4}
policies: [vllm]
"""


def plan_file(tmp_path, text: str = PLAN, **replace: str):
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / "p.yaml"
    p.write_text(textwrap.dedent(text))
    return p


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    plan = load_plan(plan_file(out))
    return plan, out, run_plan(plan, out, SerialExecutor())


def test_the_search_finds_the_brute_force_optimum_with_fewer_runs(searched):
    plan, _, result = searched
    brute = []
    for rate in plan.rate_values:
        for shape in plan.shapes:
            for n in range(1, 5):
                scenario = plan.scenario(rate, shape, n).model_copy(update={"record_steps": False})
                summary = run(scenario).policies[shape.policy_name].summary
                brute.append({"rate": rate, **shape.columns(), "replicas": n, "brute": plan.met(summary),
                              "cost": n * plan.spec.price(shape.gpu)})
    brute = pd.DataFrame(brute)
    table = result.table.merge(brute, on=["rate", "gpu", "tensor_parallel", "policy", "replicas"])
    assert len(table) == len(brute) == 2 * 2 * 4
    # every configuration's verdict, run or inferred, is the one a run gives (monotone on this workload)
    assert (table["passed"] == table["brute"]).all(), table[table["passed"] != table["brute"]]
    for rate, b in brute.groupby("rate"):
        cheapest = b[b["brute"]].sort_values("cost").iloc[0]
        best = result.best.set_index("rate").loc[rate]
        assert best["met"]
        assert best["usd_per_hour"] == pytest.approx(cheapest["cost"])
        assert (best["gpu"], best["replicas"]) == (cheapest["gpu"], cheapest["replicas"])
    # the higher rate starts above the lower rate's failures; one or two runs per shape and rate decide all four
    assert result.num_runs == 6 < len(brute)
    assert table["ran"].sum() == result.num_runs
    assert table.loc[~table["ran"], "pruned_by"].notna().all()
    assert table.loc[table["ran"], "pruned_by"].isna().all()
    # both rates' verdicts were searched: the higher one starts from the lower one's answer
    assert (table["pruned_by"] == FAILED_AT_LOWER_RATE).any()
    assert result.failures == []


def test_a_plan_with_disaggregated_splits_finds_the_brute_force_optimum(tmp_path):
    """Prefill:decode splits beside colocated replicas: a split's count is its units (1:3 at 1 unit is 4
    replicas), each verdict and each rate's cheapest configuration are what running the whole grid gives."""
    plan = load_plan(plan_file(tmp_path, **{"policies: [vllm]": "policies: [vllm]\nsplit: [colocated, disaggregated]\n"
                                            "prefill_decode: ['1:1', '1:3']\nkv_transfer: infiniband-400g"}))
    assert [s.pd for s in plan.shapes] == [None, (1, 1), (1, 3)] * 2
    result = run_plan(plan, tmp_path / "o", SerialExecutor())
    brute = []
    for rate in plan.rate_values:
        for shape in plan.shapes:
            lo, hi = shape.counts(plan.spec)
            for n in range(lo, hi + 1):
                scenario = plan.scenario(rate, shape, n).model_copy(update={"record_steps": False})
                assert scenario.cluster.disaggregated == (shape.pd is not None)
                summary = run(scenario).policies[shape.policy_name].summary
                split = shape.split_columns(n)
                brute.append({"rate": rate, **shape.columns(), "split": split["split"],
                              "prefill_decode": split["prefill_decode"], "replicas": shape.replicas(n),
                              "brute": plan.met(summary), "cost": shape.replicas(n) * plan.spec.price(shape.gpu)})
    brute = pd.DataFrame(brute)
    keys = ["rate", "gpu", "policy", "split", "prefill_decode", "replicas"]
    table = result.table.merge(brute, on=keys)
    assert len(table) == len(brute) == len(result.table) == 2 * 2 * (4 + 2 + 1)
    assert (table["passed"] == table["brute"]).all(), table[table["passed"] != table["brute"]]
    assert (table["num_gpus"] == table["replicas"]).all()
    both = table[table["split"] == "disaggregated"]
    assert (both["prefill_replicas"] + both["decode_replicas"] == both["replicas"]).all()
    for rate, b in brute.groupby("rate"):
        best = result.best.set_index("rate").loc[rate]
        assert best["met"] and best["usd_per_hour"] == pytest.approx(b[b["brute"]]["cost"].min())
    assert result.num_runs < len(brute) and result.failures == []


def test_a_rerun_into_the_same_folder_reuses_every_run_and_gives_the_same_tables(searched):
    plan, out, first = searched
    again = run_plan(plan, out, SerialExecutor())
    assert (again.num_runs, again.num_reused) == (0, first.num_runs)
    pd.testing.assert_frame_equal(again.table, first.table)
    pd.testing.assert_frame_equal(again.best, first.best)


def test_sim_plan_writes_the_tables_and_the_page(searched, tmp_path):
    _, out, first = searched
    res = runner.invoke(app, ["plan", str(plan_file(tmp_path)), "--out", str(out), "-j", "1"])
    assert res.exit_code == 0, res.output
    assert "0 runs now" in res.output and "rate 4:" in res.output
    table = pd.read_parquet(out / "plan.parquet")
    assert len(table) == 16 and {"usd_per_hour", "usd_per_million_tokens", "passed", "pruned_by"} <= set(table)
    best = pd.read_csv(out / "best.csv")
    assert list(best["rate"]) == [4.0, 16.0] and best["met"].all()
    # the cheapest GPU changes with the rate: two A100s at the lower one, one H100 at the higher
    assert list(zip(best["gpu"], best["replicas"])) == [("a100-40gb", 2), ("h100", 1)]
    page = (out / "report.html").read_text()
    assert "Pareto front" in page and "Winner:" in page and "plotly" in page
    winners = page[page.index("<h2>Winners</h2>"):page.index("</table>")]
    for head in ("cheapest configuration", "$ per hour", "$ per M tokens", "runner-up"):
        assert head in winners
    assert "point_key" not in winners and "usd_per_hour" not in winners  # (the raw best.csv header)
    assert " 1 shapes" not in page
    # `sim report` rebuilds the page from the folder, as it does a run's
    (out / "report.html").unlink()
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert "Winner:" in (out / "report.html").read_text()


@pytest.mark.parametrize("file, content, message", [
    ("plan.parquet", "junk", "plan.parquet: cannot read (ArrowInvalid"),  # (was "not a plan folder")
    ("best.csv", "junk\n", "best.csv: no 'rate' column (as sim plan writes it)"),  # (a KeyError: 'rate')
])
def test_a_damaged_plan_folder_names_its_file(searched, tmp_path, file, content, message):
    import shutil

    from reports import ResultsError
    from reports.plan import render

    _, out, _ = searched
    d = shutil.copytree(out, tmp_path / "copy")
    (d / file).write_text(content)
    with pytest.raises(ResultsError, match=re.escape(message)):
        render(d)


def test_a_rate_whose_configurations_were_all_inferred_says_so_on_the_page(searched, tmp_path):
    """Every configuration at a rate inferred by monotonicity: no run, so no figure (it drew empty axes)."""
    from reports.plan import render

    _, out, _ = searched
    d = tmp_path / "copy"
    d.mkdir()
    for f in ("plan.json", "best.csv"):
        (d / f).write_text((out / f).read_text())
    table = pd.read_parquet(out / "plan.parquet")
    table.loc[table["rate"] == table["rate"].max(), "ran"] = False
    table.to_parquet(d / "plan.parquet")
    page = render(d)
    assert page.count("Not drawn: no configuration ran at this rate") == 1


@pytest.mark.parametrize("replace, message", [
    ({"gpus: [a100-40gb, h100]": "gpus: [a100-40gb, h10]"}, "gpus: unknown gpu 'h10' (did you mean "
                                                            "'h100'?)"),
    ({"gpus: [a100-40gb, h100]": "gpus: [a100-40gb, h100, l4]"},
     "prices: gpu 'l4' has no price in the catalog: give prices: {l4: <$/GPU-hour>}"),
    ({"prices: {h100: 9.5}": "prices: {h100: 0}"}, "prices: h100: a price must be above 0"),
    ({"{min: 1, max: 4}": "{min: 0, max: 4}"}, "replicas: min must be at least 1 replica (got 0)"),
    ({"{min: 1, max: 4}": "{min: 1, max: -2}"}, "replicas: max (-2) must be at least min (1)"),
    ({"mean_tpot_ms: 26.2": "mean_tpot: 26.2"}, "slo: unknown metric 'mean_tpot' (did you mean "
                                           "'mean_tpot_ms'?)"),
    ({"policies: [vllm]": "split: disaggregated"}, "split disaggregated needs kv_transfer"),
    ({"policies: [vllm]": "split: [colocated, disagg]"},
     "split: unknown split 'disagg'; expected colocated or disaggregated"),
    ({"policies: [vllm]": "split: disaggregated\nkv_transfer: infiniband"}, "kv_transfer: unknown link 'infiniband'"),
    ({"policies: [vllm]": "split: disaggregated\nkv_transfer: nvlink\nprefill_decode: ['1:0']"},
     "prefill_decode: '1:0': expected prefill:decode replicas per unit"),
    # Python's "invalid literal for int()"; Arabic-Indic digits were read
    ({"policies: [vllm]": "split: disaggregated\nkv_transfer: nvlink\nprefill_decode: ['¹:1']"},
     "prefill_decode: '¹:1': expected prefill:decode replicas per unit, whole numbers of 1 or more in the digits 0-9"),
    ({"policies: [vllm]": "split: disaggregated\nkv_transfer: nvlink\nprefill_decode: ['١:1']"},
     "prefill_decode: '١:1': expected prefill:decode replicas per unit, whole numbers of 1 or more in the digits 0-9"),
    ({"policies: [vllm]": "split: disaggregated\nkv_transfer: nvlink\nprefill_decode: ['2:3']"},
     "prefill_decode: a 2:3 unit is 5 replicas, and no whole number of units lies in replicas 1 to 4"),
    ({"policies: [vllm]": "max_num_seqs: [64, 64]"}, "max_num_seqs: a value is listed twice"),  # (read: two policies named vllm)
    ({"slo: {mean_tpot_ms: 26.2}": "slo: {mean_tpot_ms: 26.2, request_throughput: {min: 8}}"},
     "slo: request_throughput: min 8: the plan's search assumes a configuration that fails at a rate fails above it"),
    ({"slo: {mean_tpot_ms: 26.2}": "slo: {mean_tpot_ms: {min: 100, max: 10}}"}, "min 100 is above max 10"),
    ({"slo: {mean_tpot_ms: 26.2}": "slo: {mean_tpot_ms: -5}"}, "mean_tpot_ms: at most -5 can never be met"),
    ({"    seed: 1": "    seed: 1\n  cluster: {prefill: {replicas: 1, gpu: l4}, decode: {replicas: 1},"
                    " kv_transfer: nvlink}"},
     "base.cluster.prefill: the plan sets every configuration's replicas and pools"),
    ({"{min: 1, max: 4}": "{min: 1, max: 1024}", "gpus: [a100-40gb, h100]": "gpus: [a100-40gb, h100]\n"
      "max_num_seqs: [8, 16, 32, 64, 128, 256]\nblock_size: [8, 16, 32, 64, 128]"},
     "122,880 configurations (shapes x replica counts x rates): at most 100,000"),
    ({"policies: [vllm]": "kv_transfer: nvlink"}, "kv_transfer and prefill_decode apply to split: disaggregated"),
    ({"rates: [4, 16]": "rate_scales: [1]\nrates: [2]"}, "give one of 'rates'"),
    ({"rates: [4, 16]": "rates: [4, 4, 16]"}, "rates: a value is listed twice"),
    ({"policies: [vllm]": "policies: [vllm]\nrouter: least-outstandin"},
     "router: unknown router 'least-outstandin'; did you mean 'least-outstanding'"),
    ({"policies: [vllm]": "policies: [vllm, orca-maxx]"}, "orca-maxx"),
    # the plan's policies by the plan's lines and keys (they read "base.policies[0]", "base: policy names ...")
    ({"policies: [vllm]": "policies: [{preset: vllm, blok_size: 32}]"},
     "p.yaml:14: policies[0].blok_size: unknown key (did you mean 'block_size'?)"),
    ({"policies: [vllm]": "policies: [vllm, vllm]"}, "policies: policy names must be unique"),
    ({"prices: {h100: 9.5}": "prices: {h100: true}"}, "prices.h100: expected a number, not true"),
    ({"prices: {h100: 9.5}": "prices: {h100: 1.0e+308}"}, "prices.h100: Input should be less than or equal to"),
    ({"{min: 1, max: 4}": "{min: 1, max: 1000000000}"}, "replicas.max: Input should be less than or equal to 1024"),
    ({"{min: 1, max: 4}": "{min: true, max: 4}"}, "replicas.min: expected a number, not true"),
    ({"policies: [vllm]": "tensor_parallel: [1, 3]"},
     "tensor_parallel: opt-13b: 40 attention heads do not split over tensor_parallel=3"),
    ({"policies: [vllm]": "router: session-affinity"}, "session-affinity needs the trace's session ids"),
    ({"rates: [4, 16]": "rate_scales: [1, 2]"}, "rate_scales: the base workload is generated: give rates"),
    # nothing can run: `sim check` said so, `sim plan` ran every shape and exited 1 with a "failed:" line each
    ({"model: opt-13b": "model: llama-2-70b", "gpus: [a100-40gb, h100]": "gpus: [a100-40gb]", "prices: {h100: 9.5}\n": ""},
     "p.yaml: no shape of the plan can run: vllm on a100-40gb tp1: small: llama-2-70b does not fit on a100-40gb"),
    ({"policies: [vllm]": "policies: [fastertransformer]\nsplit: disaggregated\nkv_transfer: nvlink"},
     "no shape of the plan can run: fastertransformer on a100-40gb tp1 1:1: cluster.prefill (a100-40gb tp1): policy "
     "fastertransformer: static batching is not simulated with prefill/decode disaggregation"),
    # every rate checked at load (the lowest ran and was stored first, then the error came without its key)
    ({"rates: [4, 16]": "rates: [4, 1.0e+13]"}, "rates: 1e+13: point rate="),
])
def test_each_mistake_in_a_plan_is_one_clear_error(tmp_path, replace, message):
    path = plan_file(tmp_path, **replace)
    with pytest.raises(ScenarioError) as e:
        load_plan(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)
    res = runner.invoke(app, ["plan", str(path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert message.split(":")[0] in res.output


def test_a_ratio_written_without_quotes_is_a_ratio(tmp_path):
    """YAML 1.1 read 1:3 as the base-60 number 63 ("Input should be a valid string (got 63)")."""
    plan = load_plan(plan_file(tmp_path, **{"policies: [vllm]": "split: disaggregated\nkv_transfer: nvlink\n"
                                                               "prefill_decode: [1:3, 1:1]"}))
    assert plan.spec.ratios == [(1, 3), (1, 1)]


def test_a_shape_that_cannot_run_is_reported_and_the_others_are_searched(tmp_path):
    path = plan_file(tmp_path, **{"model: opt-13b": "model: llama-2-70b", "gpus: [a100-40gb, h100]":
                                  "gpus: [a100-40gb]\ntensor_parallel: [1, 4]", "prices: {h100: 9.5}\n": ""})
    result = run_plan(load_plan(path), tmp_path / "o", SerialExecutor())
    t = result.table
    tp1, tp4 = t[t["tensor_parallel"] == 1], t[t["tensor_parallel"] == 4]
    assert tp1["error"].str.contains("does not fit on a100-40gb").all() and tp1["passed"].isna().all()
    assert tp1["ran"].sum() == 1  # one run shows the shape cannot run; its other rows say so
    assert (tp1.loc[~tp1["ran"], "pruned_by"] == "this shape's run failed").all()
    assert tp4["error"].isna().all() and tp4["ran"].any()
    assert len(result.failures) == 1 and "vllm on a100-40gb tp1 at rate 4" in result.failures[0][0]


def test_a_deployment_that_rejects_requests_another_serves_fails_at_every_count(tmp_path):
    """At 0.65 of an A100-40GB's memory OPT-13B's pool (about 1,600 tokens) cannot hold the longest
    requests, which an H100 serves: they were rejected, and latencies over the finished rest met the SLO,
    so the cheaper GPU won while serving less of the traffic. Now that shape fails at every count and rate
    (one run decides it); a plan that bounds ``num_rejected`` itself keeps its own bound."""
    text = PLAN.replace("    seed: 1\n", "    seed: 1\n  gpu_memory_utilization: 0.65\n").replace(
        "slo: {mean_tpot_ms: 26.2}", "slo: {mean_tpot_ms: 1000}").replace(
        "lengths: sharegpt", "prompt: {kind: uniform, low: 100, high: 1800}\n    output: {kind: fixed, tokens: 100}")
    result = run_plan(load_plan(plan_file(tmp_path, text)), tmp_path / "o", SerialExecutor())
    t = result.table
    a100, h100 = t[t["gpu"] == "a100-40gb"], t[t["gpu"] == "h100"]
    ran = a100[a100["ran"]]
    assert len(ran) == 1 and (ran["num_rejected"] > ran["num_rejected_max_model_len"]).all()
    assert (ran["mean_tpot_ms"] < 1000).all() and not ran["passed"].any()  # its latencies alone would pass
    assert (a100.loc[~a100["ran"], "pruned_by"] == "this shape rejects requests at any count").all()
    assert not a100["passed"].any() and (h100["num_rejected"].dropna() == 0).all()
    assert (result.best["gpu"] == "h100").all() and (result.best["replicas"] == 1).all()
    # the plan's own bound on rejections decides instead
    bounded = text.replace("slo: {mean_tpot_ms: 1000}", "slo: {mean_tpot_ms: 1000, num_rejected: {max: 40}}")
    result = run_plan(load_plan(plan_file(tmp_path, bounded)), tmp_path / "o2", SerialExecutor())
    assert (result.best["gpu"] == "a100-40gb").all()


def test_max_length_rejections_are_held_against_no_deployment(tmp_path):
    plan = load_plan(plan_file(tmp_path))
    ok = {"mean_tpot_ms": 20.0, "num_rejected": 0, "num_rejected_max_model_len": 0, "num_unfinished": 0}
    assert plan.met(ok)
    # requests longer than the model's max length are rejected by every deployment alike
    assert plan.met({**ok, "num_rejected": 2, "num_rejected_max_model_len": 2})
    assert not plan.met({**ok, "num_rejected": 3, "num_rejected_max_model_len": 2})
    # requests left at a horizon are not held against one (those arriving after it, or still running, count too)
    assert plan.met({**ok, "num_unfinished": 3})



def test_what_the_plan_leaves_out_the_base_gives(tmp_path):
    """The base's policies, tensor parallelism and router ran as the plan's defaults (vllm, TP 1,
    least-outstanding) with no notice; the plan's own keys still win where both give them."""
    from sim.plan import load_plan

    base = ("base: {model: llama-3-8b, tensor_parallel: 2, policies: [orca-oracle], cluster: {router: random},\n"
            "       workload: {arrival: {kind: poisson, rate: 2}, lengths: sharegpt, num_requests: 20, seed: 1}}\n"
            "rates: [2]\nslo: {p99_ttft_ms: 5000}\ngpus: [h100]\nreplicas: {min: 1, max: 2}\n")
    p = tmp_path / "p.yaml"
    p.write_text(base)
    plan = load_plan(p)
    assert [(s.tensor_parallel, s.policy_name) for s in plan.shapes] == [(2, "orca-oracle")]
    assert plan.spec.router == "random"
    p.write_text(base + "tensor_parallel: [1]\npolicies: [vllm]\nrouter: least-kv\n")
    plan = load_plan(p)
    assert [(s.tensor_parallel, s.policy_name) for s in plan.shapes] == [(1, "vllm")]
    assert plan.spec.router == "least-kv"
    p.write_text(base.replace("router: random", "router: [random, least-kv]"))
    with pytest.raises(ScenarioError, match=r"base.cluster.router: a plan runs one router"):
        load_plan(p)


def test_a_rate_nothing_meets_names_the_nearest_run_and_the_bound_it_missed(tmp_path):
    """"nothing in the plan meets the SLO" said nothing of how far the plan was from it."""
    p = tmp_path / "p.yaml"
    p.write_text("base: {model: llama-3-8b, policies: [vllm],\n"
                 "       workload: {arrival: {kind: poisson, rate: 2}, lengths: alpaca, num_requests: 20, seed: 1}}\n"
                 "rates: [2]\nslo: {p99_ttft_ms: 1}\ngpus: [h100]\nreplicas: {min: 1, max: 2}\n")
    res = runner.invoke(app, ["plan", str(p), "--out", str(tmp_path / "out"), "-j", "1", "--no-report"])
    assert res.exit_code == 0, res.output
    best = pd.read_csv(tmp_path / "out" / "best.csv")
    near = best.loc[0, "nearest"]
    ran = pd.read_parquet(tmp_path / "out" / "plan.parquet").query("ran")
    fastest = ran.loc[ran.p99_ttft_ms.idxmin()]  # the run nearest the bound
    assert not best.loc[0, "met"]
    assert near == f"{fastest.replicas} x h100 tp1 vllm: p99_ttft_ms {fastest.p99_ttft_ms:,.4g} (at most 1)"
    assert f"nothing in the plan meets the SLO; nearest: {near}" in res.output.replace("\n", "")
    p.write_text(p.read_text().replace("rates: [2]", "rates: [2, 8]"))  # 8: inferred from 2's failures, not run
    res = runner.invoke(app, ["plan", str(p), "--out", str(tmp_path / "out8"), "-j", "1", "--no-report"])
    assert "rate 8: nothing in the plan meets the SLO; none ran at this rate: each configuration failed at a lower" \
        in res.output.replace("\n", ""), res.output


def test_a_plan_over_a_retimed_trace_takes_rates(tmp_path):
    """A trace re-timed by `arrival` has a rate as a generated workload does (sim.config.own_arrivals, the rule a
    sweep's capacity axis follows too); a plan refused it both ways: rates ("a trace, with its own arrival times")
    and rate_scales ("give either 'arrival' or 'rate_scale'")."""
    (tmp_path / "t.csv").write_text("num_prefill_tokens,num_decode_tokens\n" + "100,20\n" * 40)
    trace = ("workload:\n    kind: trace\n    path: t.csv\n    arrival: {kind: poisson, rate: 1}\n"
             "    num_requests: 40\n    seed: 1\n")
    path = plan_file(tmp_path, **{"workload:\n    arrival: {kind: poisson, rate: 1}\n    lengths: sharegpt\n"
                                  "    num_requests: 40\n    seed: 1\n": trace})
    plan = load_plan(path)
    assert plan.rate_values == [4, 16]
    assert plan.scenario(16, plan.shapes[0], 1).workload.arrival.rate == 16
    own = plan_file(tmp_path, **{"rates: [4, 16]": "rate_scales: [1, 2]",
                                 "workload:\n    arrival: {kind: poisson, rate: 1}\n    lengths: sharegpt\n"
                                 "    num_requests: 40\n    seed: 1\n": trace.replace(
                                     "    arrival: {kind: poisson, rate: 1}\n", "")})
    assert load_plan(own).rate_values == [1, 2]
