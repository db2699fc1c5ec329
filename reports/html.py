"""One self-contained HTML page per run: plotly.js inlined once, every figure as escaped JSON."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from reports import figures

HEADLINE = [
    ("request_throughput", "req/s", "{:.3f}", "max"),
    ("output_throughput", "output tok/s", "{:.0f}", "max"),
    ("mean_normalized_latency_s", "mean norm. latency (s/tok)", "{:.4f}", "min"),
    ("median_ttft_ms", "median TTFT (ms)", "{:.0f}", "min"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.0f}", "min"),
    ("median_tpot_ms", "median TPOT (ms)", "{:.1f}", "min"),
    ("mean_batch_size", "mean batch", "{:.1f}", "max"),
    ("num_preemptions", "preemptions", "{}", "min"),
    ("memory.token_states", "KV in token states", "{:.1%}", "max"),
]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#222}
h1{margin-bottom:.2rem} .muted{color:#666} table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}
th,td{border-bottom:1px solid #ddd;padding:.3rem .6rem;text-align:right} th:first-child,td:first-child{text-align:left}
td.best{font-weight:bold;background:#eaf5ea} .figure{width:100%;height:460px;margin:1.5rem 0}
dl{display:grid;grid-template-columns:max-content auto;gap:.2rem 1rem} dt{color:#666}
"""


def _safe_json(obj) -> str:
    """JSON that cannot close the surrounding <script> element, whatever text it carries."""
    return json.dumps(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _figure_div(fig: go.Figure, idx: int) -> str:
    spec = json.loads(fig.to_json())
    return (f'<div id="fig{idx}" class="figure" data-figure="{idx}"></div>\n<script>Plotly.newPlot("fig{idx}", '
            f'{_safe_json(spec.get("data", []))}, {_safe_json(spec.get("layout", {}))}, '
            '{"responsive": true, "displaylogo": false});</script>')


def _summary_table(summary: dict) -> str:
    pols = summary["policies"]
    best = {}
    for key, _, _, how in HEADLINE:
        vals = [m.get(key) for m in pols.values() if m.get(key) is not None]
        if vals:
            best[key] = max(vals) if how == "max" else min(vals)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _, _ in HEADLINE)
    rows = []
    for name, m in pols.items():
        cells = []
        for key, _, fmt, _ in HEADLINE:
            v = m.get(key)
            cls = ' class="best"' if v is not None and v == best.get(key) else ""
            cells.append(f"<td{cls}>{'-' if v is None else html.escape(fmt.format(v))}</td>")
        counts = f"{m['num_finished']} / {m['num_rejected']} / {m['num_unfinished']}"
        rows.append(f"<tr><td>{html.escape(name)}</td>{''.join(cells)}<td>{counts}</td></tr>")
    return (f"<table><thead><tr><th>policy</th>{head}<th>finished / rejected / unfinished</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table><p class='muted'>Bold: best value in its column.</p>")


def _scenario_block(summary: dict) -> str:
    s = summary["scenario"]
    r = s.get("resolved", {})
    m, g, w = r.get("model", {}), r.get("gpu", {}), r.get("workload", {})
    pools = r.get("kv_pools", {})
    pool = next(iter(pools.values()), {})
    items = [
        ("model", f"{m.get('name')} ({m.get('num_params', 0) / 1e9:.1f} B params, max length {m.get('max_model_len')})"),
        ("GPU", f"{s.get('tensor_parallel', 1)} x {g.get('name')} ({g.get('memory_gib', 0):.0f} GiB, "
                f"{g.get('hbm_gb_per_s', 0):.0f} GB/s)"),
        ("KV cache", f"{pool.get('kv_capacity_tokens', 0):,} tokens, {pool.get('kv_capacity_gib', 0):.2f} GiB per GPU "
                     f"({pool.get('num_blocks')} blocks of {pool.get('block_size')})"),
        ("workload", f"{w.get('num_requests', 0):,} requests over {w.get('span_s', 0):.0f} s from {w.get('source')}; "
                     f"mean prompt {w.get('mean_prompt_tokens') or 0:.1f}, mean output {w.get('mean_output_tokens') or 0:.1f} tokens"),
        ("policies", ", ".join(summary["policies"])),
    ]
    return "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>" for k, v in items) + "</dl>"


def render(summary: dict, requests: pd.DataFrame, steps: pd.DataFrame) -> str:
    colors = figures.policy_colors(list(summary["policies"]))
    figs = [figures.memory_breakdown(summary), figures.latency_cdfs(requests, colors)]
    name = html.escape(str(summary["scenario"].get("name", "")))
    desc = html.escape(str(summary["scenario"].get("description", "")))
    body = "\n".join(_figure_div(f, i) for i, f in enumerate(figs))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{name}: KV cache policies</title>
<style>{CSS}</style>
<script type="text/javascript">{get_plotlyjs()}</script></head>
<body>
<h1>{name}</h1><p class="muted">{desc}</p>
{_scenario_block(summary)}
<h2>Summary</h2>
{_summary_table(summary)}
<h2>Figures</h2>
{body}
</body></html>
"""


def write_report(run_dir: str | Path) -> Path:
    """Build ``report.html`` from the result files in ``run_dir``."""
    d = Path(run_dir)
    summary = json.loads((d / "summary.json").read_text())
    requests = pd.read_parquet(d / "requests.parquet")
    steps = pd.read_parquet(d / "steps.parquet")
    out = d / "report.html"
    out.write_text(render(summary, requests, steps), encoding="utf-8")
    return out
