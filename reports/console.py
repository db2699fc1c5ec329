"""The summary table printed by ``sim run``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sim.metrics import METRICS

COLUMNS = [
    ("request_throughput", "req/s", "{:.2f}"),
    ("output_throughput", "tok/s", "{:.0f}"),
    ("mean_normalized_latency_s", "s/tok", "{:.3f}"),
    ("median_ttft_ms", "TTFT ms", "{:.0f}"),
    ("mean_batch_size", "batch", "{:.1f}"),
    ("num_preemptions", "preempt", "{}"),
    ("memory.token_states", "KV used", "{:.0%}"),
    ("memory.free", "KV idle", "{:.0%}"),
]


def summary_table(summary: dict, title: str = "") -> Table:
    t = Table(title=title or None, caption="KV used: time-weighted share of the KV pool holding token states; "
              "KV idle: free with nothing waiting; the rest is reservation and fragmentation (summary.json)")
    t.add_column("policy", style="bold", no_wrap=True)
    for _, head, _ in COLUMNS:
        t.add_column(head, justify="right")
    t.add_column("done/rej/unf", justify="right")
    for name, m in summary["policies"].items():
        cells = []
        for key, _, fmt in COLUMNS:
            v = m.get(key)
            cells.append("-" if v is None else fmt.format(v))
        cells.append(f"{m['num_finished']}/{m['num_rejected']}/{m['num_unfinished']}")
        t.add_row(name, *cells)
    return t


def decomposition_lines(decomp: dict, metrics: tuple[str, ...] = ("request_throughput",
                                                                  "mean_normalized_latency_s")) -> list[str]:
    """One line per policy: its difference from the first policy and each knob's share (``sim.decompose``)."""
    metrics = tuple(m for m in metrics if m in decomp.get("metrics", []))

    def fmt(values: dict) -> str:
        return ", ".join("-" if values.get(m) is None else f"{values[m]:+.4g} {METRICS[m].unit}" for m in metrics)

    lines = [f"what each knob explains, from {decomp['base']} (sim.decompose; summary.json: decomposition):"]
    for target, t in decomp.get("targets", {}).items():
        steps = "; ".join(f"{st['label']} {fmt(st['share'])}" for st in t["steps"]) or "no knob differs"
        lines.append(f"  {target}: {fmt(t['total'])} = {steps}")
    return lines


def print_summary(summary: dict, title: str = "", console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(summary, title))
    if summary.get("decomposition"):
        for line in decomposition_lines(summary["decomposition"]):
            console.print(line, highlight=False, soft_wrap=True)


def capacity_table(capacity, axes: list[str]) -> Table:
    """One row per capacity search: the other axes' values, the policy, its sustainable rate and how it was found."""
    t = Table(caption="sustainable: the highest rate whose run met the SLO (bisected to the tolerance); "
              "none: even the lowest rate tried failed; above max: the highest rate tried passed")
    cols = [a for a in axes if a in capacity.columns and capacity[a].nunique(dropna=False) > 1]
    for c in cols + ["policy"]:
        t.add_column(c, no_wrap=True)
    for head in ("sustainable req/s", "status", "rates tried", "runs"):
        t.add_column(head, justify="right")
    for _, r in capacity.iterrows():
        rate = r["sustainable_request_rate"]
        tried = (f"{r['lowest_rate_tried']:.4g}–{r['highest_rate_tried']:.4g}"
                 if r["lowest_rate_tried"] == r["lowest_rate_tried"] and r["lowest_rate_tried"] is not None else "-")
        t.add_row(*[str(r[c]) for c in cols], str(r["policy"]),
                  "none" if rate is None or rate != rate else f"{rate:.4g}",
                  str(r["status"]) + (f": {r['error']}" if r["status"] == "error" else ""), tried, str(r["num_runs"]))
    return t


def print_sweep(result, paths: dict, console: Console | None = None, err_console: Console | None = None) -> None:
    """After ``sim sweep``: the capacity table (if searched), what ran, the files, and every failure."""
    console = console or Console()
    err = err_console or console
    sweep = result.sweep
    if result.capacity is not None and len(result.capacity):
        console.print(f"capacity: {sweep.capacity.slo_text()} (tolerance {sweep.capacity.tolerance_text()})",
                      highlight=False)
        axes = list(dict.fromkeys(["seed"] + [a.column for a in sweep.axes]))
        console.print(capacity_table(result.capacity, axes))
    console.print(f"{sweep.name}: {len(sweep.points):,} points, {len(result.table):,} rows; {result.num_runs:,} runs "
                  f"now, {result.num_reused:,} reused; {result.wall_s:,.1f} s", highlight=False)
    for key, p in paths.items():
        console.print(f"{key:>13}: {p}", highlight=False)
    for what, error in result.failures:
        err.print(f"[red]failed:[/red] {what}: {error}", highlight=False, soft_wrap=True)
