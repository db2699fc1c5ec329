"""kvsim's own namespace: the command line (``kvsim.cli``) and the facade that wires the packages together.

The simulator (``sim``) never imports the trace readers (``traces``) or the report (``reports``), which
sit above it; this facade passes them in, so that a notebook gets what ``sim run`` does::

    import kvsim
    result = kvsim.run("scenarios/quickstart.yaml")        # a trace workload too
    kvsim.write_results(result, "runs/mine")               # with report.html

``sim.run`` alone simulates generated workloads, and traces given as a ``RequestTable`` or with
``read_trace=``. ``kvsim/cli.py`` is a link to the checkout's ``cli.py``, so ``from cli import app`` in a
checkout and ``from kvsim.cli import app`` in an installed copy are the same code. Everything is imported
when first used: ``import kvsim`` (and the command line's start) loads none of the packages.

The simulator and its companions keep their import names: ``sim``, ``gpu``, ``traces``, ``reports``
(see the README's Packaging section).
"""

from __future__ import annotations

import os
from pathlib import Path

PATH, OUT = (str, os.PathLike), (str, os.PathLike, type(None))  # (a py.path.local, a custom __fspath__ too)


def _args(fn: str, **given) -> None:
    """Each of ``given`` (name: (value, types, what was expected)) is of its types: else a TypeError naming the
    argument. (A dict for a path reached pathlib, ``exact="no"`` ran exact, ``console=5`` failed deep inside.)"""
    for name, (value, kinds, what) in given.items():
        if not isinstance(value, kinds) or (kinds is not bool and isinstance(value, bool)):
            raise TypeError(f"{fn}: {name} is {type(value).__name__} {value!r:.40}; expected {what}")


def read_trace(workload, path: Path, max_model_len: int | None = None):
    """``sim.workload.TraceReader``: a trace workload's file read and transformed (``traces.workload``).
    A module-level function, so a sweep's workers receive it by reference."""
    from sim.config import TraceWorkload
    from traces.workload import load_trace

    _args("read_trace", workload=(workload, TraceWorkload, "a trace workload (sim.config.TraceWorkload)"),
          path=(path, PATH, "the trace file's path"))
    return load_trace(workload, path, max_model_len)


def write_report(folder: Path) -> Path:
    """``sim.outputs.ReportWriter``: ``report.html`` from a result folder's files (``reports.html``)."""
    from reports.html import write_report as write

    _args("write_report", folder=(folder, PATH, "a result folder's path"))
    return write(folder)


def run(scenario, **options):
    """``sim.run.run`` with the trace readers (``options``: as ``sim.run.run`` takes them)."""
    from sim.run import run as simulate

    options.setdefault("read_trace", read_trace)
    return simulate(scenario, **options)


def load_requests(scenario):
    """A scenario's requests (a loaded ``Scenario``, or a scenario file's path), generated or read from its trace."""
    from sim.config import Scenario, load_scenario
    from sim.workload import load_requests as load

    if isinstance(scenario, (str, Path)):
        scenario = load_scenario(scenario)
    if not isinstance(scenario, Scenario):
        raise TypeError(f"load_requests: scenario is a {type(scenario).__name__}; expected a Scenario or a "
                        "scenario file's path")
    return load(scenario, read_trace)


def write_results(result, out_dir, report: bool = True) -> dict[str, Path]:
    """``sim.run.write_results``, with ``report.html`` unless ``report`` is False."""
    from sim.run import write_results as write

    _args("write_results", out_dir=(out_dir, PATH, "a folder's path"), report=(report, bool, "true or false"))
    return write(result, out_dir, report=write_report if report else None)


def run_to_dir(scenario_path, out_dir=None, *, exact: bool = False, report: bool = True, console=None):
    """``sim run``: simulate, write the result files and (unless ``report`` is False) report.html."""
    from sim.run import run_to_dir as simulate_to_dir

    _args("run_to_dir", scenario_path=(scenario_path, PATH, "a scenario file's path"),
          out_dir=(out_dir, OUT, "a folder's path or None"), exact=(exact, bool, "true or false"),
          report=(report, bool, "true or false"))
    return simulate_to_dir(scenario_path, out_dir, exact=exact, report=write_report if report else None,
                           read_trace=read_trace, console=console)


def check_scenario(scenario_path) -> list[str]:
    """``sim check``: everything a run needs, trace included, checked without simulating."""
    from sim.run import check_scenario as check

    _args("check_scenario", scenario_path=(scenario_path, PATH, "a scenario file's path"))
    return check(scenario_path, read_trace)


def sweep_to_dir(sweep_path, out_dir=None, *, report: bool = True, **options):
    """``sim sweep``: ``sim.sweep.output.sweep_to_dir`` with the trace readers and (unless ``report`` is False)
    the report (``options``: executor, workers, address, resume, console)."""
    from sim.sweep.output import sweep_to_dir as sweep

    _args("sweep_to_dir", sweep_path=(sweep_path, PATH, "a sweep file's path"),
          out_dir=(out_dir, OUT, "a folder's path or None"), report=(report, bool, "true or false"))
    return sweep(sweep_path, out_dir, report=write_report if report else None, read_trace=read_trace, **options)


def plan_to_dir(plan_path, out_dir=None, *, report: bool = True, **options):
    """``sim plan``: ``sim.plan.plan_to_dir`` with the trace readers and (unless ``report`` is False) the
    plan's report page (``options``: executor, workers, address, resume, console)."""
    from sim.plan import plan_to_dir as plan

    _args("plan_to_dir", plan_path=(plan_path, PATH, "a plan file's path"),
          out_dir=(out_dir, OUT, "a folder's path or None"), report=(report, bool, "true or false"))
    return plan(plan_path, out_dir, report=write_plan_report if report else None, read_trace=read_trace, **options)


def write_plan_report(folder: Path) -> Path:
    """``sim.outputs.ReportWriter`` for a plan folder (``reports.plan``)."""
    from reports.plan import write_plan_report as write

    return write(folder)
