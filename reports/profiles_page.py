"""The page ``sim profiles validate`` writes: how well the step-time model's fitted operator
coefficients predict a model left out of the fit, against the measured profiles, and the predicted
decode step time vs tensor parallelism at a large batch."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from reports.html import CSS, RENDER_JS, Section, _figure_html, _safe_json

OP_COLORS = {  # one colour per op, distinct from the policy palette
    "attn_pre_proj": "#1b9e77", "attn_post_proj": "#d95f02", "mlp_up_proj": "#7570b3", "mlp_down_proj": "#e7298a",
    "input_layernorm": "#66a61e", "post_attention_layernorm": "#a6761d", "attn_rope": "#e6ab02",
    "mlp_act": "#666666", "add": "#1f78b4", "layer": "#000000",
}


def _scatter(loo: pd.DataFrame, gpu: str) -> go.Figure:
    d = loo[(loo.gpu == gpu) & (loo.kind == "fitted")]
    fig = go.Figure()
    lo, hi = float(d[["measured_ms", "predicted_ms"]].min().min()), float(d[["measured_ms", "predicted_ms"]].max().max())
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"color": "#999", "dash": "dot"},
                             name="exact", hoverinfo="skip"))
    for op, g in d.groupby("op", sort=False):
        g = g.iloc[:: max(1, len(g) // 1500)]  # the page stays light: at most ~1,500 points per op
        fig.add_trace(go.Scattergl(
            x=g.measured_ms, y=g.predicted_ms, mode="markers", name=str(op),
            marker={"size": 4, "opacity": 0.55, "color": OP_COLORS.get(str(op), "#444")},
            text=[f"{m.split('/')[-1]} tp{t} n={n}" for m, t, n in zip(g.model, g.tp, g.num_tokens)],
            hovertemplate="%{text}<br>measured %{x:.4f} ms<br>predicted %{y:.4f} ms<extra>" + html.escape(str(op))
                          + "</extra>"))
    fig.update_layout(height=520, xaxis={"type": "log", "title": "measured ms (per call)"},
                      yaxis={"type": "log", "title": "predicted ms, model left out of the fit"},
                      legend={"orientation": "v", "x": 1.02, "y": 1})
    return fig


def _tp_figure(tp: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    dashes = {"fitted + vllm-v1 host": "solid", "fitted + vllm-0.5 host": "dash", "before: datasheet + 2 ms": "dot"}
    palette = ["#1b9e77", "#d95f02", "#7570b3"]
    for i, ((model, gpu), g) in enumerate(tp.groupby(["model", "gpu"], sort=False)):
        for kind, h in g.groupby("model_kind", sort=False):
            fig.add_trace(go.Scatter(x=h.tp, y=h.step_ms, mode="lines+markers",
                                     name=f"{model} on {gpu}: {kind}",
                                     line={"color": palette[i % 3], "dash": dashes.get(str(kind), "solid")}))
    fig.update_layout(height=480, xaxis={"type": "log", "title": "tensor parallel degree", "tickvals": [1, 2, 4, 8]},
                      yaxis={"type": "log", "title": "decode step (ms)"}, legend={"font": {"size": 10}})
    return fig


def _mape_table(mape: pd.DataFrame) -> str:
    head = ("<tr><th>GPU</th><th>op</th><th>fitted MAPE %</th><th>worst token count %</th>"
            "<th>datasheet roofline MAPE %</th><th>its worst token count %</th></tr>")
    rows = []
    for r in mape.itertuples():
        strong = ' style="font-weight:bold"' if r.op == "layer" else ""
        rows.append(f"<tr{strong}><td>{html.escape(str(r.gpu))}</td><td>{html.escape(str(r.op))}</td>"
                    f"<td>{r.fitted:.1f}</td><td>{r.fitted_worst_tokens:.1f}</td><td>{r.roofline:.1f}</td>"
                    f"<td>{r.roofline_worst_tokens:.1f}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _bias_table(bias: pd.DataFrame) -> str:
    head = ("<tr><th>GPU</th><th>tokens</th><th>rows</th><th>signed error %</th><th>MAPE %</th>"
            "<th>worst model and TP %</th></tr>")
    rows = [f"<tr><td>{html.escape(str(r.gpu))}</td><td>{html.escape(str(r.tokens))}</td><td>{r.rows}</td>"
            f"<td>{r.signed_error:+.1f}</td><td>{r.mape:.1f}</td>"
            f"<td>{'' if pd.isna(getattr(r, 'worst', float('nan'))) else f'{r.worst:+.1f}'}</td></tr>"
            for r in bias.itertuples()]
    return f"<table>{head}{''.join(rows)}</table>"


def write_profiles_report(out_dir: str | Path) -> Path:
    """``report.html`` in a folder written by ``sim.profiles.validate_to_dir``."""
    d = Path(out_dir)
    loo = pd.read_parquet(d / "loo.parquet")
    mape = pd.read_csv(d / "mape.csv")
    bias = pd.read_csv(d / "bias.csv")
    tp = pd.read_csv(d / "step_vs_tp.csv")
    sections = [Section(f"{gpu}: predicted vs measured per op (leave one model out)",
                        "Each point is one op of one layer at one token count and TP degree, predicted by "
                        "coefficients fitted on the other models measured on this GPU. Log-log; the dotted line "
                        "is exact.", _scatter(loo, gpu)) for gpu in sorted(loo.gpu.unique())]
    sections.append(Section("Decode step time vs tensor parallelism at a large batch",
                            "Predicted decode step (batch and context as in the legend's cases) as GPUs are added. "
                            "Host work does not shrink with TP, so the step flattens; the model before the fit "
                            "shrank almost in proportion.", _tp_figure(tp)))
    blocks, template = [], {}
    for i, s in enumerate(sections):
        block, t = _figure_html(s, i)
        blocks.append(block)
        template = t or template
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Step-time model vs measured operator profiles</title>
<style>{CSS}</style><script type="text/javascript">{get_plotlyjs()}</script></head><body>
<h1>Step-time model vs measured operator profiles</h1>
<p class="muted">Leave-one-model-out: for every GPU, the coefficients are fitted on all but one model and
predict the one left out, over every token count and TP degree measured. MAPE = mean absolute percentage
error; "worst token count" = the largest MAPE at one token count (mean over left-out models and TP degrees).
<code>layer</code> is one layer's whole non-attention time.</p>
<h2>Errors</h2>{_mape_table(mape)}
<h2>One layer's error by token range</h2>
<p class="muted">Signed mean error of the fitted model (negative: predicted faster than measured) and its MAPE,
over the left-out models and TP degrees, by the batch's token count: decode batches sit in the first ranges,
prefill chunks in the last.</p>{_bias_table(bias)}
<h2>Figures</h2>
{chr(10).join(blocks)}
<script type="text/javascript">const KVSIM_TEMPLATE = {_safe_json(template)};{RENDER_JS}</script>
</body></html>
"""
    out = d / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
