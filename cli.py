"""``sim``: the command line. Parses arguments and calls one function per command.

User mistakes (a bad scenario, a missing file, a model that does not fit) print one line per problem
to stderr and exit with code 2.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

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


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
