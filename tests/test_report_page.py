"""The HTML page from real run folders, `sim report` (rebuild, compare, sweeps, errors), and the size bound."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from plotly.offline import get_plotlyjs
from tables import requests_table, snapshot_table, sweep_table, timeline_table
from typer.testing import CliRunner

from cli import app
from reports.html import build_report, write_report
from reports.results import load_run, run_labels
from sim.config import parse_scenario
from kvsim import write_results
from sim.run import run

runner = CliRunner()


# ------------------------------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A real run folder: 60 Alpaca-like requests, an Orca and a vLLM policy."""
    scenario = parse_scenario({
        "name": "small", "model": "opt-13b", "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 3.0}, "lengths": "alpaca", "num_requests": 60, "seed": 5},
        "policies": ["orca-oracle", "vllm"]})
    d = tmp_path_factory.mktemp("run") / "small"
    write_results(run(scenario, decompose=True), d, report=False)
    return d


FIGURE_JSON = re.compile(r'<script type="application/json" class="kvsim-figure"[^>]*>(.*?)</script>', re.S)


def figure_specs(page: str) -> list[dict]:
    """Every figure's {data, layout} as the page carries it."""
    return [json.loads(m) for m in FIGURE_JSON.findall(page)]


def test_page_inlines_plotly_once_and_every_figure(small_run):
    page = write_report(small_run).read_text(encoding="utf-8")
    js = get_plotlyjs()
    assert page.count(js[:2000]) == 1
    ours = page.replace(js, "")  # plotly.js itself names CDNs for features we do not use (maps, MathJax)
    assert "<script src" not in ours and "http" not in ours.lower()
    specs = figure_specs(page)
    titles = [s["layout"]["title"]["text"] for s in specs]
    assert titles == ["KV cache memory: where it goes", "What each knob explains: difference from orca-oracle",
                      "KV cache memory, batch size and queue over time",
                      "KV address space, each policy at its own busiest moment", "Latency distributions (finished requests)",
                      "Throughput and preemptions over time"]
    assert all("template" not in s["layout"] for s in specs) and page.count("const KVSIM_TEMPLATE") == 1
    assert "Orca (Oracle), paper" in json.dumps(specs[0])  # OPT-13B, Alpaca-like, Poisson: one of the paper's
    assert "14,720 tokens = 11.23 GiB (12.06 GB)" in page
    table = page[page.index("<h2>Summary</h2>"):page.index("<h2>Decomposition")]
    assert table.count("<tr>") == 6 and 'class="best"' in table  # two tables (each fits 900 px), 2 policies
    decomposition = page[page.index("<h2>Decomposition"):page.index("<h2>Figures</h2>")]
    assert "+ paged allocation = vllm" in decomposition and "allocator.kind: contiguous → paged" in decomposition


def test_same_colour_for_a_policy_in_every_figure(small_run):
    specs = figure_specs((small_run / "report.html").read_text() if (small_run / "report.html").exists()
                         else write_report(small_run).read_text())
    seen: dict[str, set] = {}
    for s in specs:
        for tr in s["data"]:
            color = (tr.get("line") or {}).get("color") or (tr.get("marker") or {}).get("color")
            if tr.get("meta") in ("orca-oracle", "vllm") and "stackgroup" not in tr and tr.get("type") != "bar":
                seen.setdefault(tr["meta"], set()).add(color)
    assert set(seen) == {"orca-oracle", "vllm"} and all(len(c) == 1 for c in seen.values())
    assert seen["orca-oracle"] != seen["vllm"]


def same_name(run, tmp_path):
    """A copy of ``run`` under another folder, of the same name (a folder compared with itself is refused)."""
    import shutil

    return shutil.copytree(run, tmp_path / "other" / run.name)


def test_compare_labels_policies_by_run(small_run, tmp_path):
    other = same_name(small_run, tmp_path)
    out = build_report([small_run, other], tmp_path / "c.html")
    specs = figure_specs(out.read_text())
    names = {tr.get("meta") for s in specs for tr in s["data"]}
    assert {"small / vllm", "small#2 / vllm", "small / orca-oracle", "small#2 / orca-oracle"} <= names
    assert run_labels([small_run, other]) == ["small", "small#2"]


def test_sweep_folder_shows_sweep_figures(small_run, tmp_path):
    d = tmp_path / "sweep"
    d.mkdir()
    sweep_table().to_parquet(d / "sweep.parquet")
    pd.DataFrame({"policy": ["orca-oracle", "vllm"], "sustainable_request_rate": [1.5, 3.0]}).to_parquet(
        d / "capacity.parquet")
    specs = figure_specs(build_report([d]).read_text())
    assert [s["layout"]["title"]["text"] for s in specs] == ["Mean normalized latency vs request rate",
                                                             "Sustainable request rate per policy"]
    # a run folder with a sweep table beside its results shows both
    both = tmp_path / "both"
    both.mkdir()
    for f in small_run.iterdir():
        (both / f.name).write_bytes(f.read_bytes())
    sweep_table().to_parquet(both / "sweep.parquet")
    assert len(figure_specs(build_report([both]).read_text())) == 7  # 5 run figures + the decomposition + 1 sweep


# ------------------------------------------------------------------------------------------- sim report


def test_sim_report_rebuilds_from_saved_results(small_run, tmp_path):
    (small_run / "report.html").unlink(missing_ok=True)
    r = runner.invoke(app, ["report", str(small_run)])
    assert r.exit_code == 0, r.output
    assert (small_run / "report.html").exists() and "bytes" in r.output
    out = tmp_path / "sub" / "cmp.html"
    r = runner.invoke(app, ["report", str(small_run), str(same_name(small_run, tmp_path)), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.exists() and str(out) in r.output.replace("\n", "")  # written where --out says (folder made)
    names = {tr.get("meta") for s in figure_specs(out.read_text()) for tr in s["data"]}
    assert {"small / vllm", "small#2 / vllm"} <= names  # a comparison of both folders, not one run's page


def test_sim_report_user_errors_are_one_line(small_run, tmp_path):
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "summary.json").write_text((small_run / "summary.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in small_run.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "requests.parquet").write_bytes(b"not parquet")
    cases = {str(tmp_path / "missing"): "no such result folder", str(tmp_path): "not a result folder",
             str(incomplete): "missing requests.parquet, timeline.parquet",
             str(broken): "requests.parquet: cannot read as parquet", str(small_run / "summary.json"): "not a folder"}
    for path, message in cases.items():
        r = runner.invoke(app, ["report", path])
        assert r.exit_code == 2, (path, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.output, r.output
        assert not lines[0].endswith(("Either", "Either)")), r.output  # a sentence is never cut


def _damaged(summary: dict, case: str) -> str:
    if case == "policies_empty":
        summary["policies"] = {}
    elif case == "scenario_policies_not_list":
        summary["scenario"]["policies"] = 5
    elif case == "scenario_resolved_not_object":
        summary["scenario"]["resolved"] = [1]
    elif case == "metric_list":
        summary["policies"]["vllm"]["mean_ttft_ms"] = [1]
    elif case == "metric_bool":
        summary["policies"]["vllm"]["duration_s"] = True
    elif case == "nested_too_deep":
        return "[" * 100_000 + "]" * 100_000
    return json.dumps(summary)


@pytest.mark.parametrize("case, message", [
    ("policies_empty", "'policies' is empty"),  # was a KeyError traceback (pandas: no 'label' column)
    ("scenario_policies_not_list", "scenario.policies is not a list"),  # was a TypeError traceback
    ("scenario_resolved_not_object", "scenario.resolved is not an object"),  # was an AttributeError traceback
    ("metric_list", "policies.vllm.mean_ttft_ms = [1], expected a number or null"),  # was drawn as a page
    ("metric_bool", "policies.vllm.duration_s = True, expected a number or null"),  # was drawn as a page
    ("nested_too_deep", "summary.json: cannot read (nested too deeply to read)"),  # was a RecursionError traceback
])
def test_sim_report_damaged_summary_is_one_line(small_run, tmp_path, case, message):
    d = tmp_path / "r"
    d.mkdir()
    for f in small_run.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "summary.json").write_text(_damaged(json.loads((small_run / "summary.json").read_text()), case))
    r = runner.invoke(app, ["report", str(d)])
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "summary.json" in lines[0] and message in lines[0], r.output


def test_sim_report_tables_of_a_policy_the_summary_does_not_list(small_run, tmp_path):
    """requests.parquet holding rows of a policy summary.json does not list (a summary edited, or files of two
    runs mixed) drew that policy's curves beside a table without it."""
    d = tmp_path / "r"
    d.mkdir()
    for f in small_run.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    summary = json.loads((small_run / "summary.json").read_text())
    summary["policies"].pop("orca-oracle")
    (d / "summary.json").write_text(json.dumps(summary))
    r = runner.invoke(app, ["report", str(d)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "requests.parquet: rows of policy 'orca-oracle', which summary.json does not list (it has 'vllm')" \
        in lines[0], r.output


@pytest.mark.parametrize("file, column", [("requests.parquet", "status"), ("requests.parquet", "reason"),
                                          ("kv_snapshots.parquet", "memory_class")])
def test_sim_report_category_columns_of_codes(small_run, tmp_path, file, column):
    """A category column as its integer codes (a table rewritten by hand) drew a page saying no request finished
    (or no slot of any memory class) while summary.json counted 60 finished."""
    import pyarrow.parquet as pq

    d = tmp_path / "r"
    d.mkdir()
    for f in small_run.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    t = pq.read_table(d / file)
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, column, t.column(column).combine_chunks().indices), d / file)
    r = runner.invoke(app, ["report", str(d)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and f"{file}: column '{column}' holds '" in lines[0], r.output
    assert "; expected one of '" in lines[0], r.output


def test_a_run_that_served_nothing_says_what_is_not_drawn(tmp_path):
    """Every request too long for the model: no step, no time bin, no snapshot, no finished request."""
    scenario = parse_scenario({
        "name": "all rejected", "model": "opt-13b", "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 1.0}, "prompt": {"kind": "fixed", "tokens": 3000},
                     "output": {"kind": "fixed", "tokens": 10}, "num_requests": 5},
        "policies": ["orca-max", "vllm"]})
    page = write_results(run(scenario), tmp_path / "r")["report"].read_text()
    assert len(figure_specs(page)) == 1  # the memory bars (empty: no time passed, no share)
    for why in ("no time bin was recorded", "no snapshot was kept", "no request finished"):
        assert f"Not drawn: {why}" in page


def test_load_run_keeps_policy_order_and_presets(small_run):
    run_tables = load_run(small_run)
    assert list(run_tables.policies.index) == ["orca-oracle", "vllm"]
    assert list(run_tables.policies.preset) == ["orca-oracle", "vllm"]
    assert set(run_tables.requests.policy) == {"orca-oracle", "vllm"}


# ------------------------------------------------------------------------------------------- size bound


def test_report_of_a_long_run_stays_under_10_mb(small_run, tmp_path):
    """The tables of a 20,000-request, five-policy run at their largest (the simulator keeps at most
    2048 timeline bins per policy; a paged pool's snapshot of 20,000 scattered runs) render under 10 MB."""
    d = tmp_path / "long"
    d.mkdir()
    summary = json.loads((small_run / "summary.json").read_text())
    names = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]
    template = summary["policies"]["vllm"]
    summary["policies"] = {n: template for n in names}
    (d / "summary.json").write_text(json.dumps(summary))
    pd.concat([requests_table(n, 20_000, seed=i) for i, n in enumerate(names)]).to_parquet(d / "requests.parquet")
    pd.concat([timeline_table(n, 2048, seed=i) for i, n in enumerate(names)]).to_parquet(d / "timeline.parquet")
    scattered = [(16, "token_states" if i % 2 else "free") for i in range(20_000)]
    pd.concat([snapshot_table(n, scattered) for n in names]).to_parquet(d / "kv_snapshots.parquet")
    page = write_report(d)
    size = page.stat().st_size
    assert size < 10_000_000, size
    assert size - len(get_plotlyjs().encode()) < 2_000_000, size  # the figures themselves stay small
    assert len(figure_specs(page.read_text())) == 6  # 5 run figures + the decomposition (of small_run)


def test_summary_bolds_every_value_that_reads_as_the_best():
    """The best value is judged as printed: values that print alike are all bold or none is; a column whose
    shown values all read the same has nothing bold, however their unrounded floats differ."""
    from reports.html import summary_table

    pol = pd.DataFrame({"output_throughput": [579.4119619, 579.4119702, 500.0],  # '579', '579', '500'
                        "median_ttft_ms": [1.1889, 1.1831, 1.21],  # '1' three times
                        "memory.token_states": [0.01061, 0.01065, 0.2],  # '1.1%', '1.1%', '20.0%'
                        "num_finished": [30] * 3, "num_rejected": [0] * 3, "num_unfinished": [0] * 3},
                       index=["orca-max", "vllm", "other"])
    page = summary_table(pol)
    bold = re.findall(r'<td class="best"[^>]*>(.*?)</td>', page)
    assert sorted(bold) == ["20.0%", "579", "579"], bold


def _block_items(scenario: dict) -> dict[str, str]:
    import html
    from types import SimpleNamespace

    from reports.html import scenario_block

    block = scenario_block(SimpleNamespace(scenario=scenario, label=scenario["name"]))
    return {k: html.unescape(v) for k, v in re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", block)}


def test_scenario_block_shows_the_fleet_and_small_figures():
    """A fleet's replicas or pools (GPU, TP), router and link are on the page; a tiny model's and device's
    figures read in significant digits, not as 0; a setting left unset (None) is not printed."""
    resolved = {"model": {"name": "tiny-llama", "num_params": 2_430_000, "num_layers": 2, "max_model_len": 1024,
                          "kv_bytes_per_token": 512},
                "gpu": {"name": "tiny-device", "memory_gib": 0.011, "hbm_gb_per_s": 50, "tflops": 1},
                "kv_pools": {"vllm": {"kv_capacity_tokens": 3936, "kv_capacity_gib": 0.001877, "num_blocks": 246,
                                      "block_size": 16}},
                "workload": {"num_requests": 1, "source": "synthetic(seed=0)", "span_s": 0.88}}
    base = {"name": "s", "tensor_parallel": 1, "gpu_memory_utilization": 0.9, "resolved": resolved,
            "policies": [{"name": "vllm"}], "step_time": {"kind": "roofline", "host": None}}
    items = _block_items(base)
    assert "fleet" not in items
    assert items["model"].startswith("tiny-llama (2.43 M parameters,") and "KV 0.512 KB per token" in items["model"]
    assert items["GPU"].startswith("1 x tiny-device (0.011 GiB, 50 GB/s HBM, 1 TFLOP/s)"), items["GPU"]
    assert "3,936 tokens = 0.00188 GiB (0.00202 GB) per GPU" in items["KV cache"], items["KV cache"]
    assert items["step time"] == "kind roofline", items["step time"]
    assert items["workload"].startswith("1 request from synthetic(seed=0) over 0.88 s"), items["workload"]

    colocated = {**base, "cluster": {"replicas": [{"gpu": None, "tensor_parallel": 2, "count": 2},
                                                  {"gpu": {"name": "my-gpu"}, "tensor_parallel": None, "count": 1}],
                                     "router": "least-outstanding", "prefill": None, "decode": None,
                                     "kv_transfer": None}}
    assert _block_items(colocated)["fleet"] == ("2 replicas of 2 x tiny-device, 1 replica of 1 x my-gpu; "
                                                "router least-outstanding")
    assert "per GPU of the first replica" in _block_items(colocated)["KV cache"]
    disagg = {**base, "cluster": {"replicas": None, "router": ["round-robin", "least-kv"],
                                  "prefill": {"replicas": 1, "gpu": None, "tensor_parallel": None},
                                  "decode": {"replicas": 3, "gpu": "h100", "tensor_parallel": 2},
                                  "kv_transfer": {"gb_per_s": 50, "latency_ms": 0.5}}}
    assert _block_items(disagg)["fleet"] == ("disaggregated: prefill: 1 replica of 1 x tiny-device; decode: 3 "
                                             "replicas of 2 x h100; KV transfer 50 GB/s + 0.5 ms; router "
                                             "round-robin, least-kv (within each pool)")


def test_long_names_wrap_instead_of_widening_the_page():
    """The Scenario block's grid and its values wrap a name with no break point (no sideways scroll); the
    browser check is tests/test_report_layout.py."""
    from reports.html import CSS

    assert "grid-template-columns:max-content minmax(0,1fr)" in CSS
    assert re.search(r"dd\{[^}]*overflow-wrap:anywhere", CSS)
    assert re.search(r"\.summary td:first-child\{[^}]*overflow-wrap:anywhere", CSS)


def test_a_fleet_report_shows_its_routers_pools_and_replicas(tmp_path):
    """A fleet's own figures were only in summary.json: the page and the console now give each policy's
    router, load imbalance and (disaggregated) pools and transfers, and each replica's row; the address
    space names the replica it shows."""
    from rich.console import Console

    from reports.console import print_summary

    base = {"model": "llama-3-8b", "gpu": "h100", "policies": ["vllm"],
            "workload": {"arrival": {"kind": "poisson", "rate": 6.0}, "lengths": "sharegpt", "num_requests": 80,
                         "seed": 3}}
    for name, cluster, expect in (
            ("colo", {"replicas": 3, "router": ["round-robin", "least-outstanding"]},
             ["imbalance req / KV", "vllm/least-outstanding: 3 replicas"]),
            ("disagg", {"prefill": {"replicas": 1}, "decode": {"replicas": 2},
                        "kv_transfer": {"gb_per_s": 50, "latency_ms": 0.5}},
             ["prefill pool", "decode wait ms mean / p99", "vllm: 3 replicas", "<td>decode</td>"])):
        d = tmp_path / name
        result = run(parse_scenario({"name": name, **base, "cluster": cluster}))
        write_results(result, d, report=False)
        page = write_report(d).read_text()
        fleet = page[page.index("<h2>Fleet</h2>"):page.index("<h2>Figures</h2>")]
        for text in expect:
            assert text in fleet, (text, fleet[:2000])
        reps = pd.read_parquet(d / "replicas.parquet")
        assert fleet.count("<tr><td>") == len(reps) + reps.policy.nunique()  # a row per replica and per policy
        snaps = pd.read_parquet(d / "kv_snapshots.parquet")
        assert snaps.replica.between(0, 2).all()
        console = Console(width=100, record=True)
        summary = json.loads((d / "summary.json").read_text())
        print_summary(summary, name, console)
        text = console.export_text()
        for policy in summary["fleet"]:
            assert f"fleet {policy}: " in text, text
