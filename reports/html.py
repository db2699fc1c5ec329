"""One self-contained HTML page per report: plotly.js and the figure template inlined once, every
figure's JSON in its own inert ``<script type="application/json">`` block, escaped so that no user text
(scenario or policy names) can close it. Opens from disk with no network.

    write_report(run_dir)                 # sim run: <run_dir>/report.html
    build_report([run_a, run_b], out)     # sim report: one folder, or several side by side
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from reports import figures
from reports.console import fleet_facts
from reports.paper import FIG2, PAPER_CITATION, is_paper_scenario
from reports.results import ResultsError, RunTables, concat, load_run, load_runs
from sim.schema import METRICS, PLAN_MARK, RATE_AXIS, TABLE_COLUMNS, plural, sig4

GB = 1e9
GIB = 1 << 30

HEADLINE = [  # summary key and format; the head (label, unit) and which value is best come from sim.schema.METRICS
    ("request_throughput", "{:.3f}"),
    ("output_throughput", "{:,.0f}"),
    ("mean_normalized_latency_s", "{:.4f}"),
    ("median_ttft_ms", "{:,.0f}"),
    ("p99_ttft_ms", "{:,.0f}"),
    ("median_tpot_ms", "{:.1f}"),
    ("p99_tpot_ms", "{:.1f}"),
    ("median_e2el_ms", "{:,.0f}"),
    ("mean_batch_size", "{:.1f}"),
    ("mean_decode_batch_size", "{:.1f}"),
    ("mean_running_requests", "{:.1f}"),
    ("num_preemptions", "{:,}"),
    ("memory.token_states", "{:.1%}"),
]
HEADLINE_SPLIT = 8  # the summary is two tables (throughput and latency; batch, memory, counts): each fits 900 px


def _head(key: str) -> str:
    m = METRICS[key]
    return m.label if m.unit in ("share", "preemptions") else f"{m.label} ({m.unit})"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1280px;color:#222;
padding:0 1rem} h1{margin-bottom:.2rem} h2{margin-top:2.2rem;border-bottom:1px solid #ddd} .muted{color:#666}
table{border-collapse:collapse;margin:1rem 0;font-size:.88rem} th,td{border-bottom:1px solid #ddd;
padding:.3rem .5rem;text-align:right;vertical-align:bottom} th:first-child,td:first-child{text-align:left}
td.best{font-weight:bold;background:#e3f2e3} .missing{color:#a33} .figure{width:100%;margin:.5rem 0 1.5rem 0}
dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.25rem 1rem} dt{color:#666}
dd{margin:0;overflow-wrap:anywhere} h1,h2,h3,p{overflow-wrap:anywhere}
.caption{max-width:70rem} code{background:#f4f4f4;padding:0 .2rem}
.wide{max-width:100%;overflow-x:auto} .summary td{white-space:nowrap} .summary th{min-width:3.5rem}
.summary td:first-child{white-space:normal;overflow-wrap:anywhere;min-width:8rem}
"""

RENDER_JS = """
for (const el of document.querySelectorAll("script.kvsim-figure")) {
  const spec = JSON.parse(el.textContent);
  spec.layout.template = KVSIM_TEMPLATE;
  Plotly.newPlot(el.dataset.target, spec.data, spec.layout, {responsive: true, displaylogo: false});
}
"""


@dataclass(frozen=True)
class Section:
    """One figure on the page: its heading, what it shows (HTML, already escaped) and the figure, or
    ``None`` and why it is not drawn (e.g. no request finished)."""

    heading: str
    caption_html: str
    figure: go.Figure | None
    missing: str = ""


def _safe_json(obj: object) -> str:
    """JSON that cannot end the surrounding <script> element, whatever text it carries."""
    return (json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _figure_html(section: Section, idx: int) -> tuple[str, dict]:
    """The figure's block on the page, and its template (drawn once for all figures)."""
    head = f'<section><h3>{html.escape(section.heading)}</h3><p class="caption muted">{section.caption_html}</p>\n'
    if section.figure is None:
        return f'{head}<p class="missing">Not drawn: {html.escape(section.missing)}.</p></section>', {}
    spec = json.loads(section.figure.to_json())
    layout = spec.get("layout", {})
    template = layout.pop("template", {})
    height = int(layout.get("height") or 460)
    block = (f'{head}<div id="fig{idx}" class="figure" style="height:{height}px"></div>\n'
             f'<script type="application/json" class="kvsim-figure" data-target="fig{idx}">'
             f'{_safe_json({"data": spec.get("data", []), "layout": layout})}</script></section>')
    return block, template


def _fmt(fmt: str, v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return html.escape(fmt.format(v))


def summary_table(policies: pd.DataFrame) -> str:
    """Every policy's headline metrics; the best value of each column marked, as printed: every cell that
    reads as the best one (none in a column where every value shown reads the same)."""
    best: dict[str, str] = {}  # the best value of a column, as printed
    for key, fmt in HEADLINE:
        how = METRICS[key].better
        if key in policies.columns and how is not None:
            vals = pd.to_numeric(policies[key], errors="coerce").dropna()
            if len({_fmt(fmt, v) for v in vals}) > 1:
                best[key] = _fmt(fmt, vals.max() if how == "max" else vals.min())

    def table(keys: list[tuple[str, str]], counts: bool) -> str:
        head = "".join(f"<th>{html.escape(_head(k))}</th>" for k, _ in keys)
        rows = []
        for label, m in policies.iterrows():
            cells = []
            for key, fmt in keys:
                shown = _fmt(fmt, m.get(key))
                mark = ' class="best" title="best in this column"' if best.get(key) == shown else ""
                cells.append(f"<td{mark}>{shown}</td>")
            if counts:
                cells.append("<td>" + " / ".join(_fmt("{:,}", m.get(k)) for k in
                                                 ("num_finished", "num_rejected", "num_unfinished")) + "</td>")
            rows.append(f"<tr><td>{html.escape(str(label))}</td>{''.join(cells)}</tr>")
        tail = "<th>finished / rejected / unfinished</th>" if counts else ""
        return (f"<div class='wide'><table class='summary'><thead><tr><th>policy</th>{head}{tail}</tr></thead>"
                f"<tbody>{''.join(rows)}</tbody></table></div>")

    return (table(HEADLINE[:HEADLINE_SPLIT], False) + table(HEADLINE[HEADLINE_SPLIT:], True)
            + "<p class='muted'>Bold: best value in its column. Latencies over finished requests. Mean batch: sequences "
            "per step, every step counted; mean decode batch: sequences decoding per step, over the steps that decode; "
            "mean running requests: requests holding KV cache, averaged over the run's duration. KV in token states: "
            "time-weighted share of the KV pool holding computed K/V (summary.json).</p>")


def _num(v: object, signed: bool = False) -> str:
    """A metric value: 4 significant digits, whole numbers from 10,000 up; ``signed``: with its sign."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return sig4(v, signed)


def _change_text(changes: dict) -> str:
    """``field: before → after`` for each changed field (— where a field does not apply)."""
    def val(v: object) -> str:
        return "—" if v is None else str(v)
    return "; ".join(f"{k}: {val(a)} → {val(b)}" for k, (a, b) in changes.items())


def decomposition_table(decomp: dict) -> str:
    """The decomposition (summary.json, computed by ``sim.decompose``): per policy, the base's metrics,
    each step's knob, what it changed, the metrics after it with its share (and that share as a percentage
    of the total difference), and the total."""
    metrics = [m for m in decomp.get("metrics", []) if m in METRICS]
    esc = html.escape
    head = "".join(f"<th>{esc(METRICS[m].title)}</th>" for m in metrics)
    base = str(decomp.get("base"))
    rows = []
    for target, t in decomp.get("targets", {}).items():
        rows.append(f"<tr><td rowspan='{len(t['steps']) + 2}'>{esc(str(target))}</td><td>from {esc(base)}</td>"
                    "<td></td>" + "".join(f"<td>{_num(decomp['base_metrics'].get(m))}</td>" for m in metrics)
                    + "</tr>")
        for st in t["steps"]:
            cells = []
            for m in metrics:
                share, total = st["share"].get(m), t["total"].get(m)
                pct = (f" ({100 * share / total:.0f}\u00a0%)" if share is not None and total else "")  # (no break)
                cells.append(f"<td>{_num(st['metrics'].get(m))}<br><span class='muted'>{_num(share, True)}{pct}"
                             "</span></td>")
            same = f" = {esc(str(st['same_as']))}" if st.get("same_as") else ""
            rows.append(f"<tr><td>+ {esc(st['label'])}{same}</td><td>{esc(_change_text(st['changes']))}</td>"
                        + "".join(cells) + "</tr>")
        unchanged = ", ".join(t.get("unchanged", [])) or "none"
        rows.append(f"<tr><td><b>total</b></td><td class='muted'>unchanged: {esc(unchanged)}</td>"
                    + "".join(f"<td><b>{_num(t['total'].get(m), True)}</b></td>" for m in metrics) + "</tr>")
    n = decomp.get("num_intermediate_runs", 0)
    return (f"<div class='wide'><table><thead><tr><th>policy</th><th>step</th><th>settings changed</th>{head}</tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table></div>"
            f"<p class='muted'>Each policy is reached from {esc(base)} one knob at a time (batching, reservation, "
            "paged allocation, prefill, block size, then any other setting); every intermediate policy ran on the "
            "same requests. Under each value: the step's share of the difference (and its percentage of the "
            "total); the shares add up to the total. '= policy': the intermediate is that policy of the "
            f"scenario; {n:,} intermediate polic{'y' if n == 1 else 'ies'} ran in addition to the scenario's. The "
            "order matters where knobs interact: the interaction goes to the later knob (summary.json: "
            "decomposition).</p>")


def _has_shares(decomp: dict) -> bool:
    """Whether any step of the decomposition has a share to draw."""
    return any(v is not None for t in decomp.get("targets", {}).values() for st in t["steps"]
               for v in st["share"].values())


def _policy_line(p: dict) -> str:
    a = p.get("allocator", {})
    alloc = (f"paged (block {p.get('block_size')})" if a.get("kind") == "paged"
             else f"contiguous, reserve {a.get('reserve')}, {a.get('placement')}")
    preset = f" (preset {p['preset']})" if p.get("preset") and p.get("preset") != p.get("name") else ""
    return (f"{p.get('name')}{preset}: {p.get('batching')} batching, {alloc}, {p.get('prefill')} prefill, "
            f"preemption by {p.get('preemption')}")


def _sig(v: object, fmt: str = "{:,.0f}") -> str:
    """An amount: ``fmt`` from 1 up (and for 0); below 1, 3 significant digits, so that a small amount never
    reads as 0 (a made-up test device of 0.011 GiB)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return fmt.format(v) if v == 0 or abs(v) >= 1 else f"{v:.3g}"


def _count(n: object) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def _params(n: object) -> str:
    """A parameter count: ``8.0 B``, ``1.28 M``."""
    if not n:
        return "-"
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{_sig(n / 1e6, '{:,.3g}')} M"


def _gpu_text(gpu: object, default: str) -> str:
    """A GPU as the scenario's cluster gives it: a catalog name, a custom GPU's mapping, or None (the scenario's)."""
    if isinstance(gpu, dict):
        return str(gpu.get("name") or default)
    return str(gpu) if gpu else default


def _fleet_line(cluster: dict, gpu: str, tp: int) -> str:
    """The fleet of a scenario with ``cluster`` (summary.json's scenario.cluster, as the scenario gave it):
    its replicas (or prefill and decode pools) with their GPU and tensor parallelism, the router, the link."""
    def shape(count: int, g: object, t: object) -> str:
        return f"{plural(int(count), 'replica')} of {t or tp} x {_gpu_text(g, gpu)}"

    routers = cluster["router"]  # (summary.json holds the scenario as resolved: its default router included)
    router = ", ".join(routers) if isinstance(routers, list) else str(routers)
    if cluster.get("prefill") and cluster.get("decode"):
        pools = "; ".join(f"{name}: {shape(p.get('replicas', 1), p.get('gpu'), p.get('tensor_parallel'))}"
                          for name, p in (("prefill", cluster["prefill"]), ("decode", cluster["decode"])))
        link = cluster.get("kv_transfer")
        if isinstance(link, dict):
            link = f"{_sig(link.get('gb_per_s'), '{:,.4g}')} GB/s + {_sig(link.get('latency_ms'), '{:,.4g}')} ms"
        return f"disaggregated: {pools}; KV transfer {link}; router {router} (within each pool)"
    reps = cluster.get("replicas")
    groups = reps if isinstance(reps, list) else [{"count": reps or 1}]
    shapes = ", ".join(shape(grp.get("count", 1), grp.get("gpu"), grp.get("tensor_parallel")) for grp in groups)
    return f"{shapes}; router {router}"


def _kv_line(pools: dict, where: str = "per GPU") -> str:
    def one(pool: dict) -> str:
        gib = pool.get("kv_capacity_gib") or 0.0
        return (f"{pool.get('kv_capacity_tokens', 0):,} tokens = {_sig(gib, '{:,.2f}')} GiB "
                f"({_sig(gib * GIB / GB, '{:,.2f}')} GB) {where}, "
                f"{pool.get('num_blocks', 0):,} blocks of {pool.get('block_size')}")
    distinct = {one(p) for p in pools.values()}
    if len(distinct) == 1:
        return distinct.pop()
    return "; ".join(f"{name}: {one(p)}" for name, p in pools.items())


def scenario_block(run: RunTables) -> str:
    """The scenario of one run: model, GPU, KV capacity, workload figures and policies."""
    s = run.scenario
    r = s.get("resolved", {})
    m, g, w = r.get("model", {}), r.get("gpu", {}), r.get("workload", {})
    wl = s.get("workload", {})
    arrival = ", ".join(f"{k} {v}" for k, v in (wl.get("arrival") or {}).items()) or "from the table"
    lengths = wl.get("lengths") or ("table" if wl.get("kind") == "table" else "custom distributions")
    rate = w.get("mean_request_rate")
    kv_kb = (m.get("kv_bytes_per_token") or 0) / 1e3
    workload = (f"{plural(w.get('num_requests') or 0, 'request')} from {w.get('source')} over "
                f"{_sig(w.get('span_s') or 0)} s"
                + (f" (mean {rate:.3f} req/s)" if rate else "") + f"; arrivals: {arrival}; lengths: {lengths}, mean "
                f"prompt {w.get('mean_prompt_tokens') or 0:,.1f} and output {w.get('mean_output_tokens') or 0:,.1f} "
                f"tokens (max {_count(w.get('max_prompt_tokens'))} / {_count(w.get('max_output_tokens'))})")
    cluster = s.get("cluster")
    tp = s.get("tensor_parallel") or 1
    fleet = []  # a fleet: its replicas or pools; the KV row is one replica's pool (the first; a decode one)
    if cluster:
        fleet = [("fleet", _fleet_line(cluster, str(g.get("name")), tp))]
    where = ("per GPU" if not cluster else "per GPU of a decode replica"
             if cluster.get("prefill") and cluster.get("decode") else "per GPU of the first replica")
    items = [
        ("model", f"{m.get('name')} ({_params(m.get('num_params'))} parameters, {m.get('num_layers')} "
                  f"layers, max length {m.get('max_model_len')} tokens, KV {_sig(kv_kb)} KB per token)"),
        ("GPU", f"{tp} x {g.get('name')} ({_sig(g.get('memory_gib', 0))} GiB, "
                f"{_sig(g.get('hbm_gb_per_s', 0))} GB/s HBM, {_sig(g.get('tflops', 0))} TFLOP/s); memory "
                f"utilization {s.get('gpu_memory_utilization')}" + ("; the fleet's default" if cluster else "")),
        *fleet,
        ("KV cache", _kv_line(r.get("kv_pools", {}), where)),
        ("workload", workload),
        ("policies", "; ".join(_policy_line(p) for p in s.get("policies", []))),
        # (engine: the host-cost profile every policy's steps pay, not the policy's scheduler)
        ("step time", ", ".join(f"{'host-cost engine' if k == 'engine' else k} {v}"
                                for k, v in (s.get("step_time") or {}).items() if v is not None)),
        ("generated", f"{s.get('generated_at', '?')} (Python {s.get('python', '?')})"),
    ]
    rows = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in items)
    desc = s.get("description")
    name = str(s.get("name", run.label))
    # the folder's label only where it says more than the name (runs compared side by side are labelled by it)
    label = f" <span class='muted'>(folder {html.escape(run.label)})</span>" if run.label != name else ""
    return (f"<h3>{html.escape(name)}{label}</h3>"
            + (f"<p class='muted'>{html.escape(str(desc))}</p>" if desc else "") + f"<dl>{rows}</dl>")


def _run_sections(runs: Sequence[RunTables], colors: dict[str, str]) -> list[Section]:
    """The figures of simulated runs (those with summary.json), on their tables stacked."""
    with_run = [r for r in runs if r.summary is not None]
    if not with_run:
        return []
    policies = pd.concat([r.policies for r in with_run])
    paper = [is_paper_scenario(r.scenario) for r in with_run]
    # only policies of a run that is one of the paper's setups get the published bar beside them
    paper_policy = pd.concat([pd.Series(p, index=r.policies.index) for r, p in zip(with_run, paper)])
    requests = concat([r.requests for r in with_run])
    timeline = concat([r.timeline for r in with_run])
    snapshots = concat([r.snapshots for r in with_run])
    kv_groups = concat([r.groups for r in with_run])
    esc = html.escape
    sections = [Section(
        "Memory waste per policy",
        "Time-weighted share of the KV pool in each class, the shape of the PagedAttention paper's Fig. 2. "
        + (f"Hatched bars are the paper's published figures ({esc(PAPER_CITATION)}), drawn because this scenario "
           "is one of its setups (an OPT model, ShareGPT- or Alpaca-like lengths, Poisson arrivals); they were "
           "measured under load and have no 'free' class, so compare them with our bars' non-free part."
           if any(paper) else "The paper's published bars appear only for its setups (an OPT model, ShareGPT- or "
                              "Alpaca-like lengths, Poisson arrivals)."),
        figures.memory_breakdown(policies.assign(preset=policies["preset"].where(paper_policy)),
                                 FIG2 if any(paper) else None))]
    for r in with_run:
        d = r.summary.get("decomposition")
        if d and d.get("targets"):
            sections.append(Section(
                "What each knob explains" + (f" ({r.label})" if len(with_run) > 1 else ""),
                f"Each policy's difference from {esc(str(d.get('base')))}, the scenario's first policy, split by "
                "the knob that made it: the policy is reached one knob at a time and every intermediate policy "
                "runs on the same requests; a segment is the change its knob made, the diamond the total "
                "(summary.json: decomposition; the table above gives every step).",
                figures.decomposition(d) if _has_shares(d) else None,
                "no metric has a value under both policies (no request finished)"))
    no_bins = "no time bin was recorded (no request was served)"
    finished = requests is not None and bool((requests["status"].astype(str) == "finished").any())
    sections += [
        Section("Memory, batch and queue over time",
                "Per policy, the KV pool's classes over time (stacked, % of capacity); below, on the same time axis, "
                "the mean number of running requests (holding KV cache) and of waiting requests in each time bin "
                "(timeline.parquet).",
                figures.memory_timeline(timeline, colors) if timeline is not None else None, no_bins),
    ]
    if kv_groups is not None and len(kv_groups):
        sections.append(Section(
            "KV memory by layer group",
            "Policies of several KV groups (sliding-window, chunked-local and Mamba layers beside full attention; "
            "the README's 'Modern KV layouts'): the slots each group class holds over time, stacked, in token slots "
            "of one group's page (a class's groups move alike and are drawn together; Mamba states are whole "
            "pages). Paged policies hold the pages of the blocks each group still needs (window groups free theirs "
            "as they leave the window); contiguous ones the slabs' share of each group. Each point is the mean over "
            "a time bin of the state after each step or span starting in it (kv_groups.parquet).",
            figures.group_memory_timeline(kv_groups, colors)))
    sections += [
        Section("KV address space",
                "Each policy's KV pool, slot 0 on the left, at the moment of most waiting requests: contiguous "
                "policies hold one slab per request (reservation and internal fragmentation inside it, holes between "
                "slabs), paged policies scatter blocks. External fragmentation: free slots while a request waits for "
                "memory (kv_snapshots.parquet). A fleet's strip is the replica that had the most waiting requests, "
                "named under it.",
                figures.address_space(snapshots, list(colors)) if snapshots is not None else None,
                "no snapshot was kept (no step ran)"),
        Section("Latency distributions",
                "Cumulative distributions over finished requests (log time axes): time to first token, time per "
                "output token after the first, end-to-end latency, and normalized latency (end-to-end / output "
                "tokens, the paper's metric) (requests.parquet).",
                figures.latency_cdfs(requests, colors) if finished else None, "no request finished"),
        Section("Throughput and preemptions over time",
                "Tokens sampled, requests finished and sequences preempted per second: thick lines are a rolling "
                f"mean over {figures.ROLLING_BINS} time bins (the window's count over its width, centred; the "
                "subtitle gives the window in seconds), faint lines each bin. The preemptions panel is left out "
                "when no policy preempted (timeline.parquet).", figures.throughput_timeline(timeline, colors) if timeline is not None else None,
                no_bins),
    ]
    if figures.shares_blocks(timeline):
        sections.append(Section(
            "Block sharing over time",
            "Policies that share paged blocks: the share of newly admitted prompt tokens served by the prefix "
            "cache, and the KV memory in use against what the same sequences would hold without sharing "
            "(parallel samples, beams and prefix hits share blocks; the gap is the paper's Fig. 15 saving). "
            "Totals are in the summary: prefix_hit_rate_tokens, memory_saved_by_sharing (timeline.parquet).",
            figures.sharing_timeline(timeline, colors)))
    return sections


def _block_size_axis(sweep: pd.DataFrame) -> str | None:
    """The sweep's varying block-size column (``block_size`` or ``policies.*.block_size``), if any."""
    return next((a for a in figures.sweep_axes(sweep) if a.split(".")[-1] == "block_size"), None)


def _sweep_sections(runs: Sequence[RunTables], colors: dict[str, str]) -> list[Section]:
    sweep = concat([r.sweep for r in runs])
    capacity = concat([r.capacity for r in runs])
    sections = []
    if sweep is not None:
        axes = figures.sweep_axes(sweep)
        block = _block_size_axis(sweep)
        if RATE_AXIS in axes or (block is None and axes):  # (no varying axis: nothing to draw against)
            sections.append(Section(
                "Sweep: latency vs request rate",
                "Mean normalized latency at each sweep point, one line per policy: the shape of the PagedAttention "
                "paper's Fig. 12; a policy's line turns up where the rate exceeds what it sustains. Runs that "
                "differ only by seed are averaged, with their standard deviation as error bars; other varying "
                "axes (block size, preemption mode, ...) are dashed lines (sweep.parquet).",
                figures.latency_vs_rate(sweep, colors, capacity=capacity)))
        if block is not None:
            sections.append(Section(
                "Sweep: block size (and recompute vs swap)",
                "Mean normalized latency against the block size (log axis), one line per policy: the paper's "
                "block-size ablation (Fig. 18b) and, when the sweep varies the preemption mode, recompute vs swap "
                "(Fig. 19b) as dashed lines. Mean over seeds, standard deviation as error bars (sweep.parquet).",
                figures.latency_vs_rate(sweep, colors, x=block)))
    if capacity is not None:
        sections.append(Section(
            "Sweep: sustainable request rate",
            "The highest request rate each policy sustains, as the sweep's capacity table gives it; mean over "
            "seeds with the standard deviation as error bars (capacity.parquet). " + _slo_caption(runs),
            figures.sustainable_rates(capacity, colors)))
    return sections


def _slo_caption(runs: Sequence[RunTables]) -> str:
    """What the capacity search asked, from sweep.json (HTML, escaped)."""
    parts = []
    for r in runs:
        cap = (r.sweep_info or {}).get("capacity")
        if cap:
            parts.append(f"SLO: <code>{html.escape(str(cap.get('slo')))}</code>, bisected to "
                         f"{html.escape(str(cap.get('tolerance')))} along <code>{html.escape(str(cap.get('axis')))}"
                         f"</code> between {html.escape(str(cap.get('min')))} and {html.escape(str(cap.get('max')))}.")
    return " ".join(dict.fromkeys(parts))


_RATE = TABLE_COLUMNS["sustainable_request_rate"]
CAPACITY_COLUMNS = [  # column, head, format
    ("sustainable_request_rate", f"{_RATE.short} {_RATE.unit}", "{:.4g}"),
    ("status", "status", "{}"),
    ("lowest_rate_tried", "lowest tried", "{:.4g}"),
    ("highest_rate_tried", "highest tried", "{:.4g}"),
    ("lowest_failing_rate", "lowest failing", "{:.4g}"),
    ("num_runs", "runs", "{}"),
    ("error", "error", "{}"),
]


def capacity_table(capacity: pd.DataFrame) -> str:
    """Every capacity search: the other axes' values, the policy, its sustainable rate and how it was found."""
    axes = [a for a in figures.sweep_axes(capacity)]
    cols = [c for c in CAPACITY_COLUMNS if c[0] in capacity.columns]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["policy", *axes, *(c[1] for c in cols)])
    rows = []
    for _, r in capacity.iterrows():
        cells = [html.escape(str(r["policy"]))] + [html.escape(str(r[a])) for a in axes]
        for key, _, fmt in cols:
            v = r[key]
            none = key == "sustainable_request_rate" and (v is None or v != v)
            cells.append("none" if none else _fmt(fmt, v))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<div class='wide'><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"


def ratio_table(capacity: pd.DataFrame) -> str:
    """Each policy's mean sustainable rate (over seeds) divided by every other's: the paper's headline
    comparison. Only when no axis but the seed varies (else the ratios would mix settings)."""
    if [a for a in figures.sweep_axes(capacity) if a.split(".")[-1] != "seed"]:
        return ""
    stats = figures.over_seeds(capacity, ["policy"], "sustainable_request_rate")
    order = list(dict.fromkeys(capacity["policy"].astype(str)))
    means = dict(zip(stats["policy"].astype(str), stats["mean"]))
    status = capacity["status"].astype(str) if "status" in capacity.columns else pd.Series("", capacity.index)
    above = set(capacity.loc[status == "above max", "policy"].astype(str))  # a lower bound, not a capacity
    head = "".join(f"<th>÷ {html.escape(p)}</th>" for p in order)
    rows = []
    for p in order:
        cells = []
        for q in order:
            bound = {(True, False): "≥ ", (False, True): "≤ ", (True, True): "? "}.get((p in above, q in above), "")
            ok = means[q] and means[q] == means[q] and means[p] == means[p]
            cells.append(bound + _fmt("{:.2f}×", means[p] / means[q]) if ok and p != q else "-")
        rows.append(f"<tr><td>{html.escape(p)}</td><td>{'≥ ' if p in above else ''}{_fmt('{:.4g}', means[p])}</td>"
                    + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<div class='wide'><table><thead><tr><th>policy</th><th>mean {_RATE.short} {_RATE.unit}</th>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div><p class='muted'>Row ÷ column: how many times the column "
            "policy's sustainable rate (mean over seeds) the row policy sustains; ≥: the row policy met the SLO at "
            "the highest rate tried, so its capacity is higher; none counts as missing.</p>")


def sweep_block(runs: Sequence[RunTables]) -> str:
    """The sweeps' descriptions, capacity tables, ratios and failed runs (from sweep.json and capacity.parquet)."""
    out = []
    for r in runs:
        info = r.sweep_info or {}
        if r.sweep is None:
            continue
        axes = "; ".join(f"{a.get('column')}: {', '.join(map(str, a.get('values', [])))}" for a in info.get("axes", []))
        desc = f"<p class='muted'>{html.escape(str(info['description']))}</p>" if info.get("description") else ""
        ran = (f"<p>{plural(info.get('num_points', 0), 'point')} over {html.escape(axes)}; "
               f"{plural(info.get('num_runs', 0), 'run')}, "
               f"{info.get('num_reused', 0):,} reused from an earlier run, {info.get('wall_s', 0):,.1f} s on the "
               f"{html.escape(str(info.get('executor')))} executor.</p>" if info else "")
        out.append(f"<h3>{html.escape(str(info.get('name', r.label)))}</h3>{desc}{ran}")
        if r.capacity is not None and "sustainable_request_rate" in r.capacity.columns:
            out.append(f"<p>{_slo_caption([r])}</p>" + capacity_table(r.capacity) + ratio_table(r.capacity))
        for f in info.get("failures", []):
            out.append(f"<p class='missing'>Failed: {html.escape(str(f.get('what')))}: "
                       f"{html.escape(str(f.get('error')))}</p>")
    return "".join(out)


REPLICA_COLUMNS = [  # replicas.parquet column, head, format
    ("num_routed", "requests routed", "{:,}"), ("busy_fraction", "busy", "{:.1%}"), ("kv_in_use", "KV in use", "{:.1%}"),
    ("request_throughput", "req/s", "{:.3f}"), ("median_ttft_ms", "median TTFT (ms)", "{:,.0f}"),
    ("p99_ttft_ms", "p99 TTFT (ms)", "{:,.0f}"), ("median_tpot_ms", "median TPOT (ms)", "{:.1f}"),
    ("num_preemptions", "preemptions", "{:,}"), ("prefix_hit_rate_tokens", "prefix hit", "{:.1%}"),
]


def fleet_block(runs: Sequence[RunTables]) -> str:
    """A fleet's own figures (summary.json's ``fleet``): one row per policy (router, load imbalance, prefix hit
    rate; a disaggregated fleet's pools and KV transfers), then each policy's replicas (replicas.parquet)."""
    esc = html.escape
    out = []
    for r in runs:
        fleet = (r.summary or {}).get("fleet") or {}
        if not fleet:
            continue
        labels = dict(zip(r.policies["policy"], r.policies.index))
        facts = {labels.get(p, p): dict(fleet_facts(f)) for p, f in fleet.items()}
        heads = list(dict.fromkeys(k for f in facts.values() for k in f))
        rows = "".join(f"<tr><td>{esc(str(p))}</td>" + "".join(f"<td>{esc(f.get(k, '-'))}</td>" for k in heads)
                       + "</tr>" for p, f in facts.items())
        out.append(f"<div class='wide'><table><thead><tr><th>policy</th>{''.join(f'<th>{esc(h)}</th>' for h in heads)}"
                   f"</tr></thead><tbody>{rows}</tbody></table></div>")
        reps = r.replicas
        if reps is None or not len(reps):
            continue
        cols = [c for c in REPLICA_COLUMNS if c[0] in reps.columns and reps[c[0]].notna().any()]
        pool = "pool" in reps.columns
        for policy, g in reps.groupby("policy", sort=False):
            body = "".join(
                f"<tr><td>{int(x.replica)}</td>" + (f"<td>{esc(str(x.pool))}</td>" if pool else "")
                + f"<td>{int(x.tensor_parallel)} x {esc(str(x.gpu))}</td>"
                + "".join(f"<td>{_fmt(fmt, None if pd.isna(getattr(x, c)) else getattr(x, c))}</td>"
                          for c, _, fmt in cols) + "</tr>" for x in g.itertuples(index=False))
            out.append(f"<details><summary>{esc(str(policy))}: {plural(len(g), 'replica')}</summary>"
                       f"<div class='wide'><table><thead><tr><th>replica</th>{'<th>pool</th>' if pool else ''}"
                       f"<th>GPU</th>{''.join(f'<th>{esc(h)}</th>' for _, h, _ in cols)}</tr></thead>"
                       f"<tbody>{body}</tbody></table></div></details>")
    if not out:
        return ""
    return ("<p class='muted'>Load imbalance: max / mean over replicas of requests routed and of time-averaged KV "
            "in use (1 = balanced). Each replica's metrics are over the fleet's window (replicas.parquet; "
            "summary.json: fleet).</p>" + "".join(out))


def _title(runs: Sequence[RunTables]) -> str:
    if len(runs) == 1:
        return str(runs[0].scenario.get("name") or (runs[0].sweep_info or {}).get("name") or runs[0].label)
    return "Comparison: " + " vs ".join(r.label for r in runs)


def render(runs: Sequence[RunTables]) -> str:
    """The whole page for one run or several side by side."""
    names: list[str] = []
    for r in runs:
        names += list(r.policies.index)
        for t in (r.sweep, r.capacity):
            if t is not None:
                names += list(dict.fromkeys(t["policy"].astype(str)))
    colors = figures.policy_colors(names)
    sections = _run_sections(runs, colors) + _sweep_sections(runs, colors)
    blocks, template = [], {}
    for i, s in enumerate(sections):
        block, figure_template = _figure_html(s, i)
        blocks.append(block)
        template = figure_template or template
    with_run = [r for r in runs if r.summary is not None]
    summary = summary_table(pd.concat([r.policies for r in with_run])) if with_run else ""
    title = html.escape(_title(runs))
    labelled = (" Policies are labelled <code>folder / policy</code>." if len(runs) > 1 else "")
    desc = html.escape(str(runs[0].scenario.get("description", "") or (runs[0].sweep_info or {}).get(
        "description", ""))) if len(runs) == 1 else ""
    sweeps = sweep_block(runs)
    fleet = fleet_block(with_run)
    decomp = "".join((f"<h3>{html.escape(r.label)}</h3>" if len(with_run) > 1 else "")
                     + decomposition_table(r.summary["decomposition"])
                     for r in with_run if r.summary.get("decomposition"))
    plotly_js = get_plotlyjs()
    version = re.search(r"plotly\.js v([0-9.]+)", plotly_js[:400])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}: KV cache policies</title>
<style>{CSS}</style>
<script type="text/javascript">{plotly_js}</script></head>
<body>
<h1>{title}</h1><p class="muted">{desc}</p>
<p class="muted">kvsim report, built {datetime.now(timezone.utc).isoformat(timespec="seconds")} from
{html.escape(", ".join(str(r.path) for r in runs))}.{labelled} Self-contained: plotly.js
{version.group(1) if version else ""} is inlined, nothing is fetched. Long timelines and CDFs are downsampled
for the page; each figure says where.</p>
{"<h2>Scenario</h2>" + "".join(scenario_block(r) for r in with_run) if with_run else ""}
{"<h2>Summary</h2>" + summary if summary else ""}
{"<h2>Fleet</h2>" + fleet if fleet else ""}
{"<h2>Decomposition: what each knob explains</h2>" + decomp if decomp else ""}
{"<h2>Sweep</h2>" + sweeps if sweeps else ""}
<h2>Figures</h2>
{chr(10).join(blocks)}
<script type="text/javascript">const KVSIM_TEMPLATE = {_safe_json(template)};{RENDER_JS}</script>
</body></html>
"""


def write_report(run_dir: str | Path) -> Path:
    """Build ``report.html`` in a run folder from its result files (``sim run`` calls this)."""
    d = Path(run_dir)
    out = d / "report.html"
    out.write_text(render([load_run(d)]), encoding="utf-8")
    return out


def default_output(run_dirs: Sequence[Path]) -> Path:
    """One folder: its report.html. Several: ``compare-<a>-<b>...html`` beside the first folder."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report.html"
    stem = "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(p).resolve().name) for p in run_dirs)[:120]
    return Path(run_dirs[0]).resolve().parent / f"compare-{stem}.html"


def build_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """``sim report``: rebuild a run's report from its saved results, or compare several runs."""
    paths = [Path(p) for p in run_dirs]
    if len(paths) == 1 and (paths[0] / PLAN_MARK).is_file():  # a `sim plan` folder: its own page
        from reports.plan import render as render_plan

        target = Path(out) if out is not None else paths[0] / "report.html"
        draw, writer = (lambda: render_plan(paths[0])), "plan"  # noqa: E731
    else:
        runs = load_runs(paths)
        target = Path(out) if out is not None else default_output(paths)
        writer = "run" if any(r.summary for r in runs) else "sweep"  # (a sweep's was said to be "sim run"'s)
        draw = lambda: render(runs)  # noqa: E731
    try:
        page = draw()
    except ResultsError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        # NOTE: the files were read, but are not what sim run/sweep/plan writes (edited, truncated, another version)
        raise ResultsError(f"{', '.join(map(str, paths))}: the result files are not as sim {writer} writes them; "
                           f"cannot draw the report ({e.__class__.__name__}: {str(e)[:120]})") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target
