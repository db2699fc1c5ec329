"""``sim``: the command line. Parses arguments and calls one function per command.

User mistakes (a bad scenario, a missing file, a model that does not fit) print one line per problem
to stderr and exit with code 2.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Simulate contiguous vs paged KV-cache management for LLM serving.")
# NOTE: no emoji codes and no markup: a name such as ":x:" or "vllm [/x]" printed as written (and rich's emoji
# table, 3 ms, not imported); the few coloured words pass markup=True with the user's text escaped
err = Console(stderr=True, emoji=False, markup=False)
out = Console(emoji=False, markup=False)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("kvsim")
        except PackageNotFoundError:  # run from a checkout without `pip install`
            v = "(not installed)"
        out.print(f"kvsim {v}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="print kvsim's version and exit")) -> None:
    pass


@contextmanager
def user_errors():
    from rich.markup import escape

    from reports import ResultsError
    from sim.config import ScenarioError

    try:
        yield
    except (ScenarioError, ResultsError) as e:
        for line in str(e).splitlines():  # escaped: a message may hold brackets such as '.[gpu]'
            err.print(f"[red]error:[/red] {escape(line)}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except OSError as e:  # NOTE: the file system said no (full disk, permissions, a path that is a file)
        # (pyarrow's give no filename, their message names the file: it was "a file: Failed to open ...")
        said = f"{e.filename}: {e.strerror or e.__class__.__name__}" if e.filename else str(e) or e.__class__.__name__
        err.print(f"[red]error:[/red] {escape(said)}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<scenario name>)"),
    exact: bool = typer.Option(False, "--exact", help="step every iteration (reference mode, slower)"),
    no_report: bool = typer.Option(False, "--no-report", help="skip report.html"),
) -> None:
    """Simulate every policy of SCENARIO on the same requests; write results and report.html."""
    from kvsim import run_to_dir

    with user_errors():
        from sim.outputs import out_dir as checked_dir

        out_dir = checked_dir(out_dir) if out_dir is not None else None
        summary, paths = run_to_dir(scenario, out_dir, exact=exact, report=not no_report, console=err)
    from reports.console import print_paths, print_summary

    print_summary(summary, title=summary["scenario"]["name"], console=out, report=not no_report)
    print_paths(paths, out)


@app.command()
def check(scenario: Path = typer.Argument(..., help="scenario YAML file (or a sweep or plan file)")) -> None:
    """Validate SCENARIO without simulating: keys, values, model fit, workload (a sweep's or plan's: each
    scenario it runs)."""
    from kvsim import check_scenario

    with user_errors():
        lines = check_scenario(scenario)
    for line in lines:
        out.print(line, highlight=False)


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="result folders written by `sim run` or `sim sweep` (several: "
                                          "compared), or one by `sim plan`"),
    out_file: Optional[Path] = typer.Option(None, "--out", "-o", help="HTML file (default: RUN_DIR/report.html; "
                                            "several folders: compare-<names>.html beside the first)"),
) -> None:
    """Rebuild report.html from saved results (no re-simulation), or compare several runs side by side."""
    from reports.html import build_report

    with user_errors():
        from sim.outputs import out_file as checked_file

        target = checked_file(out_file) if out_file is not None else None
        if target is not None and target.suffix.lower() not in (".html", ".htm"):  # (--out DIR/summary.json wrote
            from sim.config import ScenarioError  # the page over the run's own results)

            raise ScenarioError(f"--out {target}: the report is written as HTML; name it *.html")
        path = build_report(run_dirs, target)
    out.print(f"report: {path} ({path.stat().st_size:,} bytes)", highlight=False)


def _until_interrupted(to_dir, spec_file: Path, out_dir: Optional[Path], **kw):
    """A sweep or a plan (``to_dir``) into a checked folder; SIGTERM ends it as Ctrl-C does (its finished
    runs kept, exit 130)."""
    import signal

    from sim.sweep.drive import SweepInterrupted

    with user_errors():
        from sim.outputs import out_dir as checked_dir

        out_dir = checked_dir(out_dir) if out_dir is not None else None

        def terminated(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, terminated)
        try:
            return to_dir(spec_file, out_dir, console=err, **kw)
        except SweepInterrupted as e:
            err.print(str(e), style="yellow", highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
        finally:
            signal.signal(signal.SIGTERM, previous)


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
    from kvsim import sweep_to_dir
    from reports.console import print_sweep

    result, paths = _until_interrupted(sweep_to_dir, sweep_file, out_dir, executor=executor, workers=workers,
                                       address=address, resume=resume, report=not no_report)
    print_sweep(result, paths, console=out, err_console=err)
    if result.failures:
        raise typer.Exit(1)


@app.command()
def plan(
    plan_file: Path = typer.Argument(..., metavar="PLAN.yaml", help="plan file: traffic, SLO, GPUs and prices, "
                                     "replica range, policies"),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<plan name>)"),
    executor: str = typer.Option("local", "--executor", "-e", help="local (a process pool) or ray"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to connect to (default: start a "
                                          "local Ray instance; 'auto': the one `ray start` runs here)"),
    workers: Optional[int] = typer.Option(None, "--workers", "--max-workers", "-j", help="simulations at once "
                                          "(default: every core; 1: in this process)"),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="reuse runs finished earlier in this folder"),
    no_report: bool = typer.Option(False, "--no-report", help="skip report.html"),
) -> None:
    """The cheapest deployment that meets PLAN.yaml's SLO at each rate; write plan.parquet, best.csv, report.html."""
    from kvsim import plan_to_dir
    from reports.console import failed_line, plural, print_paths
    from sim.schema import plan_label

    result, paths = _until_interrupted(plan_to_dir, plan_file, out_dir, executor=executor, workers=workers,
                                       address=address, resume=resume, report=not no_report)
    rate_col = result.plan.rate_column
    for _, r in result.best.iterrows():  # markup=False: a plan's or a GPU's name is printed as written
        if r["met"]:
            out.print(f"{rate_col} {r[rate_col]:g}: {plan_label(r)}: {plural(int(r['num_gpus']), 'GPU')}, "
                      f"${r['usd_per_hour']:,.2f}/h, "
                      f"${r['usd_per_million_tokens']:,.3f}/M tokens", highlight=False, markup=False, soft_wrap=True)
        else:
            near = r.get("nearest")
            ran = result.table.loc[result.table[rate_col] == r[rate_col], "ran"].any()
            why = (f"; nearest: {near}" if isinstance(near, str) else "" if ran else  # (a bare "nothing meets")
                   "; none ran at this rate: each configuration failed at a lower one (inferred, not simulated)")
            out.print(f"{rate_col} {r[rate_col]:g}: nothing in the plan meets the SLO{why}", highlight=False,
                      markup=False, soft_wrap=True)
    out.print(f"{result.plan.name}: {plural(result.num_configurations, 'configuration')}, "
              f"{plural(result.num_runs, 'run')} now, {result.num_reused:,} reused, the rest inferred; "
              f"{result.wall_s:,.1f} s", highlight=False, markup=False, soft_wrap=True)
    print_paths(paths, out)
    for what, error in result.failures:
        err.print(failed_line(what, error), highlight=False, soft_wrap=True)
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
MaxModelLen = Annotated[Optional[int], typer.Option(min=2, max=2**31 - 1,  # (sim.catalog.MAX_TOKENS: was one past it)
                                                    help="the model's max length, for cap_lengths=truncate")]


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
        from sim.outputs import out_file as checked_file

        lines = trace_convert(file, checked_file(out_file, "OUT"), workload or [], max_model_len)
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


@trace_app.command("fetch")
def trace_fetch(
    names: Annotated[Optional[List[str]], typer.Argument(metavar="NAME...", help="catalog names, or a group: "
                                                          "tests (what the tests read, ~8 MB), all")] = None,
    folder: Optional[Path] = typer.Option(None, "--dir", help="traces folder (default: $KVSIM_TRACES, else "
                                          "../shared/traces beside the project)"),
    mirror: Optional[str] = typer.Option(None, "--mirror", help="download MIRROR/FILE instead of the publisher's URL"),
    force: bool = typer.Option(False, "--force", help="download again even if the file is there"),
    list_: bool = typer.Option(False, "--list", help="list the public traces, licences, and where each is found"),
) -> None:
    """Download public traces (Azure 2023/2024, BurstGPT, Mooncake, Vidur/Splitwise) and check their SHA-256."""
    from traces.fetch import catalog_lines, fetch_command

    with user_errors():
        given = [f"{', '.join(names)}" if names else "", "--mirror" if mirror else "", "--force" if force else ""]
        if list_ and any(given):  # (they were ignored: nothing fetched, exit 0)
            from sim.config import ScenarioError

            raise ScenarioError(f"--list lists the traces and downloads nothing: drop {' and '.join(g for g in given if g)}, "
                                f"or --list to fetch")
        lines = catalog_lines(folder) if list_ else fetch_command(names or [], folder, mirror=mirror, force=force,
                                                                   console=err)
    for line in lines:
        out.print(line, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------- GPU backend

STEPTIME_TOKENS = "1,16,256,4096"


@app.command()
def steptime(
    model: str = typer.Argument(..., help="catalog model name or path to a Hugging Face config.json"),
    gpu: str = typer.Option(..., "--gpu", help="catalog GPU name"),
    tp: int = typer.Option(1, "--tp", min=1, help="tensor-parallel degree"),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="comma-separated token counts of a prefill step "
                                         f"(default: those of {STEPTIME_TOKENS} that fit the model's context)"),
    context: int = typer.Option(0, "--context", min=0, help="cached tokens the prefill attends to"),
    step_time: Optional[Path] = typer.Option(None, "--step-time", help="a scenario (or YAML step_time block) or a "
                                             "calibration profile JSON (default: the roofline's defaults)"),
    block_size: int = typer.Option(16, "--block-size", min=1, max=1 << 16,  # (sim.config.MAX_BLOCK_SIZE)
                                   help="KV block size (a paged decode's block cost)"),
    csv: bool = typer.Option(False, "--csv", help="print CSV to stdout instead of a table"),
) -> None:
    """What the step-time model predicts: ms per layer by part, and the whole step, per token count."""
    from sim.catalog import CatalogError, resolve_gpu, resolve_model
    from sim.config import ScenarioError
    from sim.kv import CapacityError, check_tensor_parallel
    from sim.steptime import STEPTIME_COLUMNS, load_step_time, steptime_rows

    with user_errors():
        try:
            counts = [int(t) for t in (STEPTIME_TOKENS if tokens is None else tokens).split(",")]
        except ValueError:
            raise ScenarioError(f"--tokens: expected comma-separated whole numbers, got {tokens!r}") from None
        if not counts or min(counts) < 1 or max(counts) > 1 << 20:
            raise ScenarioError(f"--tokens: expected counts from 1 to {1 << 20:,}, got {tokens!r}")
        try:
            m, g = resolve_model(model), resolve_gpu(gpu)
            check_tensor_parallel(m, tp)
        except (CatalogError, CapacityError) as e:
            raise ScenarioError(f"--tp: {e}" if isinstance(e, CapacityError) else str(e)) from None
        if context >= m.max_model_len:
            raise ScenarioError(f"--context: {context:,} cached tokens leave no room in {m.name}'s "
                                f"{m.max_model_len:,}-token context")
        if tokens is None:  # the default counts: those that fit the model's context
            counts = [c for c in counts if c + context <= m.max_model_len] or [m.max_model_len - context]
        elif max(counts) + context > m.max_model_len:
            raise ScenarioError(f"--tokens: {max(counts):,} tokens after {context:,} cached exceed {m.name}'s "
                                f"{m.max_model_len:,}-token context")
        cfg = load_step_time(step_time) if step_time is not None else None
        rows = steptime_rows(m, g, tp, counts, context, cfg, block_size)
    if csv:
        print(",".join(STEPTIME_COLUMNS))
        for r in rows:
            print(",".join(str(r["tokens"]) if c == "tokens" else ("" if r[c] is None else f"{r[c]:.6g}")
                           for c in STEPTIME_COLUMNS))
        return
    from rich import box
    from rich.table import Table

    def ms(v) -> str:
        return ("-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.3f}" if v >= 0.001
                else f"{v:.1e}")

    t = Table(title=f"{m.name} on {g.name}, TP {tp}, context {context:,}", box=box.SIMPLE_HEAD, padding=(0, 1),
              pad_edge=False,
              caption="ms; linear..layer: one layer; gpu, host, step: the whole step")
    heads = {"elementwise_ms": "eltwise", "attention_ms": "attn", "allreduce_ms": "allred"}
    cells = [[f"{r['tokens']:,}", *(ms(r[c]) for c in STEPTIME_COLUMNS[1:])] for r in rows]
    for i, c in enumerate(STEPTIME_COLUMNS):  # NOTE: as wide as the widest cell: a number is never cut
        head = heads.get(c, c.removesuffix("_ms"))
        t.add_column(head, justify="right", no_wrap=True, min_width=max(len(head), *(len(r[i]) for r in cells)))
    for r in cells:
        t.add_row(*r)
    out.print(t)
    note = (f"a calibration profile's measured step times ({cfg.path})" if getattr(cfg, "kind", "") == "profile"
            else g.operators_note if (cfg is None or getattr(cfg, "operators", "") == "fitted") else "datasheet roofline")
    if note == g.operators_note and g.operators is not None and g.operators.gemm.tile_rows > 1:
        note += f"; GEMMs computed on whole {g.operators.gemm.tile_rows}-row tiles past the first"
    out.print(f"operators: {note}", highlight=False)
    if getattr(cfg, "kind", "roofline") == "roofline":  # what the operators' fit does not cover
        from sim.config import RooflineConfig
        from sim.steptime import OpPricer

        pricer = OpPricer(m, g, tp, cfg or RooflineConfig())
        if tp > 1:
            out.print(f"all-reduce: {pricer.allreduce_source}", highlight=False)
        if m.moe_layers and pricer.fit is not None:
            out.print("MoE experts: datasheet efficiencies (matmul_efficiency, bandwidth_efficiency), not the fitted "
                      "GEMMs", highlight=False)
        out.print("attention: datasheet efficiencies (attention_efficiency, bandwidth_efficiency), not measured",
                  highlight=False)


@app.command(name="compile")
def compile_native(status: bool = typer.Option(False, "--status", help="say whether a build of these sources "
                                               "exists and runs; build nothing")) -> None:
    """Compile the engine's hot modules with mypyc (same results, less time; needs `pip install
    'kvsim\\[native]'` and a C compiler), and write the other modules' bytecode. Later runs use the build
    while the sources stay as they were."""
    from sim import native

    if status:
        s = native.status()
        state = f"disabled (KVSIM_NATIVE={os.environ.get('KVSIM_NATIVE', '')})" if s["disabled"] else \
            ("used" if s["built"] and native.active() else
             "not built for these sources: plain Python" if s["librt"] else
             "none without librt (pip install 'kvsim[native]'): plain Python")
        out.print(f"compiled build: {state}\n  {s['dir']}", highlight=False, markup=False)
        if s["damaged"]:
            out.print(f"  {s['damaged']}", highlight=False, markup=False)
        if s["build"]:
            b = s["build"]
            out.print(f"  mypy {b['mypy']}, Python {b['python']}, built {b['built_at']} in {b['seconds']} s",
                      highlight=False)
        return
    try:
        native.build(log=lambda m: out.print(m, highlight=False))
    except native.NativeBuildError as e:
        for line in str(e).splitlines():
            err.print(f"error: {line}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    failed = native.write_bytecode()  # the other modules' bytecode, which a run would otherwise compile again
    out.print("bytecode: written" if not failed else f"bytecode: not written in {', '.join(failed)} (not writable)",
              highlight=False)


profiles_app = typer.Typer(no_args_is_help=True, help="Measured GPU operator profiles (Vidur's layout): fit the "
                           "step-time model's per-GPU coefficients and validate them.")
app.add_typer(profiles_app, name="profiles")
ProfileDir = Annotated[Path, typer.Argument(help="folder in Vidur's layout (compute/<gpu>/<org>/<model>/mlp.csv, "
                                            "network/<topology>/all_reduce.csv)")]


@contextmanager
def profile_errors():
    from sim.profiles import ProfileError

    with user_errors():
        try:
            yield
        except ProfileError as e:
            from sim.config import ScenarioError

            raise ScenarioError(str(e)) from None


@profiles_app.command("fit")
def profiles_fit(root: ProfileDir) -> None:
    """Fit every GPU's coefficients on all its models; print them as catalog literals (sim/catalog.py)."""
    from sim.profiles import fit_catalog_literals, fit_literal, fit_notes, gpu_specs, profile_origin, read_profiles

    with profile_errors():
        ps = read_profiles(root)
        fits = fit_catalog_literals(ps, gpu_specs(ps), profile_origin(root))
    for name, fit in fits.items():
        print(f"# {name}\n{fit_literal(fit)}")
    for line in fit_notes(ps, fits):  # on stderr: stdout is the literals, to paste
        err.print(line, highlight=False, soft_wrap=True)


@profiles_app.command("validate")
def profiles_validate(
    root: ProfileDir,
    out_dir: Path = typer.Option(Path("runs/profiles"), "--out", "-o", help="result folder"),
) -> None:
    """Leave-one-model-out on every GPU: per-op MAPE table, the layer's signed error by token range,
    report.html (predicted vs measured, step vs TP)."""
    from reports.profiles_page import write_profiles_report
    from sim.profiles import validate_to_dir

    with profile_errors():
        from sim.outputs import out_dir as checked_dir

        paths, alone, notes = validate_to_dir(root, checked_dir(out_dir))
    import pandas as pd

    mape = pd.read_csv(paths["mape"])
    layer = mape[mape.op == "layer"]
    bias = pd.read_csv(paths["bias"])
    for r in layer.itertuples():
        out.print(f"{r.gpu}: layer MAPE {r.fitted:.1f} % (worst token count {r.fitted_worst_tokens:.1f} %); "
                  f"datasheet roofline {r.roofline:.1f} %", highlight=False)
        by = bias[bias.gpu == r.gpu]
        out.print("  by tokens: " + ", ".join(f"{b.tokens} {b.signed_error:+.1f} %" for b in by.itertuples()
                                              if not b.tokens.startswith("=")), highlight=False)
        full = [f"{b.tokens[1:]} tokens {b.signed_error:+.1f} % (worst model and TP {b.worst:+.1f} %)"
                for b in by.itertuples() if b.tokens.startswith("=")]
        if full:  # (a user's profiles may measure none of those token counts)
            out.print("  at full batches: " + ", ".join(full), highlight=False, soft_wrap=True)
    if alone:
        out.print(f"not validated: {', '.join(alone)} (one model measured; leaving it out leaves nothing to fit)",
                  highlight=False)
    for line in notes:
        err.print(line, highlight=False, soft_wrap=True)
    paths["report"] = write_profiles_report(out_dir)
    from reports.console import print_paths

    print_paths(paths, out)


@contextmanager
def gpu_backend():
    """The GPU backend's commands: user errors as above, and a missing torch/triton said in one line."""
    with user_errors():
        try:
            yield
        except ModuleNotFoundError as e:
            if e.name not in ("torch", "triton"):
                raise
            from sim.config import ScenarioError

            raise ScenarioError(f"this command needs the GPU backend ({e.name} is not installed): "
                                "pip install -e '.[gpu]'") from None


DEVICE = typer.Option("cpu", "--device", "-d", help="cuda (or cuda:N) or cpu")
THREADS = typer.Option(1, "--cpu-threads", min=1, max=1024,
                       help="torch threads for CPU timing (more than one is erratic on a busy machine)")


class Attention(str, Enum):
    triton = "triton"
    torch = "torch"


def _checked_out(path: Optional[Path], file: bool = False) -> Optional[Path]:
    """``--out`` checked before any measurement (a wrong one used to fail after it)."""
    if path is None:
        return None
    from sim.outputs import out_dir, out_file

    return out_file(path) if file else out_dir(path)


@app.command()
def replay(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    device: str = DEVICE,
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<name>-replay-<device>)"),
    open_loop: bool = typer.Option(False, "--open-loop", help="run the plans a simulation recorded, step by step"),
    attention: Optional[Attention] = typer.Option(None, help="default: triton on cuda, torch on cpu"),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="seed of the random weights and prompt token ids"),
    cpu_threads: int = THREADS,
    no_report: bool = typer.Option(False, "--no-report", help="skip report.html"),
) -> None:
    """Run SCENARIO's policies for real (same scheduler and allocator; measured step times)."""
    from kvsim import read_trace, write_report

    with gpu_backend():
        out_dir = _checked_out(out_dir)
        from gpu.replay import replay_to_dir

        summary, paths = replay_to_dir(scenario, device, out_dir, open_loop_mode=open_loop,
                                       attention=attention.value if attention else None,
                                       seed=seed, cpu_threads=cpu_threads, read_trace=read_trace,
                                       report=None if no_report else write_report)
    from reports.console import print_replay

    print_replay(summary, paths, console=out)


@app.command()
def calibrate(
    out_path: Path = typer.Option(..., "--out", "-o", help="profile JSON to write"),
    model: Optional[str] = typer.Option(None, help="catalog name or config.json (default: the scenario's model)"),
    device: str = DEVICE,
    scenario: Optional[Path] = typer.Option(None, help="cover this scenario's batch sizes, contexts and prompts"),
    quick: bool = typer.Option(False, "--quick", help="a coarser grid, fewer repeats"),
    cpu_threads: int = THREADS,
) -> None:
    """Measure a grid of prefill and decode steps and fit the step-time model (a profile)."""
    from kvsim import read_trace

    with gpu_backend():
        out_path = _checked_out(out_path, file=True)
        from sim.config import ScenarioError

        if out_path.suffix.lower() != ".json":  # (--out s.yaml wrote the profile over the scenario)
            raise ScenarioError(f"--out {out_path}: the profile is written as JSON; name it *.json")
        if out_path.is_file():  # (--out the model's config.json replaced the model with its profile)
            import json

            from sim.steptime import PROFILE_FORMAT

            try:
                old = json.loads(out_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                old = None
            if not (isinstance(old, dict) and old.get("format") == PROFILE_FORMAT):
                raise ScenarioError(f"--out {out_path}: exists and is not a step-time profile (a model's config.json?);"
                                    " a profile replaces only an earlier profile: name another file")
        from gpu.calibrate import calibrate_to_file

        profile = calibrate_to_file(out_path, device, model=model, scenario=scenario, quick=quick,
                                    cpu_threads=cpu_threads, read_trace=read_trace)
    from gpu.calibrate import print_profile

    print_profile(profile, out_path, console=out)


@app.command()
def validate(
    scenario: Path = typer.Argument(..., help="scenario YAML file"),
    device: str = DEVICE,
    profile: Optional[Path] = typer.Option(None, help="profile JSON (default: the scenario's, else calibrate now)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", "-o", help="result folder (default runs/<name>-validate-<device>)"),
    quick: bool = typer.Option(False, "--quick", help="when calibrating: a coarser grid"),
    cpu_threads: int = THREADS,
) -> None:
    """Compare the calibrated simulation with the replay on the same requests."""
    from kvsim import read_trace, write_report

    with gpu_backend():
        out_dir = _checked_out(out_dir)
        from gpu.validate import validate_to_dir

        result, paths = validate_to_dir(scenario, device, out_dir, profile_path=profile, quick=quick,
                                        cpu_threads=cpu_threads, read_trace=read_trace, report=write_report)
    from gpu.validate import print_validation

    print_validation(result, console=out)
    from reports.console import print_paths

    print_paths(paths, out)


def _empty_arg(args: list[str]) -> str | None:
    """The first empty argument, as said: ``--out ""`` (``--out "$OUT"`` with OUT unset), ``--dir=``, or an
    empty file argument; None if there is none. NOTE: typer reads "" as Path("."), the current folder: results
    landed there, a trace was fetched there, ``sim run ""`` said ".: not a regular file"."""
    for i, a in enumerate(args):
        if a.startswith("--") and "=" in a and not a.partition("=")[2].strip():
            return a.partition("=")[0]
        if not a.strip():
            flag = args[i - 1] if i > 0 and args[i - 1].startswith("-") else ""
            return flag or "an argument"
    return None


def main() -> None:
    """The ``sim`` command (``cli.py`` and the installed ``sim``). Once the command has ended (any exit
    code), its output is flushed and the exit handlers have run (``atexit``: a Ray session's shutdown,
    temporary folders), the process ends without the interpreter's teardown.

    NOTE: that teardown is a full garbage collection and the freeing of every module and object: about
    0.1 s after a trace's run, a tenth of the whole command, for nothing a user sees (every file the
    command wrote is closed by its writer). Other threads still running, a profiler or tracer, or an
    error that is a bug (a traceback), take the ordinary way out."""
    import os
    import threading

    # NOTE: numpy's OpenBLAS starts a thread per core that spins for about 0.1 s after numpy is imported
    # (and after each matrix product), waiting for work the simulator never gives it: 0.13 s of CPU in a
    # 1 s run on two cores, and a core taken from the other workers of a sweep. One thread, unless the
    # user set it (numpy not yet imported here; a sweep's worker processes inherit it).
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    empty = _empty_arg(sys.argv[1:])
    if empty:  # (typer reads "" as Path("."): the results would land in the current folder)
        print(f"error: {empty}: an empty value (an unset variable?); give a path or value", file=sys.stderr)
        sys.exit(2)
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, exit status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    if sys.getprofile() is not None or sys.gettrace() is not None or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a profiler or tracer writes its data at the ordinary exit (`python -m cProfile cli.py`)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`sim run ... | head`): Python's own exit says 120
            code = code or 120
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
