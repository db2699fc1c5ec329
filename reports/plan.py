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
from sim.schema import PLAN_MARK, plan_label, plural, sig4

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


WINNER_COLUMNS = [  # best.csv column, head, format (the configuration itself is one column, in words)
    ("num_passing_shapes", "shapes passing", "{:,.0f}"), ("num_gpus", "GPUs", "{:,.0f}"),
    ("usd_per_hour", "$ per hour", "${:,.2f}"), ("usd_per_million_tokens", "$ per M tokens", "${:,.3f}"),
    ("request_throughput", "req/s served", "{:,.3f}"), ("offered_request_rate", "req/s offered", "{:,.3f}"),
]


def _figure(rate_col: str, rate: float, t: pd.DataFrame) -> go.Figure | None:
    """Cost against requests served for every configuration that ran at this rate; the Pareto front of
    those that meet the SLO (its goodput). None when none ran (all inferred by monotonicity)."""
    ran = t[t["ran"] & t["error"].isna()].copy()
    if ran.empty:
        return None
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
                                 name="Pareto front (goodput)", line={"color": "#264653", "shape": "hv"}))
    fig.update_layout(title=f"{rate_col} {rate:g}: cost vs requests served", xaxis_title="$ per hour",
                      yaxis_title="requests per second served", height=420, template="plotly_white")
    return fig


def _cell(fmt: str, v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    return html.escape(sig4(float(v)) if fmt == "sig4" else fmt.format(v))


def _winners(best: pd.DataFrame, rate_col: str, slo: list[str]) -> str:
    """best.csv as a table: the rate, the winning configuration in words, its cost and what it served, the
    SLO's metrics, and the runner-up."""
    esc = html.escape
    cols = [c for c in WINNER_COLUMNS if c[0] in best] + [(m, m.replace("_", " "), "sig4") for m in slo if m in best]
    head = (f"<th>{esc(rate_col.replace('_', ' '))}</th><th style='text-align:left'>cheapest configuration</th>"
            + "".join(f"<th>{esc(h)}</th>" for _, h, _ in cols) + "<th style='text-align:left'>runner-up</th>")
    rows = []
    for _, r in best.iterrows():
        if not bool(r["met"]):
            near = r.get("nearest")
            rows.append(f"<tr><td>{r[rate_col]:g}</td><td colspan='{len(cols) + 2}' style='text-align:left'>nothing "
                        "in the plan meets the SLO" + (f"; nearest: {esc(near)}" if isinstance(near, str) else "")
                        + "</td></tr>")
            continue
        rows.append(f"<tr><td>{r[rate_col]:g}</td><td style='text-align:left'>{esc(plan_label(r))}</td>"
                    + "".join(f"<td>{_cell(fmt, r[c])}</td>" for c, _, fmt in cols)
                    + "<td style='text-align:left'>"
                    + (esc(r["runner_up"]) if isinstance(r.get("runner_up"), str) else "") + "</td></tr>")
    return f"<div class='wide'><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"


def render(folder: Path) -> str:
    from plotly.offline import get_plotlyjs

    from reports.html import CSS

    def read(name: str, how):
        try:
            return how(folder / name)
        except (OSError, ValueError) as e:  # (each was "not a plan folder", in a folder of sim plan's files)
            raise ResultsError(f"{folder / name}: cannot read ({e.__class__.__name__}: {str(e)[:160]})") from None

    info = read(PLAN_MARK, lambda p: json.loads(p.read_text()))
    table, best = read("plan.parquet", pd.read_parquet), read("best.csv", pd.read_csv)
    if not isinstance(info, dict) or "rate_column" not in info:
        raise ResultsError(f"{folder / PLAN_MARK}: not written by `sim plan` (no 'rate_column')")
    rate_col = info["rate_column"]
    for name, t in (("plan.parquet", table), ("best.csv", best)):
        if rate_col not in t.columns:  # (a KeyError: 'rate')
            raise ResultsError(f"{folder / name}: no {rate_col!r} column (as sim plan writes it)")
    slo = [m for m in (info.get("slo_metrics") or []) if m in best] or [
        c for c in best.columns if c.endswith("_ms") or c.endswith("_s")]
    esc = html.escape
    parts = [f"<h1>{esc(info['name'])}: the cheapest deployment that meets the SLO</h1>",
             f"<p>SLO: {esc(info['slo'])}. Router: {esc(info['router'])}. Replicas {info['replicas'][0]} to "
             f"{info['replicas'][1]}; {plural(info['num_shapes'], 'shape')}; "
             f"{plural(info['num_configurations'], 'configuration')}, "
             f"{info['num_runs'] + info['num_reused']:,} simulated ({info['num_runs']:,} now, "
             f"{info['num_reused']:,} reused), the rest inferred by monotonicity; {info['wall_s']:.1f} s "
             f"({esc(info['executor'])}). Prices ($/GPU-hour): "
             + ", ".join(f"{esc(g)} {p:.2f}" for g, p in info["gpus"].items()) + ".</p>",
             "<h2>Winners</h2>", _winners(best, rate_col, slo),
             "<p class='muted'>Every configuration tried, with its metrics, cost, pass or fail and why it was pruned: "
             "plan.parquet; the winners: best.csv.</p>"]
    for i, (rate, t) in enumerate(table.groupby(rate_col, sort=True)):
        parts.append(f"<h2>{esc(rate_col)} {rate:g}</h2>")
        fig = _figure(rate_col, rate, t)
        if fig is None:
            parts.append("<p class='missing'>Not drawn: no configuration ran at this rate (each was inferred by "
                         "monotonicity from another rate's runs).</p>")
        else:
            parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plan{i}"))
        w = best[best[rate_col] == rate]
        if len(w) and bool(w.iloc[0]["met"]):
            r = w.iloc[0]
            parts.append(f"<p>Winner: <b>{esc(plan_label(r))}</b>, {plural(int(r['num_gpus']), 'GPU')}, "
                         f"${r['usd_per_hour']:.2f}/h, ${r['usd_per_million_tokens']:.3f} per million tokens.</p>")
        else:
            near = w.iloc[0].get("nearest") if len(w) else None
            parts.append("<p>No configuration in the plan meets the SLO at this rate"
                         + (f"; the nearest: {esc(near)}" if isinstance(near, str) else "") + ".</p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(info['name'])}</title>"
            f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            + "\n".join(parts) + "</body></html>")


def write_plan_report(folder: str | Path) -> Path:
    """``sim.outputs.ReportWriter`` for a plan folder: ``report.html`` beside its tables."""
    folder = Path(folder)
    out = folder / "report.html"
    out.write_text(render(folder), encoding="utf-8")
    return out
