"""benchmarks/bench_instructions.py's bad inputs: each a clear message and exit 2, before any valgrind run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_instructions.py"


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_an_unknown_case_names_the_cases():
    out = _run("vllm", "nope")
    assert out.returncode == 2
    assert "unknown case nope" in out.stderr and "fleet-lo" in out.stderr


def test_no_valgrind_says_how_to_get_it(tmp_path):
    out = _run("vllm", env={"PATH": str(tmp_path)})  # no valgrind (nor setarch) on this PATH
    assert out.returncode == 2
    assert "valgrind is not installed" in out.stderr
