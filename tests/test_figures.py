"""Figure builders on small hand-made result tables: the right traces, series, units and downsampling."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from tables import policies_table, requests_table, snapshot_table, sweep_table, timeline_table

from reports import figures
from reports.paper import FIG2, is_paper_scenario

CLASSES = figures.MEMORY_CLASSES


def axis_titles(fig) -> list[str]:
    lay = fig.layout
    return [lay[k].title.text for k in lay if k.startswith(("xaxis", "yaxis")) and lay[k].title.text]


UNIT = re.compile(r"\((%|ms|s|s/token|req/s|tok/s|tokens|token slots|sequences|requests|GiB|share|0–1)\)|/s$")


def assert_units(fig) -> None:
    titles = axis_titles(fig)
    assert titles
    for t in titles:
        assert UNIT.search(t) or t in ("policy", "% of KV"), t


# ------------------------------------------------------------------------------------------- labels, colours


def test_policy_colors_are_stable_and_distinct():
    names = [f"p{i}" for i in range(12)]
    c = figures.policy_colors(names)
    assert list(c) == names and len(set(c.values())) == 12
    assert figures.policy_colors(names[:3]) == {n: c[n] for n in names[:3]}


def test_short_labels_escape_cut_and_stay_unique():
    long_a = "<b>" + "x" * 40 + "a"
    long_b = "<b>" + "x" * 40 + "b"
    s = figures.short_labels([long_a, long_b, "ok & fine"], width=10)
    assert s["ok & fine"] == "ok &amp; fine"
    assert s[long_a].startswith("&lt;b&gt;") and "…" in s[long_a] and "<" not in s[long_a]
    assert s[long_a] != s[long_b]


# ------------------------------------------------------------------------------------------- memory waste


def test_memory_breakdown_stacks_five_classes_per_policy():
    fig = figures.memory_breakdown(policies_table([("a", None), ("b", None)]))
    assert [t.name for t in fig.data] == [figures.MEMORY_LABELS[c] for c in CLASSES]
    assert all(list(t.x) == ["a", "b"] for t in fig.data)
    assert fig.layout.barmode == "stack"
    assert sum(t.y[0] for t in fig.data) == pytest.approx(100)
    assert_units(fig)
    assert "(%)" in fig.layout.yaxis.title.text


def test_memory_breakdown_puts_published_bars_beside_their_preset():
    fig = figures.memory_breakdown(policies_table([("mine-max", "orca-max"), ("paged", "vllm"), ("x", None)]), FIG2)
    x = list(fig.data[0].x)
    assert x == ["mine-max", "Orca (Max), paper", "paged", "vLLM, paper", "x"]
    by_name = {t.name: t for t in fig.data}
    assert "not broken down (paper)" in by_name  # vLLM's published 3.7 % has no class
    paper_total = sum(t.y[x.index("vLLM, paper")] for t in fig.data)
    assert paper_total == pytest.approx(100)
    assert by_name["token states"].y[1] == 20.4 and by_name["token states"].marker.pattern.shape[1] == "/"
    assert by_name["token states"].marker.pattern.shape[0] == ""
    assert "published figures" in fig.layout.title.subtitle.text


def test_paper_scenario_detection():
    q = {"model": "opt-13b", "workload": {"kind": "synthetic", "lengths": "sharegpt", "arrival": {"kind": "poisson"}}}
    assert is_paper_scenario(q)
    assert not is_paper_scenario({**q, "model": "llama-3-8b"})
    assert not is_paper_scenario({**q, "workload": {**q["workload"], "lengths": None}})
    assert not is_paper_scenario({**q, "workload": {**q["workload"], "arrival": {"kind": "gamma"}}})


# ------------------------------------------------------------------------------------------- timelines


def test_display_bins_merges_exactly():
    t = timeline_table("a", 5)
    t.loc[4, "bin_s"] = 0.5  # the last bin ends early
    d = figures.display_bins(t, max_points=3)  # groups of 2: [0,1], [2,3], [4]
    assert list(d.bin_start_s) == [0, 2, 4] and list(d.bin_s) == [2, 2, 0.5]
    assert d.num_sampled[0] == t.num_sampled[0] + t.num_sampled[1]
    w = t.bin_s.to_numpy()
    expect = (t["memory.free"][2] * w[2] + t["memory.free"][3] * w[3]) / (w[2] + w[3])
    assert d["memory.free"][1] == pytest.approx(expect)
    assert d["mean_running"][2] == pytest.approx(t.mean_running[4])
    shares = d[[f"memory.{c}" for c in CLASSES]].sum(axis=1)
    assert np.allclose(shares, 1.0)


def test_memory_timeline_has_stacks_and_queue_rows_on_one_time_axis():
    t = pd.concat([timeline_table("a", 30), timeline_table("b", 12, bin_s=2.0, seed=1)])
    colors = figures.policy_colors(["a", "b"])
    fig = figures.memory_timeline(t, colors)
    assert len(fig.data) == 2 * (len(CLASSES) + 2)
    stacks = [tr for tr in fig.data if tr.stackgroup]
    assert len(stacks) == 10 and {tr.stackgroup for tr in stacks} == {"p0", "p1"}
    lines = [tr for tr in fig.data if not tr.stackgroup]
    assert [tr.line.color for tr in lines] == [colors["a"]] * 2 + [colors["b"]] * 2
    assert "requests holding KV" in lines[0].hovertemplate  # the running row: requests holding KV cache
    assert np.allclose(lines[0].y, timeline_table("a", 30).mean_running_requests, rtol=1e-6)
    assert fig.data[len(CLASSES) + 2].dx == 2.0 and fig.data[0].dx == 1.0  # bins drawn at their starts
    assert [fig.layout[f"xaxis{i}"].matches for i in ("", 2, 3, 4)] == ["x4", "x4", "x4", None]  # one time axis
    assert_units(fig)
    assert "time bins of 1 s (b: 2 s)" in fig.layout.title.subtitle.text


def test_timelines_downsample_long_runs_and_say_so():
    t = timeline_table("a", 2048)
    fig = figures.memory_timeline(t, {"a": "#000"}, max_points=600)
    assert all(len(tr.y) <= 600 for tr in fig.data)
    assert "downsampled" in fig.layout.title.subtitle.text
    fig = figures.throughput_timeline(t, {"a": "#000"}, max_points=600)
    assert "downsampled" in fig.layout.title.subtitle.text


def test_throughput_timeline_draws_rolling_means_over_faint_bins():
    t = pd.concat([timeline_table("a", 40, bin_s=2.0), timeline_table("b", 40, seed=3)])
    fig = figures.throughput_timeline(t, figures.policy_colors(["a", "b"]), bins=5)
    assert len(fig.data) == 12 and [tr.name for tr in fig.data[:6]] == ["a"] * 6  # per panel: raw bins, mean
    a = t[t.policy == "a"].reset_index(drop=True)
    raw, mean = fig.data[0], fig.data[1]
    assert raw.opacity < 0.5 and raw.hoverinfo == "skip" and not raw.showlegend and mean.showlegend
    assert np.allclose(raw.y, a.num_sampled / 2.0)
    # the rolling mean: the window's count over its width (5 bins centred; 3 at the edges)
    assert np.isclose(mean.y[10], a.num_sampled[8:13].sum() / 10.0)
    assert np.isclose(mean.y[0], a.num_sampled[:3].sum() / 6.0)
    assert np.allclose(fig.data[4].y, a.num_preempted / 2.0)
    assert_units(fig)
    assert [fig.layout[f"yaxis{i}"].title.text for i in ("", 2, 3)] == \
        ["output tokens/s", "finished requests/s", "preemptions/s"]
    assert "rolling mean over 5 bins (10 s; b: 5 s)" in fig.layout.title.subtitle.text
    assert not fig.layout.annotations or all("no preemptions" not in a.text for a in fig.layout.annotations)
    quiet = figures.throughput_timeline(t.assign(num_preempted=0.0), {"a": "#000", "b": "#111"})
    assert len(quiet.data) == 8 and "yaxis3" not in quiet.layout.to_plotly_json()  # no empty preemptions axis...
    assert any(a.text.startswith("no preemptions") for a in quiet.layout.annotations)  # ...it says so


def test_policy_colours_are_not_memory_class_colours():
    colours = set(figures.policy_colors([f"p{i}" for i in range(20)]).values())
    assert len(colours) == 20 and not colours & {c.lower() for c in figures.MEMORY_COLORS.values()}


def test_log_axes_label_powers_of_ten_only():
    assert figures._log_ticks([3.0, 40.0, 2000.0])["dtick"] == 1
    assert figures._log_ticks([3.0, 9.0]) == {}  # under a decade and a half: plotly's own labels


# ------------------------------------------------------------------------------------------- address space


def test_address_space_draws_each_policys_runs_exactly():
    slabs = [(300, "token_states"), (100, "reservation"), (112, "internal_fragmentation"),
             (488, "external_fragmentation"), (24, "free")]
    paged = [(16, "token_states"), (16, "free"), (16, "token_states"), (5, "token_states"), (11, "reservation"),
             (960, "free")]
    snaps = pd.concat([snapshot_table("slabs", slabs), snapshot_table("paged", paged, waiting=0)])
    fig = figures.address_space(snaps, ["slabs", "paged"])
    slab_traces = [t for t in fig.data if t.meta == "slabs"]
    assert [t.name for t in slab_traces] == [figures.MEMORY_LABELS[c] for c in CLASSES]
    paged_tok = next(t for t in fig.data if t.meta == "paged" and t.name == "token states")
    assert list(paged_tok.base) == [0, 32] and list(paged_tok.x) == [16, 21]  # adjacent runs of a class merge
    for pol in ("slabs", "paged"):
        runs = sorted((b, x) for t in fig.data if t.meta == pol for b, x in zip(t.base, t.x))
        assert runs[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(runs, runs[1:]))  # tiles the pool
        assert sum(x for _, x in runs) == 1024
    assert sum(t.showlegend for t in fig.data) == len(CLASSES)  # each class once in the legend
    assert "3 waiting" in str(fig.data[0].y[0])
    assert "downsampled" not in fig.layout.title.subtitle.text
    assert_units(fig)


def test_address_space_downsamples_big_pools_to_pixels():
    many = [(16, "token_states" if i % 3 else "free") for i in range(10_000)]  # 160,000 slots
    runs, per_px = figures.strip_runs(snapshot_table("big", many), max_runs=2000, pixels=1600)
    assert per_px == 128 and runs.length.sum() == 160_000 and len(runs) <= 1600
    assert (runs.memory_class.to_numpy()[1:] != runs.memory_class.to_numpy()[:-1]).all()
    fig = figures.address_space(snapshot_table("big", many), ["big"], max_runs=2000, pixels=1600)
    assert "128 slots per pixel" in fig.layout.title.subtitle.text
    assert sum(len(t.x) for t in fig.data) == len(runs)


# ------------------------------------------------------------------------------------------- latency


def test_latency_cdfs_four_panels_per_policy_over_finished_requests():
    req = pd.concat([requests_table("a", 50), requests_table("b", 80, seed=2)])
    fig = figures.latency_cdfs(req, figures.policy_colors(["a", "b"]))
    assert len(fig.data) == 8
    first = fig.data[0]
    assert len(first.x) == 50 and first.y[-1] == pytest.approx(1.0) and np.all(np.diff(first.x) >= 0)
    assert [fig.layout[f"xaxis{i}"].type for i in ("", 2, 3, 4)] == ["log"] * 4
    assert [fig.layout[f"xaxis{i}"].title.text for i in ("", 2, 3, 4)] == [m[2] for m in figures.CDF_METRICS]
    assert_units(fig)
    assert sum(t.showlegend for t in fig.data) == 2


def test_cdf_points_downsample_to_exact_order_statistics():
    v = np.random.default_rng(0).lognormal(size=20_000)
    x, y = figures.cdf_points(np.r_[v, np.nan], max_points=1000)
    assert len(x) == 1000 and x[0] == v.min() and x[-1] == v.max() and y[-1] == 1.0
    assert np.isin(x, v).all()
    fig = figures.latency_cdfs(requests_table("a", 5000), {"a": "#000"}, max_points=1000)
    assert "drawn at 1000" in fig.layout.title.subtitle.text


# ------------------------------------------------------------------------------------------- sweeps


def test_sweep_axes_are_the_scenario_fields_that_vary():
    t = sweep_table()
    assert figures.sweep_axes(t) == ["workload.arrival.rate"]
    t2 = pd.concat([t.assign(block_size=16), t.assign(block_size=32)])
    assert figures.sweep_axes(t2) == ["workload.arrival.rate", "block_size"]


def test_latency_vs_rate_one_line_per_policy():
    colors = figures.policy_colors(["orca-oracle", "vllm"])
    t = sweep_table().sample(frac=1, random_state=0)  # row order must not matter
    fig = figures.latency_vs_rate(t, colors)
    assert [tr.name for tr in fig.data] == ["orca-oracle", "vllm"]
    assert list(fig.data[1].x) == [1.0, 2.0, 4.0] and fig.data[1].mode == "lines+markers"
    assert fig.layout.xaxis.title.text == "request rate (req/s)" and fig.layout.yaxis.type == "log"
    assert fig.layout.yaxis.title.text == "mean normalized latency (s/token)"
    cap = pd.DataFrame({"policy": ["orca-oracle", "vllm"], "sustainable_request_rate": [1.5, 3.0]})
    fig = figures.latency_vs_rate(t, colors, capacity=cap)
    assert [s.x0 for s in fig.layout.shapes] == [1.5, 3.0]


def test_latency_vs_rate_splits_other_axes_and_averages_seeds():
    colors = figures.policy_colors(["orca-oracle", "vllm"])
    t = pd.concat([sweep_table().assign(block_size=16), sweep_table().assign(block_size=32)])
    fig = figures.latency_vs_rate(t, colors)
    assert len(fig.data) == 4 and fig.data[0].line.dash != fig.data[1].line.dash
    assert fig.data[0].line.color == fig.data[1].line.color == colors["orca-oracle"]
    assert fig.data[0].error_y.array is None and "one run per point" in fig.layout.title.subtitle.text
    a, b = sweep_table().assign(seed=0), sweep_table().assign(seed=1)
    b["mean_normalized_latency_s"] *= 3  # seed 1: three times seed 0's latency
    fig = figures.latency_vs_rate(pd.concat([b, a]), colors)
    assert len(fig.data) == 2 and list(fig.data[1].x) == [1.0, 2.0, 4.0]
    y0 = a[a.policy == "vllm"].mean_normalized_latency_s.to_numpy()
    assert np.allclose(fig.data[1].y, 2 * y0)  # the mean of y0 and 3 * y0
    assert np.allclose(fig.data[1].error_y.array, np.std([y0, 3 * y0], axis=0, ddof=1))
    assert "mean ± standard deviation over 2 seeds" in fig.layout.title.subtitle.text
    failed = pd.concat([a, b.assign(mean_normalized_latency_s=np.nan, error="boom")])  # a failed run is left out
    assert np.allclose(figures.latency_vs_rate(failed, colors).data[1].y, y0)


def test_metric_vs_block_size_on_a_log_axis_split_by_preemption():
    colors = figures.policy_colors(["vllm"])
    t = pd.concat([sweep_table(rates=(2.0,), policies=("vllm",)).assign(**{"policies.*.block_size": b,
                                                                          "policies.*.preemption": m})
                   for b in (1, 16, 256) for m in ("swap", "recompute")])
    fig = figures.latency_vs_rate(t, colors, x="policies.*.block_size")
    assert len(fig.data) == 2 and [tr.name for tr in fig.data] == ["vllm (preemption=recompute)",
                                                                    "vllm (preemption=swap)"]
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.title.text == "block size (tokens)"
    assert list(fig.data[0].x) == [1, 16, 256]


def test_sustainable_rates_one_bar_per_policy():
    cap = pd.DataFrame({"policy": ["vllm", "orca-oracle"], "sustainable_request_rate": [3.0, 1.5]})
    fig = figures.sustainable_rates(cap, figures.policy_colors(["orca-oracle", "vllm"]))
    assert [tr.name for tr in fig.data] == ["orca-oracle", "vllm"] and list(fig.data[1].y) == [3.0]
    assert fig.layout.yaxis.title.text == "sustainable request rate (req/s)"




def test_sharing_timeline_draws_hits_and_memory_with_and_without_sharing():
    from reports.figures import shares_blocks, sharing_timeline
    from sim import run
    from sim.config import parse_scenario

    s = parse_scenario({"name": "t", "model": "opt-13b", "gpu": "a100-40gb", "sampling": {"kind": "parallel", "n": 2},
                        "workload": {"arrival": {"kind": "poisson", "rate": 10}, "lengths": "alpaca", "num_requests": 80,
                                     "shared_prefixes": {"lengths": [64]}},
                        "policies": ["orca-oracle", {"preset": "vllm", "name": "apc", "prefix_caching": True}]})
    r = run(s)
    tl = pd.concat([res.timeline.assign(policy=n) for n, res in r.policies.items()], ignore_index=True)
    assert shares_blocks(tl)
    fig = sharing_timeline(tl, {"orca-oracle": "#111111", "apc": "#222222"})
    names = [t.name for t in fig.data]
    assert names.count("apc") == 3 and "orca-oracle" not in names  # only the sharing policy: hit rate, used, without
    assert {fig.layout.yaxis.title.text, fig.layout.yaxis2.title.text} == {"hit rate (%)", "% of KV pool"}
    used = next(np.asarray(t.y, dtype=float) for t in fig.data if t.line.dash == "solid" and t.yaxis == "y2")
    without = next(np.asarray(t.y, dtype=float) for t in fig.data if t.line.dash == "dot")
    assert (without >= used - 1e-3).all() and (without > used).any()  # sharing saves memory, never costs it


def test_sustainable_rates_average_seeds_and_say_none():
    cap = pd.DataFrame({"policy": ["vllm", "vllm", "orca-max", "orca-max"], "seed": [0, 1, 0, 1],
                        "sustainable_request_rate": [3.0, 2.0, None, None]})
    fig = figures.sustainable_rates(cap, figures.policy_colors(["orca-max", "vllm"]))
    assert [tr.name for tr in fig.data] == ["orca-max", "vllm"]
    assert list(fig.data[1].y) == [2.5] and fig.data[1].error_y.array[0] == pytest.approx(np.std([3, 2], ddof=1))
    assert list(fig.data[0].y) == [0.0] and list(fig.data[0].text) == ["none"]
    by_block = pd.concat([cap.assign(block_size=16), cap.assign(block_size=32)])
    fig = figures.sustainable_rates(by_block, figures.policy_colors(["orca-max", "vllm"]))
    assert list(fig.data[1].x) == ["vllm<br>block_size=16", "vllm<br>block_size=32"]


