"""The `sim` command as a process (``cli.main``): it ends without the interpreter's teardown, so these
pin what must still hold then: exit codes, output flushed, result files whole, exit handlers run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SMALL = textwrap.dedent("""\
    name: main
    model: opt-13b
    gpu: a100-40gb
    workload: {arrival: {kind: poisson, rate: 6}, lengths: sharegpt, num_requests: 40, seed: 2}
    policies: [orca-max, vllm]
    """)


def sim(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000"}  # a long temporary path on one line
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_run_writes_whole_files_and_prints_everything(tmp_path):
    (tmp_path / "s.yaml").write_text(SMALL)
    p = sim("run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out"), "--no-report")
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert set(summary["policies"]) == {"orca-max", "vllm"}
    requests = pq.read_table(tmp_path / "out" / "requests.parquet")
    assert requests.num_rows == 2 * 40
    last = p.stdout.rstrip().splitlines()[-1]  # the written paths come last: all of them reached the pipe
    assert last.split(":")[0].strip() == "timeline" and last.endswith("timeline.parquet"), p.stdout
    assert pq.read_table(tmp_path / "out" / "timeline.parquet").num_rows > 0


def test_user_error_exits_2_with_its_message(tmp_path):
    (tmp_path / "bad.yaml").write_text(SMALL.replace("opt-13b", "no-such-model"))
    p = sim("check", str(tmp_path / "bad.yaml"))
    assert p.returncode == 2
    assert "error:" in p.stderr and "no-such-model" in p.stderr, p.stderr


def test_usage_error_exits_2():
    p = sim("run")
    assert p.returncode == 2
    assert "Missing argument" in p.stderr, p.stderr


def test_an_empty_out_is_an_error_not_the_current_folder(tmp_path):
    """``--out "$OUT"`` with OUT unset: typer reads "" as the current folder, and the results landed there."""
    (tmp_path / "s.yaml").write_text(SMALL)
    # (and any other empty argument: `trace fetch --dir ""` fetched into the current folder, `run ""` said
    # ".: not a regular file")
    for args, said in ((["run", "s.yaml", "--out", ""], "--out"), (["run", "s.yaml", "-o", " "], "-o"),
                       (["run", "s.yaml", "--out="], "--out"), (["run", ""], "an argument"),
                       (["trace", "fetch", "azure-2023-conv", "--dir", ""], "--dir")):
        p = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and f"error: {said}: an empty value" in p.stderr, (args, p.stderr)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["s.yaml"]


def test_gpu_commands_check_their_options_before_measuring(tmp_path):
    """A bad --attention, --cpu-threads or --seed was a traceback from inside the backend, and a wrong --out
    failed only after the measurement; each is now one line before anything runs."""
    (tmp_path / "s.yaml").write_text(SMALL)
    s = str(tmp_path / "s.yaml")
    for args, message in ((["replay", s, "--attention", "flash"], "'flash' is not one of"),
                          (["replay", s, "--cpu-threads", "0"], "--cpu-threads"),
                          (["calibrate", "--quick", "--cpu-threads", "-1", "--out", str(tmp_path / "p.json")], "--cpu-threads"),
                          (["replay", s, "--seed", "-1"], "--seed"),
                          (["replay", s, "--out", s], "exists and is not a folder"),
                          (["validate", s, "--out", s], "exists and is not a folder"),
                          (["calibrate", "--quick", "--out", str(tmp_path)], "is a folder")):
        p = sim(*args)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_exit_handlers_run_and_output_is_flushed():
    code = ("import atexit, sys\n"
            "import cli\n"
            "atexit.register(lambda: print('handler ran'))\n"
            "sys.argv = ['sim', '--version']\n"
            "print('before', end='')\n"  # unflushed at exit: the exit flushes it
            "cli.main()\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("before") and "kvsim" in p.stdout and p.stdout.rstrip().endswith("handler ran"), p.stdout


def test_a_profiler_still_writes_its_data(tmp_path):
    """`python -m cProfile -o F cli.py ...` writes F when the profiled command ends (the ordinary exit)."""
    out = tmp_path / "cli.prof"
    p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "cli.py", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "kvsim" in p.stdout and out.stat().st_size > 0


def test_blas_threads_are_one_unless_the_user_chose(tmp_path):
    """numpy's OpenBLAS threads spin waiting for work the simulator never gives: ``sim`` asks for one,
    before numpy is imported, and keeps a user's own setting."""
    code = ("import atexit, os, sys; sys.argv = ['sim', '--version']; "
            "atexit.register(lambda: print('blas', os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)); "
            "import cli; cli.main()")
    for given, want in ((None, "blas 1 False"), ("3", "blas 3 False")):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
        if given:
            env["OPENBLAS_NUM_THREADS"] = given
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout.splitlines()[-1] == want, (p.stdout, p.stderr)
