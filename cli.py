"""``sim``: the command line. Parses arguments and calls one function per command.

User mistakes (a bad scenario, a missing file, a model that does not fit) print one line per problem
to stderr and exit with code 2.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate contiguous vs paged KV-cache management for LLM serving.")
err = Console(stderr=True)
out = Console()


@contextmanager
def user_errors():
    from reports.results import ResultsError
    from sim.config import ScenarioError

    try:
        yield
    except (ScenarioError, ResultsError) as e:
        for line in str(e).splitlines():
            err.print(f"[red]error:[/red] {line}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<scenario name>)"),
    exact: bool = typer.Option(False, "--exact", help="step every iteration (reference mode, slower)"),
    no_report: bool = typer.Option(False, "--no-report", help="skip report.html"),
) -> None:
    """Simulate every policy of SCENARIO on the same requests; write results and report.html."""
    from sim.run import run_to_dir

    with user_errors():
        summary, paths = run_to_dir(scenario, out_dir, exact=exact, report=not no_report, console=err)
    from reports.console import print_summary

    print_summary(summary, title=summary["scenario"]["name"], console=out)
    for key, p in paths.items():
        out.print(f"{key:>8}: {p}", highlight=False)


@app.command()
def check(scenario: Path = typer.Argument(..., help="scenario YAML file")) -> None:
    """Validate SCENARIO without simulating: keys, values, model fit, workload."""
    from sim.run import check_scenario

    with user_errors():
        lines = check_scenario(scenario)
    for line in lines:
        out.print(line, highlight=False)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="result folders written by `sim run` (several: compared)"),
    out_file: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file (default: RUN_DIR/report.html; "
                                            "several folders: compare-<names>.html beside the first)"),
) -> None:
    """Rebuild report.html from saved results (no re-simulation), or compare several runs side by side."""
    from reports.html import build_report

    with user_errors():
        path = build_report(run_dirs, out_file)
    out.print(f"report: {path} ({path.stat().st_size:,} bytes)", highlight=False)


@app.command()
def sweep(
    sweep_file: Path = typer.Argument(..., metavar="SWEEP.yaml", help="sweep file: a base scenario, axes, capacity"),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<sweep name>)"),
    executor: str = typer.Option("local", "--executor", "-e", help="local (a process pool) or ray"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to connect to (default: start a "
                                          "local Ray instance; 'auto': the one `ray start` runs here)"),
    workers: Optional[int] = typer.Option(None, "--workers", "--max-workers", "-j", help="simulations at once "
                                          "(default: every core; 1: in this process)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="reuse runs finished earlier in this folder"),
    no_report: bool = typer.Option(False, "--no-report", help="skip report.html"),
) -> None:
    """Run every point of SWEEP.yaml (and its capacity search); write sweep.parquet, capacity.parquet, report.html."""
    from reports.console import print_sweep
    from sim.sweep import SweepInterrupted, sweep_to_dir

    with user_errors():
        try:
            result, paths = sweep_to_dir(sweep_file, out_dir, executor=executor, workers=workers, address=address,
                                         resume=resume, report=not no_report, console=err)
        except SweepInterrupted as e:
            err.print(f"[yellow]{e}[/yellow]", highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
    print_sweep(result, paths, console=out, err_console=err)
    if result.failures:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------------------------- sim trace

trace_app = typer.Typer(no_args_is_help=True, help="Inspect and convert request traces (Azure, BurstGPT, Mooncake, "
                        "Vidur/Splitwise, length-only CSVs, generic tables; plain or gzip).")
app.add_typer(trace_app, name="trace")
TraceFile = Annotated[Path, typer.Argument(help="trace file: CSV, JSONL or parquet, plain or gzip")]
WorkloadKeys = Annotated[Optional[List[str]], typer.Option(
    "--workload", "-w", metavar="KEY=VALUE", help="a key of a scenario's trace workload (repeatable): format=azure, "
    "window.start_s=600, window.end_s=1200, sample=0.5, rate_scale=2, 'arrival={kind: poisson, rate: 5}', "
    "num_requests=1000, duration_s=600, cap_lengths=truncate, bad_rows=drop, models=[ChatGPT], seed=1")]
MaxModelLen = Annotated[Optional[int], typer.Option(help="the model's max length, for cap_lengths=truncate")]


@trace_app.command("info")
def trace_info(file: TraceFile, workload: WorkloadKeys = None, max_model_len: MaxModelLen = None) -> None:
    """Rows, span, request rate, burstiness, token percentiles and prefix-block reuse of FILE."""
    from traces.commands import trace_info

    with user_errors():
        lines = trace_info(file, workload or [], max_model_len)
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


@trace_app.command("convert")
def trace_convert(file: TraceFile, out_file: Annotated[Path, typer.Argument(help="OUT.parquet")],
                  workload: WorkloadKeys = None, max_model_len: MaxModelLen = None) -> None:
    """Write FILE's canonical request table (after any transforms) to OUT.parquet."""
    from traces.commands import trace_convert

    with user_errors():
        lines = trace_convert(file, out_file, workload or [], max_model_len)
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
