"""The summary table printed by ``sim run``."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sim.schema import METRICS, TABLE_COLUMNS, plural, sig4, varying_axes

# The columns ``sim run`` prints, most important first; the rest are in summary.json and report.html.
# (summary key, format); the head (short label, unit) comes from METRICS. A column that does not fit the
# terminal is dropped from the end, never cut: every cell is as wide as its widest value.
COLUMNS = [
    ("request_throughput", "{:,.2f}"),
    ("mean_normalized_latency_s", "{:,.3f}"),
    ("median_ttft_ms", "{:,.0f}"),
    ("output_throughput", "{:,.0f}"),
    ("memory.token_states", "{:.0%}"),
    ("num_preemptions", "{:,}"),
    ("mean_batch_size", "{:,.1f}"),
]
DONE_HEAD = ("finished\n/rej/unf", "requests")
SUMMARY_NOTE = ("latencies: over finished requests; KV in tokens: time-weighted share of the pool",
                "every metric: summary.json; figures: report.html")


def failed_line(what: str, error: str) -> Text:
    """``failed: WHAT: ERROR``, the first word red, the rest as written (a name is not markup)."""
    return Text.assemble(("failed:", "red"), f" {what}: {error}")


def print_paths(paths: dict, console: Console) -> None:
    """The files a command wrote, one a line, the labels right-aligned to the longest."""
    width = max((len(str(k)) for k in paths), default=0)
    for key, p in paths.items():
        console.print(f"{key:>{width}}: {p}", highlight=False, markup=False)


def _fits(widths: list[int], console_width: int) -> bool:
    return sum(widths) + 2 * (len(widths) - 1) <= console_width


def summary_table(summary: dict, title: str = "", width: int = 80) -> Table:
    """The headline metrics, one row per policy, in at most ``width`` columns: each column is as wide as
    its widest value (numbers are never cut); columns that do not fit are dropped from the end of
    ``COLUMNS``; a long policy name folds onto a second line, after a '-', '_', '/' or '.' where it can."""
    policies = summary["policies"]
    names = [str(n) for n in policies]
    cols = []
    for key, fmt in COLUMNS:
        m = METRICS[key]
        cells = ["-" if policies[n].get(key) is None else fmt.format(policies[n][key]) for n in policies]
        cols.append((f"{m.short or m.label}\n{m.short_unit or m.unit}", cells))
    done = [f"{m.get('num_finished', 0):,}/{m.get('num_rejected', 0):,}/{m.get('num_unfinished', 0):,}"
            for m in policies.values()]
    cols.append((f"{DONE_HEAD[0]}\n{DONE_HEAD[1]}", done))

    def need(head: str, cells: list[str]) -> int:
        return max([len(line) for line in head.split("\n")] + [len(c) for c in cells])

    name_w = max([len("policy")] + [len(n) for n in names])
    name_min = min(name_w, 20)  # a longer name folds
    done_col = cols.pop()
    while cols and not _fits([name_min] + [need(*c) for c in cols] + [need(*done_col)], width):
        cols.pop()  # the least important metric goes first; the finished counts stay
    cols.append(done_col)
    used = sum(need(*c) for c in cols) + 2 * len(cols)
    t = Table(title=Text(title) if title else None, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True,
              show_edge=False)
    name_col = max(name_min, min(name_w, width - used))
    t.add_column("policy", style="bold", overflow="fold", min_width=name_col, max_width=name_col)
    for head, cells in cols:
        t.add_column(head, justify="right", no_wrap=True, min_width=need(head, cells))
    for i, n in enumerate(names):
        t.add_row(Text(fold_name(n, name_col)), *(cells[i] for _, cells in cols))  # Text: a name is not markup
    return t


def fold_name(name: str, width: int) -> str:
    """``name`` in lines of at most ``width`` characters, each broken after a '/' (a fleet's policy/router)
    where one fits, else after a '-', '_' or '.' (``contiguous-hybrid-`` / ``fp8``, not
    ``contiguous-hybrid-fp`` / ``8``), else at the width."""
    lines = []
    while len(name) > width:
        cut = name.rfind("/", 0, width) + 1 or max(name.rfind(c, 0, width) for c in "-_.") + 1
        cut = cut if cut > 0 else width
        lines.append(name[:cut])
        name = name[cut:]
    return "\n".join([*lines, name])


def decomposition_lines(decomp: dict, metrics: tuple[str, ...] = ("request_throughput",
                                                                  "mean_normalized_latency_s")) -> list[str]:
    """One line per policy: its difference from the first policy and each knob's share (``sim.decompose``)."""
    metrics = tuple(m for m in metrics if m in decomp.get("metrics", []))

    def fmt(values: dict) -> str:
        return ", ".join("-" if values.get(m) is None else f"{sig4(values[m], True)} {METRICS[m].unit}" for m in metrics)

    lines = [f"what each knob explains, from {decomp['base']} (summary.json: decomposition):"]
    for target, t in decomp.get("targets", {}).items():
        steps = "; ".join(f"{st['label']} {fmt(st['share'])}" for st in t["steps"]) or "no knob differs"
        lines.append(f"  {target}: {fmt(t['total'])} = {steps}")
    return lines


def _wrapped(line: str, width: int, indent: str = "      ") -> list[str]:
    """A decomposition line folded at its '; ' and ' = ' joints (a value and its unit stay together)."""
    if len(line) <= width:
        return [line]
    parts = re.split(r"(?<=;) |(?<=[^=]) (?== )", line)
    out = [parts[0]]
    for p in parts[1:]:
        if len(out[-1]) + 1 + len(p) <= width:
            out[-1] += " " + p
        else:
            out.append(indent + p.strip())
    return out


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


def fleet_facts(fleet: dict) -> list[tuple[str, str]]:
    """A fleet policy's own figures (summary.json's ``fleet[policy]``), as (label, value): the router, the
    replicas and their load imbalance (max / mean over replicas; 1 = balanced), the prefix hit rate, and for
    a disaggregated fleet each pool's busy share and the KV transfers' times."""
    out = [("router", str(fleet.get("router")))]
    if fleet.get("split") == "disaggregated":
        for name in ("prefill", "decode"):
            p = fleet.get(name) or {}
            out.append((f"{name} pool", f"{plural(p.get('num_replicas') or 0, 'replica')} of {p.get('tensor_parallel')} "
                                        f"x {p.get('gpu')}, "
                                        f"busy {_pct(p.get('busy_fraction'))}, KV in use {_pct(p.get('kv_in_use'))}, "
                                        f"imbalance req / KV {_x(p.get('load_imbalance_requests'))} / "
                                        f"{_x(p.get('load_imbalance_kv'))}"))
        t = fleet.get("kv_transfer") or {}
        out += [("transfers", f"{t.get('num_transfers', 0):,} over {t.get('link')}"),
                ("transfer ms mean / p99", f"{_ms(t.get('mean_transfer_ms'))} / {_ms(t.get('p99_transfer_ms'))}"),
                ("transfer queue ms mean / p99",
                 f"{_ms(t.get('mean_transfer_queue_ms'))} / {_ms(t.get('p99_transfer_queue_ms'))}"),
                ("decode wait ms mean / p99",
                 f"{_ms(t.get('mean_decode_wait_ms'))} / {_ms(t.get('p99_decode_wait_ms'))}")]
    else:
        out += [("replicas", str(fleet.get("num_replicas"))),
                ("imbalance req / KV",
                 f"{_x(fleet.get('load_imbalance_requests'))} / {_x(fleet.get('load_imbalance_kv'))}")]
    if fleet.get("prefix_hit_rate_tokens") is not None:
        out.append(("prefix hit rate", _pct(fleet["prefix_hit_rate_tokens"])))
    if "num_prefix_affine" in fleet:
        out.append(("followed prefix / load-capped",
                    f"{fleet['num_prefix_affine']:,} / {fleet.get('num_load_capped', 0):,}"))
    return out


def print_summary(summary: dict, title: str = "", console: Console | None = None, report: bool = True) -> None:
    """The table and its notes (``report`` false: no report.html was written, so the notes do not point to one);
    a fleet's own figures, one line per policy."""
    console = console or Console()
    width = console.width
    console.print(summary_table(summary, title, width=width))
    for name, fleet in (summary.get("fleet") or {}).items():
        line = f"fleet {name}: " + "; ".join(f"{k} {v}" for k, v in fleet_facts(fleet)[1:])
        for part in _wrapped(line, width):
            console.print(part, highlight=False, markup=False)
    for line in SUMMARY_NOTE:
        console.print(line if report else line.removesuffix("; figures: report.html"), highlight=False, markup=False)
    if summary.get("decomposition"):
        for line in decomposition_lines(summary["decomposition"]):
            for part in _wrapped(line, width):
                console.print(part, highlight=False, markup=False)


def capacity_table(capacity, axes: list[str]) -> Table:
    """One row per capacity search: the other axes' values, the policy, its sustainable rate and how it was found."""
    t = Table(caption="sustainable: the highest rate whose run met the SLO (bisected to the tolerance); "
              "none: even the lowest rate tried failed; above max: the highest rate tried passed; not monotone: a "
              "rate passed above one that failed (see capacity_runs.parquet)")
    varying = varying_axes(capacity)
    cols = [a for a in axes if a in varying]
    for c in cols + ["policy"]:
        t.add_column(c, no_wrap=True)
    sustainable = TABLE_COLUMNS["sustainable_request_rate"]
    for head in (f"{sustainable.short} {sustainable.unit}", "status", "rates tried", "runs"):
        t.add_column(head, justify="right")
    for _, r in capacity.iterrows():  # Text: a policy's or an axis' value is not markup
        rate = r["sustainable_request_rate"]
        tried = (f"{r['lowest_rate_tried']:.4g}–{r['highest_rate_tried']:.4g}"
                 if r["lowest_rate_tried"] == r["lowest_rate_tried"] and r["lowest_rate_tried"] is not None else "-")
        t.add_row(*[Text(str(r[c])) for c in cols], Text(str(r["policy"])),
                  "none" if rate is None or rate != rate else f"{rate:.4g}",
                  Text(str(r["status"]) + (f": {r['error']}" if r["status"] == "error" else "")), tried,
                  str(r["num_runs"]))
    return t


def print_sweep(result, paths: dict, console: Console | None = None, err_console: Console | None = None) -> None:
    """After ``sim sweep``: the capacity table (if searched), what ran, the files, and every failure."""
    console = console or Console()
    err = err_console or console
    sweep = result.sweep
    if result.capacity is not None and len(result.capacity):
        console.print(f"capacity: {sweep.capacity.slo_text()} (tolerance {sweep.capacity.tolerance_text()})",
                      highlight=False, markup=False)
        axes = list(dict.fromkeys(["seed"] + [a.column for a in sweep.axes]))
        console.print(capacity_table(result.capacity, axes))
    console.print(f"{sweep.name}: {plural(len(sweep.points), 'point')}, {plural(len(result.table), 'row')}; "
                  f"{plural(result.num_runs, 'run')} now, {result.num_reused:,} reused; {result.wall_s:,.1f} s",
                  highlight=False, markup=False)
    print_paths(paths, console)
    for what, error in result.failures:
        err.print(failed_line(what, error), highlight=False, soft_wrap=True)


def print_replay(summary: dict, paths: dict[str, Path], console: Console) -> None:
    """After ``sim replay``: closed loop, the summary table of the measured run; open loop, predicted vs
    measured per policy (from replay.json). Then the files."""
    info = json.loads(paths["replay"].read_text())
    where = f"{info['device']}, {info['dtype']}, {info['attention']} attention"
    if "open_loop" not in info:
        print_summary(summary, title=f"{summary['scenario']['name']} (replayed on {where})", console=console)
    else:
        t = Table(title=Text(f"{summary['scenario']['name']}: the simulation's steps run on {where}"))
        for col in ("policy", "steps", "predicted s", "measured s", "per-step MAPE"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        for name, p in info["open_loop"].items():
            t.add_row(Text(name), f"{p['num_steps']:,}", f"{p['predicted_s']:.3f}", f"{p['measured_s']:.3f}",
                      f"{p['step_time_mape']:.1%}")
        console.print(t)
    print_paths(paths, console)
