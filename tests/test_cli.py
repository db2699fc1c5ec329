import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

SMALL = """\
name: small <b>run</b>
model: opt-13b
gpu: a100-40gb
workload: {arrival: {kind: poisson, rate: 3}, lengths: alpaca, num_requests: 60, seed: 5}
policies: [fastertransformer, orca-max, orca-pow2, orca-oracle, vllm]
"""


def scen(tmp_path, text=SMALL):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_run_writes_results_and_report(tmp_path):
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", str(scen(tmp_path)), "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert list(s["policies"]) == ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"]
    m = s["policies"]["vllm"]
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "mean_normalized_latency_s",
                "mean_batch_size", "num_preemptions", "num_requests", "num_finished", "num_rejected",
                "num_unfinished", "kv_capacity_tokens", "memory.token_states", "memory.reservation",
                "memory.internal_fragmentation", "memory.external_fragmentation", "memory.free"):
        assert key in m, key
    assert s["scenario"]["name"] == "small <b>run</b>" and s["scenario"]["resolved"]["kv_pools"]["vllm"]["block_size"] == 16
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 5 * 60 and set(req.policy) == set(s["policies"])
    steps = pd.read_parquet(out / "steps.parquet")
    assert {"start_s", "duration_s", "num_steps", "mem_token_states"} <= set(steps.columns)
    html = (out / "report.html").read_text()
    assert "small &lt;b&gt;run&lt;/b&gt;" in html and "<b>run</b>" not in html
    # the printed summary: one row per policy in the scenario's order, with its request rate; then each file
    rows = [line for line in r.output.splitlines() if line.strip("│| ").split(" ")[0] in s["policies"]]
    assert [row.strip("│| ").split(" ")[0] for row in rows] == list(s["policies"]), r.output
    for row, p in zip(rows, s["policies"].values()):
        assert f"{p['request_throughput']:.2f}" in row, row
    for f in ("summary.json", "requests.parquet", "steps.parquet", "report.html"):
        assert str(out / f) in r.output.replace("\n", ""), f  # (a long path wraps)


def test_check_validates_without_running(tmp_path, monkeypatch):
    path = scen(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["check", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # lines as printed, whatever the terminal's width wrapped
    assert text.startswith(f"{path}: ok model opt-13b on 1 x a100-40gb; 60 requests"), text
    for name, batching, kind in (("fastertransformer", "static", "contiguous"), ("orca-max", "continuous", "contiguous"),
                                 ("orca-pow2", "continuous", "contiguous"), ("orca-oracle", "continuous", "contiguous"),
                                 ("vllm", "continuous", "paged")):
        assert f"{name}: {batching} batching, {kind} allocator" in text, name
    assert "KV pool: 14,720 tokens (11.23 GiB), 920 blocks of 16, for every policy" in text  # said once
    assert [p.name for p in tmp_path.iterdir()] == ["s.yaml"]  # nothing run, nothing written


def test_check_says_which_requests_a_policy_rejects_before_any_step(tmp_path):
    """A token budget below every prompt (vLLM refuses it at start-up), a watermark that leaves no room, or requests
    longer than the model: sim check said "ok" and the run showed 0 finished, every request rejected, nowhere
    saying why."""
    path = scen(tmp_path, SMALL.replace("[fastertransformer, orca-max, orca-pow2, orca-oracle, vllm]",
                                        "[{preset: vllm, name: budget, max_num_batched_tokens: 1}, "
                                        "{preset: vllm, name: mark, allocator: {watermark: 0.999999}}, vllm]")
                .replace("lengths: alpaca", "prompt: {kind: fixed, tokens: 2047}, output: {kind: uniform, low: 1, high: 2}"))
    r = runner.invoke(app, ["check", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    long = int(text.split("vllm: continuous batching, paged allocator rejected before any step: ")[1].split()[0])
    assert 0 < long < 60 and f"({long} longer than the model's 2,048 tokens)" in text, text
    assert "budget: continuous batching, paged allocator rejected before any step: 60 of 60 requests " \
        f"({long} longer than the model's 2,048 tokens, {60 - long} with a prefill over max_num_batched_tokens (1))" \
        in text, text
    assert f"mark: continuous batching, paged allocator rejected before any step: 60 of 60 requests " \
        f"({long} longer than the model's 2,048 tokens, {60 - long} that never fit the KV pool, even alone)" in text


def test_user_errors_exit_2_without_traceback(tmp_path):
    bad = scen(tmp_path, SMALL.replace("rate: 3", "rate: -3"))
    for cmd in (["run", str(bad)], ["check", str(bad)], ["run", str(tmp_path / "missing.yaml")]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert "Traceback" not in r.output and "error:" in r.output
    big = scen(tmp_path, SMALL.replace("opt-13b", "opt-175b"))
    r = runner.invoke(app, ["check", str(big)])
    assert r.exit_code == 2 and "does not fit" in r.output


def test_sim_runs_without_torch(tmp_path):
    """sim/ and the CLI's `run` never import torch or triton (they are an optional extra)."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "from cli import app\n"
            f"app(['run', {str(scen(tmp_path))!r}, '--out', {str(tmp_path / 'o')!r}])")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "o" / "report.html").exists()


def test_version_is_the_installed_packages():
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == f"kvsim {version('kvsim')}\n", r.output


def test_help_texts_print_brackets_as_written():
    """Typer reads help text as rich markup: `pip install 'kvsim[native]'` printed as 'kvsim'."""
    r = runner.invoke(app, ["compile", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "kvsim[native]" in r.output, r.output


def test_a_file_of_another_kind_gets_one_line_naming_the_command(tmp_path):
    """A plan given to `sim run`, a scenario to `sim plan`, a plan to `sim sweep`: one error naming the file's
    kind and the command that runs it (each printed about ten key errors); `sim check` checks all three."""
    root = Path(__file__).resolve().parents[1] / "scenarios"
    plan, sweep, scenario = (root / "cluster/plan-azure.yaml", root / "vllm-paper/opt-13b-sharegpt.sweep.yaml",
                             root / "quickstart.yaml")
    for args, kind, command in ((["run", str(plan)], "a plan file", "sim plan"),
                                (["plan", str(scenario)], "a scenario file", "sim run"),
                                (["sweep", str(plan)], "a plan file", "sim plan"),
                                (["run", str(sweep)], "a sweep file", "sim sweep")):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, r.output
        lines = [x for x in r.output.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and kind in lines[0] and f"`{command} {args[1]}`" in r.output.replace("\n", ""), r.output
    r = CliRunner().invoke(app, ["check", str(sweep)])
    assert r.exit_code == 0 and "ok (a sweep: " in " ".join(r.output.split()), r.output  # (wrapped at 80 columns)


@pytest.mark.parametrize("command", ["sweep", "plan"])
@pytest.mark.parametrize("text", ["", "# a comment only\n", "null\n", "~\n", "---\n", "hello\n", "[]\n"])
def test_a_sweep_or_plan_file_that_is_not_a_mapping(tmp_path, command, text):
    """An empty (or null) file crashed `sim sweep` and `sim plan` with a TypeError; a scalar was read as the
    keys "h:, e:, l:, ..." of a scenario file."""
    p = tmp_path / "s.yaml"
    p.write_text(text)
    r = runner.invoke(app, [command, str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.startswith(f"error: {p}: expected a mapping of {command} keys"), r.output


@pytest.mark.parametrize("command", ["sweep", "plan", "check"])
@pytest.mark.parametrize("key", ["bse", "Base", None])
def test_a_sweep_or_plan_file_without_its_base_says_base_is_missing(tmp_path, command, key):
    """It was told "a scenario file ..., not a sweep file: run it with sim run"."""
    body = ("axes: {seed: [1, 2]}\n" if command == "sweep" else
            "rates: [1]\nslo: {mean_tpot_ms: 50}\ngpus: [h100]\nreplicas: {min: 1, max: 2}\n")
    p = tmp_path / "s.yaml"
    p.write_text("name: x\n" + (f"{key}: {{model: opt-13b}}\n" if key else "") + body)
    r = runner.invoke(app, [command, str(p), "--out", str(tmp_path / "o")] if command != "check" else [command, str(p)])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "base: required key is missing" in out and "sim run" not in out, r.output
    if key:
        assert f"{p}:2: {key}: unknown key (did you mean 'base'?)" in out, r.output


def test_sim_check_of_a_sweep_checks_what_each_point_runs(tmp_path):
    """A sweep whose base does not fit its GPU printed 'ok' under `sim check`, then failed every point."""
    (tmp_path / "big.yaml").write_text("name: big\nmodel: opt-175b\ngpu: a100-40gb\npolicies: [vllm]\n"
                                       "workload: {arrival: {kind: poisson, rate: 2}, lengths: alpaca, num_requests: 5}\n")
    (tmp_path / "s.yaml").write_text("base: big.yaml\naxes: {workload.arrival.rate: [1, 2]}\n")
    r = CliRunner().invoke(app, ["check", str(tmp_path / "s.yaml")])
    assert r.exit_code == 2 and "point 0: big: opt-175b does not fit on a100-40gb" in r.output.replace("\n", " ")
