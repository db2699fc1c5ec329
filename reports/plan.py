"""The page of a ``sim plan`` folder (``plan.parquet``, ``best.csv``, ``plan.json``): per rate, cost per hour
against goodput for every configuration that ran, its Pareto front, and the winning configuration.
Self-contained (plotly.js inlined once); opens from disk with no network.

    write_plan_report(plan_dir)     # <plan_dir>/report.html
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from reports.results import ResultsError
from sim.schema import plan_label, plural

SHAPE_COLUMNS = ("gpu", "tensor_parallel", "policy", "max_num_seqs", "block_size")


def pareto_front(points: pd.DataFrame) -> pd.DataFrame:
    """The rows no other row beats on both cost (``usd_per_hour``, lower) and goodput
    (``goodput_request_rate``, higher), by increasing cost."""
    front, best = [], -1.0
    for _, r in points.sort_values(["usd_per_hour", "goodput_request_rate"], ascending=[True, False]).iterrows():
        if r["goodput_request_rate"] > best:
            front.append(r)
            best = r["goodput_request_rate"]
    return pd.DataFrame(front)


def _figure(rate_col: str, rate: float, t: pd.DataFrame) -> go.Figure:
    ran = t[t["ran"] & t["error"].isna()].copy()
    fig = go.Figure()
    for passed, name, color in ((True, "meets the SLO", "#2a9d8f"), (False, "misses it", "#e76f51")):
        part = ran[ran["passed"] == passed]
        fig.add_trace(go.Scatter(x=part["usd_per_hour"], y=part["request_throughput"], mode="markers", name=name,
                                 marker={"color": color, "size": 8},
                                 text=[plan_label(r) for _, r in part.iterrows()],
                                 hovertemplate="%{text}<br>$%{x:.2f}/h<br>%{y:.3f} req/s<extra></extra>"))
    front = pareto_front(ran[ran["passed"] == True])  # noqa: E712
    if len(front):
        fig.add_trace(go.Scatter(x=front["usd_per_hour"], y=front["goodput_request_rate"], mode="lines",
                                 name="Pareto front", line={"color": "#264653", "shape": "hv"}))
    fig.update_layout(title=f"{rate_col} {rate:g}: cost vs goodput", xaxis_title="$ per hour",
                      yaxis_title="req/s served (goodput where the SLO is met)", height=420,
                      template="plotly_white")
    return fig


def render(folder: Path) -> str:
    try:
        info = json.loads((folder / "plan.json").read_text())
        table = pd.read_parquet(folder / "plan.parquet")
        best = pd.read_csv(folder / "best.csv")
    except (OSError, ValueError) as e:
        raise ResultsError(f"{folder}: not a plan folder ({e})") from None
    rate_col = info["rate_column"]
    esc = html.escape
    parts = [f"<h1>{esc(info['name'])}: the cheapest deployment that meets the SLO</h1>",
             f"<p>SLO: {esc(info['slo'])}. Router: {esc(info['router'])}. Replicas {info['replicas'][0]} to "
             f"{info['replicas'][1]}; {info['num_shapes']} shapes; {info['num_configurations']:,} configurations, "
             f"{info['num_runs'] + info['num_reused']:,} simulated ({info['num_runs']:,} now, "
             f"{info['num_reused']:,} reused), the rest inferred by monotonicity; {info['wall_s']:.1f} s "
             f"({esc(info['executor'])}). Prices ($/GPU-hour): "
             + ", ".join(f"{esc(g)} {p:.2f}" for g, p in info["gpus"].items()) + ".</p>",
             "<h2>Winners</h2>", "<div style='overflow-x:auto'>"
             + best.to_html(index=False, na_rep="", float_format=lambda v: f"{v:,.3f}", classes="best", border=0)
             + "</div>"]
    first = True
    for rate, t in table.groupby(rate_col, sort=True):
        parts.append(f"<h2>{esc(rate_col)} {rate:g}</h2>")
        parts.append(_figure(rate_col, rate, t).to_html(full_html=False, include_plotlyjs=first))
        first = False
        w = best[best[rate_col] == rate]
        if len(w) and bool(w.iloc[0]["met"]):
            r = w.iloc[0]
            parts.append(f"<p>Winner: <b>{esc(plan_label(r))}</b>, {plural(int(r['num_gpus']), 'GPU')}, "
                         f"${r['usd_per_hour']:.2f}/h, ${r['usd_per_million_tokens']:.3f} per million tokens.</p>")
        else:
            parts.append("<p>No configuration in the plan meets the SLO at this rate.</p>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table.best{border-collapse:collapse;"
             "font-size:12px}table.best td,table.best th{padding:2px 6px;border-bottom:1px solid #ddd}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(info['name'])}</title>"
            f"<style>{style}</style></head><body>" + "\n".join(parts) + "</body></html>")


def write_plan_report(folder: str | Path) -> Path:
    """``sim.outputs.ReportWriter`` for a plan folder: ``report.html`` beside its tables."""
    folder = Path(folder)
    out = folder / "report.html"
    out.write_text(render(folder), encoding="utf-8")
    return out
