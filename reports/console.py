"""The summary table printed by ``sim run``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

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


def print_summary(summary: dict, title: str = "", console: Console | None = None) -> None:
    (console or Console()).print(summary_table(summary, title))
