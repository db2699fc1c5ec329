"""Figure builders: result tables in, plotly figures out. No metric is computed here."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

MEMORY_CLASSES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
MEMORY_LABELS = {
    "token_states": "token states",
    "reservation": "reservation",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation",
    "free": "free",
}
MEMORY_COLORS = {
    "token_states": "#2ca02c",
    "reservation": "#1f77b4",
    "internal_fragmentation": "#ff7f0e",
    "external_fragmentation": "#d62728",
    "free": "#c7c7c7",
}
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac",
           "#eeca3b"]


def policy_colors(names: list[str]) -> dict[str, str]:
    """One colour per policy, the same in every figure of a report."""
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=-0.2), **kw)
    return fig


def memory_breakdown(summary: dict) -> go.Figure:
    """Stacked bars: where the KV pool went, time-averaged, per policy (the paper's Fig. 2 shape)."""
    names = list(summary["policies"])
    fig = go.Figure()
    for c in MEMORY_CLASSES:
        vals = [100 * (summary["policies"][n].get(f"memory.{c}") or 0.0) for n in names]
        fig.add_bar(name=MEMORY_LABELS[c], x=names, y=vals, marker_color=MEMORY_COLORS[c],
                    hovertemplate="%{x}<br>" + MEMORY_LABELS[c] + ": %{y:.2f} %<extra></extra>")
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title="share of KV cache capacity (%)", range=[0, 100])
    fig.update_xaxes(title="policy")
    return _layout(fig, "KV cache memory: where it goes (time-weighted)")


def latency_cdfs(requests: pd.DataFrame, colors: dict[str, str]) -> go.Figure:
    """CDF of normalized latency (s/token) per policy, finished requests only."""
    fig = go.Figure()
    fin = requests[requests.status == "finished"]
    for name, g in fin.groupby("policy", observed=True, sort=False):
        v = np.sort(g.normalized_latency_s.to_numpy())
        if not len(v):
            continue
        y = np.arange(1, len(v) + 1) / len(v)
        if len(v) > 2000:  # draw 2000 evenly spaced quantiles
            idx = np.linspace(0, len(v) - 1, 2000).astype(int)
            v, y = v[idx], y[idx]
        fig.add_scatter(x=v, y=y, mode="lines", name=str(name), line=dict(color=colors.get(str(name))),
                        hovertemplate="%{x:.4f} s/token<br>CDF %{y:.3f}<extra>" + str(name) + "</extra>")
    fig.update_xaxes(title="normalized latency (s/token)", type="log")
    fig.update_yaxes(title="fraction of finished requests", range=[0, 1])
    return _layout(fig, "Normalized latency (end-to-end / output tokens)")
