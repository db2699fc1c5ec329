"""What `sim run` and `sim check` print: the summary fits an 80-column terminal with every number whole,
each column says its statistic and unit, progress finishes (a bar at 100 % in a terminal, one line per
policy elsewhere), and a misspelled scenario key gets a "did you mean"."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from rich.console import Console

from reports.console import print_summary
from sim.run import run_to_dir

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]  # the quickstart's
SMALL = textwrap.dedent("""\
    name: console
    model: opt-13b
    gpu: a100-40gb
    workload: {arrival: {kind: poisson, rate: 6}, lengths: sharegpt, num_requests: 60, seed: 2}
    policies: [fastertransformer, orca-max, orca-pow2, orca-oracle, vllm]
    """)


def test_sim_run_output_fits_80_columns(tmp_path):
    """`sim run` in an 80-column terminal (COLUMNS=80, as a pipe): no line longer, no number cut."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL)
    env = {**os.environ, "COLUMNS": "80"}
    p = subprocess.run([sys.executable, "-c", "from cli import app; app()", "run", str(scenario), "--out",
                        str(tmp_path / "out"), "--no-report"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for stream in (p.stdout, p.stderr):
        for line in stream.splitlines():
            assert len(line) <= 80, line
        assert "…" not in stream, stream
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    lines = p.stdout.splitlines()
    head = "\n".join(lines[:6])
    for word in ("policy", "throughput", "req/s", "mean norm.", "s/token", "median", "TTFT", "ms"):
        assert word in head, (word, head)
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in POLICIES}
    assert list(rows) == POLICIES, p.stdout
    for name, row in rows.items():
        m = summary["policies"][name]
        assert f" {m['request_throughput']:,.2f} " in row, row
        assert f" {m['median_ttft_ms']:,.0f} " in row, row  # thousands separators, whole
        assert row.rstrip().endswith(f"{m['num_finished']:,}/{m['num_rejected']:,}/{m['num_unfinished']:,}"), row
    # outside a terminal: one line per finished policy on stderr, none before it started
    done = [line for line in p.stderr.splitlines() if "requests simulated in" in line]
    assert [line.split(":")[0] for line in done] == POLICIES, p.stderr
    assert all(re.search(r"60 requests simulated in [\d.,]+ s \([\d,]+ requests/s\)", line) for line in done), done


def test_summary_table_drops_columns_never_digits():
    """Huge values and a long policy name at 80 and 60 columns: every value whole or its column gone."""
    metrics = {"request_throughput": 12345.678, "mean_normalized_latency_s": 1234.5678, "median_ttft_ms": 98765432.1,
               "output_throughput": 7654321.0, "memory.token_states": 0.5, "num_preemptions": 1234567,
               "mean_batch_size": 256.0, "num_finished": 1_000_000, "num_rejected": 12_345, "num_unfinished": 0}
    summary = {"policies": {"a-policy-with-a-rather-long-name-[red]x[/red]": metrics, "vllm": metrics}}
    for width in (80, 60):
        buf = io.StringIO()
        print_summary(summary, "title [b]x[/b]", Console(file=buf, width=width, force_terminal=False))
        out = buf.getvalue()
        assert "…" not in out and all(len(line) <= width for line in out.splitlines()), out
        assert "1,000,000/12,345/0" in out and "12,345.68" in out and "[red]x[/red]" in out.replace("\n", "")
        assert "title [b]x[/b]" in out  # names are text, not markup
        if width == 80:
            assert "98,765,432" in out and "1,234.568" in out
        else:  # fewer columns, still whole
            assert "98,765" not in out and "98,765,432" not in out.replace("\n", "")


def test_progress_bars_finish_in_a_terminal(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL.replace("num_requests: 60", "num_requests: 30").replace(
        "policies: [fastertransformer, orca-max, orca-pow2, orca-oracle, vllm]", "policies: [orca-max, vllm]\n"
        "decompose: false"))
    buf = io.StringIO()
    run_to_dir(scenario, tmp_path / "out", report=False,
               console=Console(file=buf, force_terminal=True, width=100, color_system=None))
    final = buf.getvalue().split("\x1b[2K")[-3:]  # the last refresh: one line per bar
    text = "".join(final)
    for name in ("orca-max", "vllm"):
        assert re.search(rf"{name} .*30/30 requests", text), text
    assert "requests simulated in" not in buf.getvalue()  # the bars say it


def test_misspelled_scenario_key_gets_did_you_mean(tmp_path):
    from sim.config import ScenarioError, load_scenario

    path = tmp_path / "s.yaml"
    path.write_text(SMALL.replace("workload:", "worklaod:").replace("policies: [", "policies: [{preset: vllm, "
                                                                                   "name: v2, blok_size: 8}, "))
    try:
        load_scenario(path)
    except ScenarioError as e:
        msg = str(e)
    else:
        raise AssertionError("loaded a scenario with misspelled keys")
    assert "worklaod: unknown key (did you mean 'workload'?)" in msg, msg
    assert "policies[0].blok_size: unknown key (did you mean 'block_size'?)" in msg, msg
    path.write_text(SMALL.replace("num_requests:", "num_requets:"))
    try:
        load_scenario(path)
    except ScenarioError as e:
        assert "workload.num_requets: unknown key (did you mean 'num_requests'?)" in str(e), str(e)
    else:
        raise AssertionError("loaded a scenario with a misspelled workload key")


def test_sim_check_lines_fit_80_columns(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(SMALL)
    env = {**os.environ, "COLUMNS": "80"}
    p = subprocess.run([sys.executable, "-c", "from cli import app; app()", "check", str(scenario)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), p.stdout
    assert "  vllm: continuous batching, paged allocator" in lines, p.stdout
    assert any(line.startswith("KV pool: 14,720 tokens") for line in lines), p.stdout


TINY = textwrap.dedent(f"""\
    name: NAME
    model: {ROOT}/gpu/configs/tiny-llama.json
    gpu: {{name: tiny-device, memory_gib: 0.011, hbm_gb_per_s: 50, tflops: 1}}
    runtime_overhead_gib: 0
    activation_reserve_tokens: 256
    workload: {{arrival: {{kind: poisson, rate: 40}}, prompt: {{kind: uniform, low: 16, high: 200}},
               output: {{kind: uniform, low: 4, high: 32}}, num_requests: 20, seed: 0}}
    policies: [{{preset: orca-max, name: "orca [swap]"}}, {{preset: vllm, name: "vllm[/x]"}}]
    decompose: false
    """)
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


def test_names_print_as_written_never_as_markup(tmp_path):
    """Policy, scenario, sweep and plan names are free text: '[/x]' (a closing tag rich would reject) and
    '[swap]' (a tag rich would swallow) print as written in progress bars, tables and every line."""
    from typer.testing import CliRunner

    from cli import app

    scenario = tmp_path / "s.yaml"
    scenario.write_text(TINY.replace("NAME", '"run [/x]"'))
    buf = io.StringIO()  # sim run in a terminal: a progress bar per policy
    run_to_dir(scenario, tmp_path / "run", report=False,
               console=Console(file=buf, force_terminal=True, width=120, color_system=None))
    bars = ANSI.sub("", buf.getvalue())
    assert "orca [swap]" in bars and "vllm[/x]" in bars, bars

    runner = CliRunner()
    (tmp_path / "sweep.yaml").write_text(
        'name: "sw [/x]"\nbase: s.yaml\naxes: {seed: [0]}\n'
        "capacity: {slo: {mean_normalized_latency_s: 0.2}, min: 1, max: 50, relative_tolerance: 0.5}\n")
    r = runner.invoke(app, ["sweep", str(tmp_path / "sweep.yaml"), "--out", str(tmp_path / "sweep"), "-j", "1",
                            "--no-report"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = " ".join(r.output.split())  # the capacity table may fold a name
    for name in ("sw [/x]:", "orca [swap]", "vllm[/x]"):
        assert name in out, (name, r.output)

    (tmp_path / "plan.yaml").write_text(textwrap.dedent("""\
        name: "plan [/x]"
        base: {model: opt-13b, workload: {arrival: {kind: poisson, rate: 1}, lengths: sharegpt, num_requests: 20,
                                         seed: 1}}
        rates: [2]
        slo: {mean_tpot_ms: 100}
        gpus: [h100]
        replicas: {min: 1, max: 2}
        policies: [{preset: vllm, name: "v [/x]"}]
        """))
    r = runner.invoke(app, ["plan", str(tmp_path / "plan.yaml"), "--out", str(tmp_path / "plan"), "-j", "1",
                            "--no-report"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "plan [/x]: " in r.output and "x h100 tp1 v [/x]: 1 GPU," in r.output, r.output

    for label, start in (("sweep", "sw [/x]"), ("plan", "plan [/x]")):  # their progress bars, in a terminal
        from kvsim import plan_to_dir, sweep_to_dir

        buf = io.StringIO()
        to_dir = sweep_to_dir if label == "sweep" else plan_to_dir
        to_dir(tmp_path / f"{label}.yaml", tmp_path / f"{label}-bar", workers=1, resume=False,
               console=Console(file=buf, force_terminal=True, width=120, color_system=None))
        assert f"{start} (" in ANSI.sub("", buf.getvalue()), buf.getvalue()


def test_file_labels_line_up_and_one_is_singular():
    """The files a command wrote: labels right-aligned to the longest ('snapshots', 'timeline' included),
    paths printed as written; '1 request', not '1 requests'."""
    from reports.console import print_paths
    from sim.schema import plural

    buf = io.StringIO()
    print_paths({"summary": Path("a/summary.json"), "snapshots": Path("a [/x]/kv_snapshots.parquet"),
                 "report": Path("a/report.html")}, Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    assert lines == ["  summary: a/summary.json", "snapshots: a [/x]/kv_snapshots.parquet",
                     "   report: a/report.html"], lines
    assert (plural(1, "request"), plural(0, "GPU"), plural(1234, "run")) == ("1 request", "0 GPUs", "1,234 runs")


def test_decomposition_shares_keep_their_significant_digits():
    """A share of 1.000245 req/s printed "+1 req/s" beside "+1.016" (4 significant digits without their
    zeros); the report's table printed 6949 beside 849,394."""
    from reports.console import decomposition_lines
    from reports.html import _num

    d = {"base": "a", "metrics": ["request_throughput"], "targets": {"b": {
        "total": {"request_throughput": 1.016}, "steps": [{"label": "batching", "share": {"request_throughput": 1.000245}}]}}}
    assert decomposition_lines(d)[1] == "  b: +1.016 req/s = batching +1.000 req/s"
    assert (_num(6949.0), _num(849394.2), _num(0.24117), _num(-2.0, True)) == ("6,949", "849,394", "0.2412", "-2.000")
    from sim.schema import sig4  # a rounding that carries into a new digit keeps 4 digits, not 5

    assert [sig4(v) for v in (0.99996, 9.99996, 999.99996, float("nan"))] == ["1.000", "10.00", "1,000", "-"]


def test_a_long_policy_name_folds_after_a_separator():
    """A name too wide for its column breaks after its last '/' that fits (a fleet's policy/router), else its
    last '-', '_' or '.', not mid-word: 'contiguous-hybrid-fp8' printed 'contiguous-hybrid-fp' over '8'."""
    from reports.console import fold_name

    metrics = {"request_throughput": 1.0, "num_finished": 1, "num_rejected": 0, "num_unfinished": 0}
    names = ["contiguous-hybrid-fp8", "vllm-apc/least-outstanding", "paged"]
    buf = io.StringIO()
    print_summary({"policies": {n: metrics for n in names}}, "", Console(file=buf, width=30, force_terminal=False))
    first_cells = [line.split()[0] for line in buf.getvalue().splitlines() if line.strip()]
    assert "contiguous-hybrid-" in first_cells and "fp8" in first_cells, buf.getvalue()
    assert "vllm-apc/" in first_cells and "least-outstanding" in first_cells, buf.getvalue()
    assert fold_name("contiguous-hybrid-fp8", 20) == "contiguous-hybrid-\nfp8"
    assert fold_name("abcdefghijkl", 5) == "abcde\nfghij\nkl"  # no separator: at the width
