"""Figure builders: result tables in, plotly figures out.

Each builder takes tables as ``sim run`` writes them (``policy`` column labelled for the page) and
returns one ``go.Figure``. Nothing here computes a metric the simulator owns. What is done for the page
only is downsampling, and each figure says so in its subtitle when it happens:

- CDFs are drawn at most ``MAX_CDF_POINTS`` order statistics per curve (exact values, evenly spaced ranks);
- timelines at most ``MAX_TIMELINE_POINTS`` points per policy: adjacent simulator bins merged (counts
  summed, time averages weighted by bin width, which is exactly the average over the merged bin);
- the KV address space, when a pool has more than ``MAX_STRIP_RUNS`` runs, in pixels of a power-of-two
  number of slots, each showing the class that holds most of its slots.

User text (policy labels) reaches plotly escaped: plotly renders a subset of HTML in its text.
"""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.paper import PAPER_CITATION, PublishedBreakdown
from sim.schema import MEMORY_CLASSES, METRICS, RATE_AXIS, TABLE_COLUMNS, varying_axes
from sim.schema import title as _axis_title  # a metric or a known column with its unit; others by their name

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
    "free": "#d9d9d9",
}
UNCLASSIFIED_COLOR = "#8c8c8c"
# Policies get hues the memory classes do not use (no green, blue, orange, red or light grey), so a policy's
# line never reads as a memory class: 20 policies before a colour repeats.
PALETTE = ("#6a3d9a", "#17becf", "#e377c2", "#222222", "#bcbd22", "#8c564b", "#c5b0d5", "#005f5f", "#ae017e",
           "#7f7f7f", "#b8a000", "#dda0dd", "#556b2f", "#bc8f8f", "#4b0082", "#00ced1", "#ff69b4", "#5d4037",
           "#9acd32", "#708090")
ROLLING_BINS = 15  # throughput panels: rolling mean over this many (display) time bins, raw bins faint beneath

MAX_CDF_POINTS = 1000
MAX_TIMELINE_POINTS = 600
MAX_STRIP_RUNS = 2000
STRIP_PIXELS = 1600
LABEL_CHARS = 32
SUBTITLE_CHARS = 100

# the per-request columns the CDFs draw: column, short name, axis title with unit, hover unit (sim.schema)
CDF_METRICS = tuple((c, TABLE_COLUMNS[c].short, TABLE_COLUMNS[c].title, TABLE_COLUMNS[c].unit)
                    for c in ("ttft_ms", "tpot_ms", "e2el_ms", "normalized_latency_s"))


def text(s: object) -> str:
    """User text made safe for plotly's pseudo-HTML labels (which decode &amp; &lt; &gt; back)."""
    return html.escape(str(s), quote=False)


def short_labels(names: Sequence[str], width: int = LABEL_CHARS) -> dict[str, str]:
    """Labels for legends and ticks: escaped, cut to ``width`` characters with an ellipsis, unique (a
    ``#k`` suffix where two cut names meet). Hover text shows the whole name (a trace's ``meta``)."""
    out: dict[str, str] = {}
    for n in dict.fromkeys(names):
        s = str(n) if len(str(n)) <= width else str(n)[: width - 1] + "…"
        cut, k = s, 2
        while text(cut) in out.values():
            cut, k = f"{s} #{k}", k + 1
        out[n] = text(cut)
    return out


def policy_colors(names: Sequence[str]) -> dict[str, str]:
    """One colour per policy label, in order, the same in every figure of a report."""
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(dict.fromkeys(names))}


def _layout(fig: go.Figure, title: str, subtitle: str = "", height_px: int = 460, top_px: int = 90,
            bottom_px: int = 60, **kw) -> go.Figure:
    """Title with a subtitle (what was downsampled), white template, legend on the right. A long subtitle
    breaks at its '; ' into lines of at most ``SUBTITLE_CHARS`` (a figure 900 px wide shows them whole)."""
    lines = [""]
    for part in subtitle.split("; "):
        if lines[-1] and len(lines[-1]) + 2 + len(part) > SUBTITLE_CHARS:
            lines.append(part)
        else:
            lines[-1] = f"{lines[-1]}; {part}" if lines[-1] else part
    subtitle = "<br>".join(lines)
    top_px += 15 * (len(lines) - 1)
    height_px += 15 * (len(lines) - 1)
    fig.update_layout(title=dict(text=title, subtitle=dict(text=subtitle)), template="plotly_white",
                      height=height_px, margin=dict(l=70, r=20, t=top_px, b=bottom_px),
                      legend=dict(orientation="v", x=1.01, xanchor="left", y=1, yanchor="top"), **kw)
    return fig


def _log_ticks(values: Sequence[float] | np.ndarray) -> dict:
    """A log axis labelled at powers of ten only (no '2 5' between them) when the values span at least
    a decade and a half; narrower ranges keep plotly's labels (a power of ten alone would say too little)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if len(v) and math.log10(v.max() / v.min()) >= 1.5:
        return {"dtick": 1, "minor": {"ticks": "outside", "ticklen": 3, "showgrid": False}}
    return {}


def _policy_legend(fig: go.Figure, legend: str, y: float, title: str = "") -> None:
    """A second legend (``legend``: 'legend2'...) at the right of the figure, its top at paper height ``y``,
    beside the panels whose traces it lists."""
    fig.update_layout({legend: dict(orientation="v", x=1.01, xanchor="left", y=y, yanchor="top",
                                    title=dict(text=title) if title else None)})


def _groups(df: pd.DataFrame, order: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    """(label, rows) per policy present in ``df``, in ``order`` (parquet categories sort by name)."""
    by = {str(k): g for k, g in df.groupby(df["policy"].astype(str), sort=False)}
    return [(n, by[n]) for n in order if n in by]


# ------------------------------------------------------------------------------------------- memory waste


def memory_breakdown(policies: pd.DataFrame, published: Mapping[str, PublishedBreakdown] | None = None
                     ) -> go.Figure:
    """Stacked bars: where the KV pool went, time-averaged, per policy (the paper's Fig. 2 shape).

    ``policies``: one row per policy (index: label) with ``memory.<class>`` shares (0..1) and a ``preset``
    column. With ``published`` (preset -> published bar), each preset's published bar is drawn, hatched,
    right after the first of our policies whose ``preset`` it is.
    """
    short = short_labels(list(policies.index))
    bars: list[tuple[str, str, dict[str, float], float, str]] = []  # tick, full name, shares %, unclassified %, source
    shown: set[str] = set()
    for label, row in policies.iterrows():
        shares = pd.to_numeric(pd.Series([row.get(f"memory.{c}") for c in MEMORY_CLASSES]), errors="coerce")
        bars.append((short[label], text(label), dict(zip(MEMORY_CLASSES, 100 * shares.to_numpy(float))), 0.0,
                     "this run, time-weighted"))  # NaN (no time passed) draws no bar
        preset = row.get("preset")
        if published and preset in published and preset not in shown:
            p = published[preset]
            shown.add(preset)
            bars.append((p.label, p.label, dict(p.shares_pct), p.unclassified_pct, PAPER_CITATION))
    x = [b[0] for b in bars]
    custom = [[b[1], b[4]] for b in bars]
    pattern = ["/" if b[4] == PAPER_CITATION else "" for b in bars]
    hover = "%{customdata[0]}<br>%{fullData.name}: %{y:.2f} %<br>%{customdata[1]}<extra></extra>"
    fig = go.Figure()
    for c in MEMORY_CLASSES:
        name = MEMORY_LABELS[c] + (" (paper: & others)" if c == "external_fragmentation" and shown else "")
        fig.add_bar(name=name, x=x, y=[b[2].get(c, 0.0) for b in bars], customdata=custom, hovertemplate=hover,
                    marker=dict(color=MEMORY_COLORS[c], pattern=dict(shape=pattern, fillmode="overlay", size=6)))
    if any(b[3] for b in bars):
        fig.add_bar(name="not broken down (paper)", x=x, y=[b[3] for b in bars], customdata=custom, hovertemplate=hover,
                    marker=dict(color=UNCLASSIFIED_COLOR, pattern=dict(shape=pattern, fillmode="overlay", size=6)))
    fig.update_layout(barmode="stack", legend_traceorder="reversed")
    fig.update_yaxes(title="share of KV cache capacity (%)", range=[0, 100])
    fig.update_xaxes(title="policy", automargin=True, categoryorder="array", categoryarray=x)
    subtitle = (f"hatched: published figures ({PAPER_CITATION}), which have no 'free' class" if shown else
                "time-weighted over the run; idle time counts as free")
    return _layout(fig, "KV cache memory: where it goes", subtitle)


# ------------------------------------------------------------------------------------------- decomposition

KNOB_COLORS = {"batching": "#4c78a8", "reservation": "#f58518", "paged allocation": "#54a24b", "prefill": "#b279a2",
               "block size": "#eeca3b", "other": "#9d755d"}
MERGED_KNOB_COLOR = "#616161"  # a step of several knobs merged (one alone would not be a valid policy)
DECOMPOSITION_FIGURE_METRICS = ("request_throughput", "mean_normalized_latency_s", "median_ttft_ms")


def decomposition(decomp: Mapping, metrics: Sequence[str] = DECOMPOSITION_FIGURE_METRICS,
                  title_prefix: str = "") -> go.Figure:
    """Each policy's difference from the first, split by knob (summary.json's ``decomposition``, as
    ``sim.decompose`` computed it): per metric, one stacked bar per policy, a segment per knob (above
    zero where it raised the metric, below where it lowered it), and a diamond at the total difference,
    which the segments add up to."""
    metrics = [m for m in metrics if m in decomp.get("metrics", [])]
    targets = list(decomp.get("targets", {}))
    short = short_labels(targets)
    x = [short[t] for t in targets]
    fig = make_subplots(rows=1, cols=len(metrics), horizontal_spacing=0.09,
                        subplot_titles=[METRICS[m].title for m in metrics])
    labels = list(dict.fromkeys(st["label"] for t in targets for st in decomp["targets"][t]["steps"]))
    for col, m in enumerate(metrics, start=1):
        for label in labels:
            ys, custom = [], []
            for t in targets:
                st = next((s for s in decomp["targets"][t]["steps"] if s["label"] == label), None)
                share = None if st is None else st["share"].get(m)
                ys.append(share)
                same = st.get("same_as") if st else None
                custom.append([text(t), text(same) if same else "an intermediate policy"])
            fig.add_bar(x=x, y=ys, name=text(label), legendgroup=label, showlegend=col == 1, customdata=custom,
                        marker_color=KNOB_COLORS.get(label, MERGED_KNOB_COLOR), row=1, col=col,
                        hovertemplate=f"%{{customdata[0]}}: {text(label)}<br>%{{y:+.4g}} {METRICS[m].unit}"
                        "<br>reaches %{customdata[1]}<extra></extra>")
        totals = [decomp["targets"][t]["total"].get(m) for t in targets]
        fig.add_scatter(x=x, y=totals, mode="markers", name="total difference", legendgroup="total",
                        showlegend=col == 1, marker=dict(symbol="diamond", size=11, color="#222"), row=1, col=col,
                        customdata=[text(t) for t in targets],
                        hovertemplate=f"%{{customdata}}: total %{{y:+.4g}} {METRICS[m].unit}<extra></extra>")
        fig.update_yaxes(title=f"difference from {text(decomp.get('base'))}" if col == 1 else None, row=1, col=col)
    fig.update_layout(barmode="relative")
    fig.update_xaxes(automargin=True)
    return _layout(fig, f"{title_prefix}What each knob explains: difference from {text(decomp.get('base'))}",
                   "one knob at a time, in the order batching, reservation, paged allocation, prefill, block size, "
                   "other; segments add up to the diamond", height_px=480, top_px=110)


# ------------------------------------------------------------------------------------------- timelines


def display_bins(timeline: pd.DataFrame, max_points: int = MAX_TIMELINE_POINTS) -> pd.DataFrame:
    """One policy's timeline with at most ``max_points`` rows: groups of adjacent bins merged.

    Counts (``num_*``) are summed; time averages (``mean_*``, ``memory.*``) are weighted by bin width,
    which is exactly their average over the merged bin. Rows must be one policy's, in time order."""
    t = timeline.sort_values("bin_start_s")
    k = max(1, math.ceil(len(t) / max_points))
    if k == 1:
        return t.reset_index(drop=True)
    group = np.arange(len(t)) // k
    width_s = t["bin_s"].groupby(group).sum().to_numpy()
    out = {"bin_start_s": t["bin_start_s"].groupby(group).min().to_numpy(), "bin_s": width_s}
    for col in t.columns:
        if col.startswith("num_"):
            out[col] = t[col].groupby(group).sum().to_numpy()
        elif col.startswith(("mean_", "memory.")):
            out[col] = (t[col] * t["bin_s"]).groupby(group).sum().to_numpy() / width_s
    return pd.DataFrame(out)


def _bin_note(timeline: pd.DataFrame, order: Sequence[str], max_points: int) -> str:
    """Says the simulator's bin width (per policy where they differ: it doubles in long runs) and
    whether bins were merged for the page."""
    groups = _groups(timeline, order)
    short = short_labels([n for n, _ in groups])
    width = {n: float(g["bin_s"].max()) for n, g in groups}
    common = max(set(width.values()), key=list(width.values()).count) if width else 0.0
    others = [f"{short[n]}: {w:g} s" for n, w in width.items() if w != common]
    note = f"time bins of {common:g} s" + (f" ({', '.join(others)})" if others else "")
    if any(len(g) > max_points for _, g in groups):
        note += f"; downsampled for the page: adjacent bins merged to at most {max_points} points per policy"
    return note


def f32(values: object) -> np.ndarray:
    """Values as float32 for the page: half the bytes of float64, 7 significant digits."""
    return np.asarray(values, dtype=np.float32)


def _time_axis(d: pd.DataFrame) -> dict:
    """Bin starts as plotly's ``x0``/``dx`` (bins are contiguous and of one width), else explicit ``x``."""
    start = d["bin_start_s"].to_numpy()
    step = np.diff(start)
    if len(start) > 1 and np.allclose(step, step[0]):
        return {"x0": float(start[0]), "dx": float(step[0])}
    return {"x": f32(start)}


def memory_timeline(timeline: pd.DataFrame, colors: Mapping[str, str],
                    max_points: int = MAX_TIMELINE_POINTS) -> go.Figure:
    """Per policy, a stacked area of the KV pool's classes over time; under them, on the same time axis,
    the running batch size and the waiting-queue length of every policy (timeline.parquet). Each point is
    a time bin, drawn at its start."""
    groups = _groups(timeline, list(colors))
    short = short_labels([n for n, _ in groups])
    n = len(groups)
    rows = n + 2
    # requests holding KV; folders written before that column existed show sequences per step instead
    running, what_running, running_title = (("mean_running_requests", "requests holding KV", "running requests")
                                            if "mean_running_requests" in timeline.columns else
                                            ("mean_running", "sequences in the step", "running batch"))
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=min(0.045, 0.35 / rows),
                        row_heights=[1.0] * n + [1.4, 1.4],
                        subplot_titles=[f"{short[name]}: KV pool" for name, _ in groups]
                        + [f"{running_title} (all policies)", "waiting queue (all policies)"])
    for i, (name, g) in enumerate(groups):
        d = display_bins(g, max_points)
        t = _time_axis(d)
        for c in MEMORY_CLASSES:
            fig.add_scatter(**t, y=f32(100 * d[f"memory.{c}"]), row=i + 1, col=1, name=MEMORY_LABELS[c],
                            meta=text(name), legendgroup=c, showlegend=i == 0, stackgroup=f"p{i}", mode="lines",
                            line=dict(width=0, color=MEMORY_COLORS[c]), fillcolor=MEMORY_COLORS[c],
                            hovertemplate="%{meta}, bin from %{x:,.1f} s<br>%{fullData.name}: %{y:.2f} %"
                            "<extra></extra>")
        fig.update_yaxes(title="% of KV", range=[0, 100], row=i + 1, col=1)
        for row, col, what in ((n + 1, running, what_running),
                               (n + 2, "mean_waiting", "waiting requests")):
            fig.add_scatter(**t, y=f32(d[col]), row=row, col=1, name=short[name], meta=text(name),
                            legendgroup=f"policy-{i}", showlegend=row == n + 1, mode="lines", legend="legend2",
                            line=dict(color=colors[name], width=1.5),
                            hovertemplate=f"%{{meta}}, bin from %{{x:,.1f}} s<br>mean %{{y:.2f}} {what}<extra></extra>")
    fig.update_yaxes(title=f"{running_title} ({'requests' if running == 'mean_running_requests' else 'sequences'})",
                     rangemode="tozero", row=n + 1, col=1)
    fig.update_yaxes(title="waiting (requests)", rangemode="tozero", row=n + 2, col=1)
    fig.update_xaxes(title="time since first arrival (s)", row=rows, col=1)
    fig.update_layout(hovermode="x")
    _layout(fig, "KV cache memory, batch size and queue over time",
            _bin_note(timeline, list(colors), max_points), height_px=170 * n + 440, top_px=120)
    fig.update_layout(legend=dict(title=dict(text="KV pool")))
    _policy_legend(fig, "legend2", fig.layout[f"yaxis{n + 1}"].domain[1], "policy")
    return fig


# one colour per group kind: full attention (and MLA) dark, windows lighter, Mamba state grey
GROUP_COLORS = {"full": "#4c3d8f", "mla": "#4c3d8f", "sliding": "#8fb3e0", "chunked": "#b5a3d9", "mamba": "#9e9e9e"}


def group_memory_timeline(groups: pd.DataFrame, colors: Mapping[str, str]) -> go.Figure:
    """Per policy of several KV groups, a stacked area of the slots each group class holds over time
    (kv_groups.parquet: ``bin_start_s``, ``group`` label with kind and window, ``kind``, ``slots``)."""
    parts = _groups(groups, list(colors))
    short = short_labels([n for n, _ in parts])
    n = len(parts)
    fig = make_subplots(rows=n, cols=1, shared_xaxes=True, vertical_spacing=min(0.08, 0.35 / max(n, 1)),
                        subplot_titles=[f"{short[name]}: KV slots by layer group" for name, _ in parts])
    shown: set[str] = set()
    for i, (name, g) in enumerate(parts):
        for label, d in g.groupby("group", sort=False, observed=True):
            d = d.sort_values("bin_start_s")
            kind = str(d["kind"].iloc[0])
            # lighter shades for a kind's later classes (e.g. two window sizes)
            fig.add_scatter(x=f32(d["bin_start_s"]), y=f32(d["slots"]), row=i + 1, col=1, name=text(label),
                            meta=text(name), legendgroup=str(label), showlegend=label not in shown,
                            stackgroup=f"g{i}", mode="lines", line=dict(width=0.5, color=GROUP_COLORS.get(kind)),
                            hovertemplate="%{meta}, bin from %{x:,.1f} s<br>%{fullData.name}: %{y:,.0f} slots"
                            "<extra></extra>")
            shown.add(label)
        fig.update_yaxes(title="token slots", rangemode="tozero", row=i + 1, col=1)
    fig.update_xaxes(title="time since first arrival (s)", row=n, col=1)
    fig.update_layout(hovermode="x")
    _layout(fig, "KV memory by layer group over time", "stacked: each group class's held slots (mean per time bin)",
            height_px=220 * n + 200, top_px=120)
    fig.update_layout(legend=dict(title=dict(text="layer group")))
    return fig


def rolling_rate(d: pd.DataFrame, col: str, bins: int = ROLLING_BINS) -> np.ndarray:
    """``col`` per second over a centred window of ``bins`` time bins: the window's count over its width
    (at the ends, the bins there are)."""
    roll = dict(window=bins, center=True, min_periods=1)
    return (d[col].rolling(**roll).sum() / d["bin_s"].rolling(**roll).sum()).to_numpy()


def throughput_timeline(timeline: pd.DataFrame, colors: Mapping[str, str],
                        max_points: int = MAX_TIMELINE_POINTS, bins: int = ROLLING_BINS) -> go.Figure:
    """Output tokens, finished requests and preemptions per second over time, per policy (timeline.parquet):
    a rolling mean over ``bins`` time bins (the window's count over its width), the raw bins (count over
    the bin's width) faint beneath. With no preemption in the run, that panel is a line saying so."""
    preempted = bool(timeline["num_preempted"].sum() > 0)
    panels = [("num_sampled", "output tokens/s", "tokens sampled"),
              ("num_finished", "finished requests/s", "requests finished")]
    titles = ["output throughput", "finished requests"]
    if preempted:
        panels.append(("num_preempted", "preemptions/s", "preemptions"))
        titles.append("preemptions")
    rows = len(panels)
    groups = _groups(timeline, list(colors))
    short = short_labels([n for n, _ in groups])
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.09 if rows == 2 else 0.07,
                        subplot_titles=titles)
    windows: dict[str, float] = {}
    for i, (name, g) in enumerate(groups):
        d = display_bins(g, max_points)
        t = _time_axis(d)
        windows[name] = float(d["bin_s"].median()) * bins
        for row, (col, unit, what) in enumerate(panels, start=1):
            fig.add_scatter(**t, y=f32(d[col] / d["bin_s"]), row=row, col=1, name=short[name], meta=text(name),
                            legendgroup=f"policy-{i}", showlegend=False, mode="lines", hoverinfo="skip",
                            opacity=0.25, line=dict(color=colors[name], width=0.8))
            fig.add_scatter(**t, y=f32(rolling_rate(d, col, bins)), customdata=f32(d[[col, "bin_s"]]), row=row,
                            col=1, name=short[name], meta=text(name), legendgroup=f"policy-{i}",
                            showlegend=row == 1, mode="lines", line=dict(color=colors[name], width=2),
                            hovertemplate=f"%{{meta}}, from %{{x:,.1f}} s: {bins}-bin mean %{{y:.3f}} {unit}<br>"
                            f"this bin: %{{customdata[0]:,.0f}} {what} in %{{customdata[1]:.3g}} s<extra></extra>")
    for row, (_, unit, _) in enumerate(panels, start=1):
        fig.update_yaxes(title=unit, rangemode="tozero", row=row, col=1)
    fig.update_xaxes(title="time since first arrival (s)", row=rows, col=1)
    if not preempted:
        fig.add_annotation(text="no preemptions: no policy preempted a sequence in this run", showarrow=False,
                           xref="paper", yref="paper", x=0, xanchor="left", y=-0.16, yanchor="top",
                           font=dict(size=13, color="#444"))
    fig.update_layout(hovermode="x")
    common = max(set(windows.values()), key=list(windows.values()).count) if windows else 0.0
    others = [f"{short[n]}: {w:g} s" for n, w in windows.items() if w != common]
    note = (f"thick: rolling mean over {bins} bins ({common:g} s" + (f"; {', '.join(others)}" if others else "")
            + "), faint: each bin; " + _bin_note(timeline, list(colors), max_points))
    return _layout(fig, "Throughput and preemptions over time", note, height_px=780 if preempted else 600,
                   top_px=120, bottom_px=60 if preempted else 110)


def shares_blocks(timeline: pd.DataFrame) -> bool:
    """Whether any policy hit the prefix cache or shared blocks (samples, beams) in this run."""
    return bool(timeline is not None and {"num_prefix_hit_tokens", "shared_slot_s"} <= set(timeline.columns)
                and (timeline["num_prefix_hit_tokens"].sum() > 0 or timeline["shared_slot_s"].sum() > 0))


def sharing_timeline(timeline: pd.DataFrame, colors: Mapping[str, str],
                     max_points: int = MAX_TIMELINE_POINTS) -> go.Figure:
    """Block sharing over time (timeline.parquet): the share of admitted prompt tokens the prefix cache
    served, and the KV memory used with sharing (solid) against what the same sequences would hold
    without it (dotted), per policy that shared anything."""
    groups = [(n, g) for n, g in _groups(timeline, list(colors))
              if g["num_prefix_hit_tokens"].sum() > 0 or g["shared_slot_s"].sum() > 0]
    short = short_labels([n for n, _ in groups])
    hits = any(g["num_prefix_hit_tokens"].sum() > 0 for _, g in groups)  # else no hit-rate panel
    rows, mem_row = (2, 2) if hits else (1, 1)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=(["prefix-cache hit rate (admitted prompt tokens)"] if hits else [])
                        + ["KV memory used: with sharing (solid), without (dotted)"])
    for i, (name, g) in enumerate(groups):
        d = display_bins(g, max_points)
        t = _time_axis(d)
        for col, dash, what in (("memory.used", "solid", "used"), ("memory.used_without_sharing", "dot",
                                                                    "without sharing")):
            fig.add_scatter(**t, y=f32(100 * d[col]), row=mem_row, col=1, name=short[name], meta=text(name),
                            legendgroup=f"policy-{i}", showlegend=dash == "solid", mode="lines",
                            line=dict(color=colors[name], width=1.5, dash=dash),
                            hovertemplate=f"%{{meta}}, bin from %{{x:,.1f}} s<br>{what}: %{{y:.2f}} % of the KV pool"
                            "<extra></extra>")
        if not hits or g["num_prefix_hit_tokens"].sum() == 0:
            continue
        admitted = d["num_prompt_tokens_admitted"].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            hit = np.where(admitted > 0, 100 * d["num_prefix_hit_tokens"] / admitted, np.nan)
        fig.add_scatter(**t, y=f32(hit), customdata=f32(d[["num_prefix_hit_tokens", "num_prompt_tokens_admitted"]]),
                        row=1, col=1, name=short[name], meta=text(name), legendgroup=f"policy-{i}", mode="lines",
                        showlegend=False, line=dict(color=colors[name], width=1.5), connectgaps=False,
                        hovertemplate="%{meta}, bin from %{x:,.1f} s: %{customdata[0]:,.0f} of %{customdata[1]:,.0f} "
                        "prompt tokens from the cache<br>%{y:.2f} %<extra></extra>")
    if hits:
        fig.update_yaxes(title="hit rate (%)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="% of KV pool", rangemode="tozero", row=mem_row, col=1)
    fig.update_xaxes(title="time since first arrival (s)", row=rows, col=1)
    fig.update_layout(hovermode="x")
    return _layout(fig, "Block sharing over time", _bin_note(timeline, list(colors), max_points),
                   height_px=620 if hits else 400, top_px=120)


# ------------------------------------------------------------------------------------------- address space


def strip_runs(segments: pd.DataFrame, max_runs: int = MAX_STRIP_RUNS, pixels: int = STRIP_PIXELS
               ) -> tuple[pd.DataFrame, int]:
    """One policy's (start, length, memory_class) runs, tiling its pool, ready to draw; and the slots per
    pixel (1: exact). Adjacent runs of one class merge. When more than ``max_runs`` remain, the pool is cut
    into pixels of a power-of-two number of slots (so block and buddy boundaries stay on pixel edges) and
    each pixel shows the class holding most of its slots."""
    seg = segments.sort_values("start")
    codes = pd.Categorical(seg["memory_class"].astype(str), categories=list(MEMORY_CLASSES)).codes
    starts, lengths = seg["start"].to_numpy(np.int64), seg["length"].to_numpy(np.int64)
    capacity = int(starts[-1] + lengths[-1]) if len(seg) else 0
    per_px = 1
    if len(seg) > max_runs:
        per_px = 1 << max(0, math.ceil(math.log2(capacity / pixels)))
        slots = np.repeat(codes.astype(np.int8), lengths)
        ncols = math.ceil(capacity / per_px)
        padded = np.full(ncols * per_px, -1, dtype=np.int8)
        padded[: len(slots)] = slots
        counts = np.stack([(padded.reshape(ncols, per_px) == c).sum(axis=1) for c in range(len(MEMORY_CLASSES))])
        codes = counts.argmax(axis=0)
        starts = np.arange(ncols, dtype=np.int64) * per_px
        lengths = np.minimum(per_px, capacity - starts)
    keep = np.r_[True, codes[1:] != codes[:-1]] if len(codes) else np.zeros(0, bool)
    first = np.flatnonzero(keep)
    merged_len = np.add.reduceat(lengths, first) if len(first) else lengths[:0]
    runs = pd.DataFrame({"start": starts[first], "length": merged_len,
                         "memory_class": np.asarray(MEMORY_CLASSES, dtype=object)[np.asarray(codes)[first]]})
    return runs, per_px


def address_space(snapshots: pd.DataFrame, order: Sequence[str], max_runs: int = MAX_STRIP_RUNS,
                  pixels: int = STRIP_PIXELS) -> go.Figure:
    """The KV address space at the kept moment (most requests waiting), one strip per policy: which slots
    hold token states, reservations, fragmentation or nothing (kv_snapshots.parquet). One bar trace per
    policy and class; the legend shows each class once."""
    groups = _groups(snapshots, order)
    short = short_labels([n for n, _ in groups])
    fig = go.Figure()
    ticks: list[str] = []
    notes: list[str] = []
    legend: set[str] = set()
    for name, g in groups:
        first = g.iloc[0]
        where = f"replica {int(first['replica'])} · " if "replica" in g and pd.notna(first["replica"]) else ""
        tick = (f"{short[name]}<br><span style='font-size:10px'>{where}t = {first['time_s']:,.1f} s · "
                f"{int(first['num_waiting']):,} waiting · {int(first['num_running']):,} running</span>")
        ticks.append(tick)
        runs, per_px = strip_runs(g, max_runs, pixels)
        if per_px > 1:
            notes.append(f"{short[name]}: {per_px} slots per pixel")
        mostly = "mostly " if per_px > 1 else ""
        for c in MEMORY_CLASSES:
            r = runs[runs["memory_class"] == c]
            if not len(r):
                continue
            end = r["start"] + r["length"] - 1
            fig.add_bar(orientation="h", y=[tick] * len(r), x=r["length"], base=r["start"], name=MEMORY_LABELS[c],
                        meta=text(name), legendgroup=c, showlegend=c not in legend,
                        customdata=np.column_stack([r["start"], end, r["length"]]),
                        marker=dict(color=MEMORY_COLORS[c], line=dict(width=0)),
                        hovertemplate=f"%{{meta}}<br>{mostly}%{{fullData.name}}: slots %{{customdata[0]:,}}–"
                        "%{customdata[1]:,} (%{customdata[2]:,} slots)<extra></extra>")
            legend.add(c)
    fig.update_layout(barmode="overlay", bargap=0.25, legend_traceorder="grouped")
    fig.update_xaxes(title="position in the KV pool (token slots)", rangemode="tozero")
    fig.update_yaxes(title="policy", categoryorder="array", categoryarray=ticks[::-1], automargin=True)
    subtitle = ("rows are taken at different moments: each policy at its own moment of most waiting requests "
                "(then most memory allocated), t on its row"
                + ("; downsampled: " + ", ".join(notes) + ", each showing its majority class" if notes else ""))
    return _layout(fig, "KV address space, each policy at its own busiest moment", subtitle,
                   height_px=130 + 70 * max(1, len(ticks)))


# ------------------------------------------------------------------------------------------- latency


def cdf_points(values: np.ndarray, max_points: int = MAX_CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of ``values`` (NaN dropped) at most ``max_points`` exact order statistics:
    (sorted values, fraction of values at or below each)."""
    v = np.sort(values[~np.isnan(values)])
    n = len(v)
    idx = np.arange(n) if n <= max_points else np.unique(np.round(np.linspace(0, n - 1, max_points)).astype(int))
    return v[idx], (idx + 1) / n if n else np.zeros(0)


def latency_cdfs(requests: pd.DataFrame, colors: Mapping[str, str], max_points: int = MAX_CDF_POINTS) -> go.Figure:
    """CDFs of TTFT, TPOT, end-to-end and normalized latency per policy, over finished requests
    (requests.parquet)."""
    fin = requests[requests["status"].astype(str) == "finished"]
    groups = _groups(fin, list(colors))
    short = short_labels([n for n, _ in groups])
    fig = make_subplots(rows=2, cols=2, subplot_titles=[m[1] for m in CDF_METRICS], vertical_spacing=0.16,
                        horizontal_spacing=0.09)
    for i, (name, g) in enumerate(groups):
        for j, (col, what, _, unit) in enumerate(CDF_METRICS):
            x, y = cdf_points(g[col].to_numpy(dtype=float), max_points)
            fig.add_scatter(x=f32(x), y=f32(y), row=j // 2 + 1, col=j % 2 + 1, name=short[name], meta=text(name),
                            legendgroup=f"policy-{i}", showlegend=j == 0, mode="lines",
                            line=dict(color=colors[name], width=1.5, shape="hv"),
                            hovertemplate=f"%{{meta}}<br>{what} %{{x:,.5~r}} {unit}<br>"
                            "%{y:.2%} of finished requests at or below<extra></extra>")
    for j, (col, _, title, _) in enumerate(CDF_METRICS):
        fig.update_xaxes(title=title, type="log", row=j // 2 + 1, col=j % 2 + 1, **_log_ticks(fin[col]))
        fig.update_yaxes(title="fraction of finished requests (0–1)", range=[0, 1.02], row=j // 2 + 1, col=j % 2 + 1)
    largest = max((len(g) for _, g in groups), default=0)
    note = (f"each curve drawn at {max_points} of its finished requests' exact values (evenly spaced ranks)"
            if largest > max_points else "every finished request drawn")
    return _layout(fig, "Latency distributions (finished requests)", note, height_px=820, top_px=110)


# ------------------------------------------------------------------------------------------- sweeps


def sweep_axes(sweep: pd.DataFrame) -> list[str]:
    """The columns of a sweep or capacity table that are swept scenario fields (e.g.
    ``workload.arrival.rate``, ``block_size``) or the seed, and vary (sim.schema.varying_axes)."""
    return varying_axes(sweep)


def _is_seed(col: str) -> bool:
    return str(col).split(".")[-1] == "seed"


def over_seeds(rows: pd.DataFrame, by: list[str], y: str) -> pd.DataFrame:
    """For display: ``y``'s mean, standard deviation and count over the rows that differ only by seed
    (one group per value of ``by``). A run that failed (no value) is left out of its group."""
    g = rows.assign(_y=pd.to_numeric(rows[y], errors="coerce")).groupby(by, sort=True, dropna=False)["_y"]
    return pd.DataFrame({"mean": g.mean(), "std": g.std(ddof=1), "count": g.count()}).reset_index()


def _seed_note(stats: pd.DataFrame) -> str:
    most = int(stats["count"].max()) if len(stats) else 0
    return f"mean ± standard deviation over {most} seeds" if most > 1 else "one run per point"


def latency_vs_rate(sweep: pd.DataFrame, colors: Mapping[str, str], x: str | None = None,
                    y: str = "mean_normalized_latency_s", capacity: pd.DataFrame | None = None,
                    capacity_col: str = "sustainable_request_rate") -> go.Figure:
    """A metric against a sweep axis, one line per policy (the paper's Fig. 12 shape: normalized latency
    vs request rate; with ``x="block_size"``, its Fig. 18b/19b shape). ``x`` defaults to
    ``workload.arrival.rate`` when it varies, else the first varying axis. Other varying axes split a
    policy into several lines (same colour, other dash). Runs that differ only by seed are one point:
    their mean, with the standard deviation as an error bar. With ``capacity``, each policy's
    sustainable rate (mean over seeds) is a dotted vertical line in its colour, when x is the rate."""
    axes = sweep_axes(sweep)
    if x is None:
        x = RATE_AXIS if RATE_AXIS in axes or not axes else axes[0]
    others = [a for a in axes if a != x and not _is_seed(a)]
    dashes = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
    groups = _groups(sweep, list(colors))
    short = short_labels([n for n, _ in groups])
    fig = go.Figure()
    notes = []
    for i, (name, g) in enumerate(groups):
        stats = over_seeds(g, others + [x], y)
        notes.append(_seed_note(stats))
        for k, (key, s) in enumerate(stats.groupby(others, sort=True, dropna=False) if others else [((), stats)]):
            key = key if isinstance(key, tuple) else (key,)
            suffix = ", ".join(f"{a.split('.')[-1]}={v}" for a, v in zip(others, key))
            s = s.sort_values(x)
            spread = s["count"].max() > 1
            fig.add_scatter(x=s[x], y=s["mean"], name=short[name] + (f" ({text(suffix)})" if suffix else ""),
                            meta=text(name) + (f" ({text(suffix)})" if suffix else ""), legendgroup=f"policy-{i}",
                            mode="lines+markers", customdata=np.column_stack([s["std"].fillna(0), s["count"]]),
                            error_y=dict(type="data", array=s["std"].fillna(0), visible=True, thickness=1)
                            if spread else None,
                            line=dict(color=colors[name], dash=dashes[k % len(dashes)]),
                            marker=dict(color=colors[name], size=7),
                            hovertemplate=f"%{{meta}}<br>{text(_axis_title(x))}: %{{x:,.5~r}}<br>"
                            f"{text(_axis_title(y))}: %{{y:,.5~r}}"
                            + (" ± %{customdata[0]:,.3~r} (%{customdata[1]} seeds)" if spread else "")
                            + "<extra></extra>")
    if capacity is not None and capacity_col in capacity.columns and x == RATE_AXIS:
        found = capacity  # a search that ended above its highest rate gives a lower bound, not a capacity
        if "status" in capacity.columns:
            found = capacity[capacity["status"].astype(str) == "found"]
        for name, g in _groups(found, list(colors)):
            for v in over_seeds(g, [c for c in sweep_axes(g) if not _is_seed(c)] or ["policy"],
                                capacity_col)["mean"].dropna():
                fig.add_vline(x=float(v), line=dict(color=colors[name], dash="dot", width=1))
    if x.split(".")[-1] == "block_size":  # powers of two on a log axis, each labelled
        ticks = sorted(pd.to_numeric(sweep[x], errors="coerce").dropna().unique())
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])
    fig.update_xaxes(title=text(_axis_title(x)))  # an axis is a user's column name: escaped like any user text
    log_y = y.endswith("latency_s")
    fig.update_yaxes(title=text(_axis_title(y)), type="log" if log_y else "linear",
                     **(_log_ticks(pd.to_numeric(sweep[y], errors="coerce")) if log_y else {}))
    sub = "; ".join(dict.fromkeys(notes)) or "no runs"
    sub += f"; other axes: {text(', '.join(others))}" if others else ""
    if capacity is not None and capacity_col in capacity.columns and x == RATE_AXIS:
        sub += "; dotted: each policy's sustainable rate (where the search found one)"
    return _layout(fig, text(f"{_axis_title(y).split(' (')[0].capitalize()} vs {_axis_title(x).split(' (')[0]}"), sub)


def sustainable_rates(capacity: pd.DataFrame, colors: Mapping[str, str],
                      value: str = "sustainable_request_rate") -> go.Figure:
    """Bars: the highest request rate each policy sustains (capacity.parquet: ``policy``, ``value``).
    Searches that differ only by seed make one bar (their mean, the standard deviation as an error bar);
    other varying axes (e.g. block size) put one bar per value side by side. A search that found no
    rate ("none") counts as 0 and is labelled so."""
    others = [a for a in sweep_axes(capacity) if not _is_seed(a)]
    groups = _groups(capacity, list(colors))
    short = short_labels([n for n, _ in groups])
    fig = go.Figure()
    notes = []
    for name, g in groups:
        stats = over_seeds(g.assign(**{value: pd.to_numeric(g[value], errors="coerce").fillna(0.0)}),
                           others or ["policy"], value)
        notes.append(_seed_note(stats))
        labels = [", ".join(f"{a.split('.')[-1]}={v}" for a, v in zip(others, vs))
                  for vs in zip(*(stats[a].tolist() for a in others))] if others else []
        spread = stats["count"].max() > 1
        fig.add_bar(x=[short[name]] * len(stats) if not others else [f"{short[name]}<br>{text(lab)}" for lab in labels],
                    y=stats["mean"], name=short[name], meta=text(name), marker_color=colors[name],
                    text=["none" if m == 0 else "" for m in stats["mean"]], textposition="outside",
                    error_y=dict(type="data", array=stats["std"].fillna(0), visible=True) if spread else None,
                    customdata=np.column_stack([stats["std"].fillna(0), stats["count"]]),
                    hovertemplate="%{meta}<br>%{y:,.5~r} req/s"
                    + (" ± %{customdata[0]:,.3~r} (%{customdata[1]} seeds)" if spread else "") + "<extra></extra>")
    fig.update_xaxes(title="policy", automargin=True)
    fig.update_yaxes(title=text(_axis_title(value)), rangemode="tozero")
    fig.update_layout(showlegend=False)
    sub = "from the sweep's capacity table; " + "; ".join(dict.fromkeys(notes))
    return _layout(fig, "Sustainable request rate per policy", sub)
