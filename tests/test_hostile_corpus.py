"""The hostile-input corpus (tests/hostile/cases.yaml, written by tests/hostile/generate.py): malformed
scenarios, sweeps, traces of every format, output paths, result folders and model files. Each must end
in exit code 2 with one clear message naming the file and the key or line -- never a traceback, a hang
or a silent success -- within a time and memory bound."""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app

CASES = yaml.safe_load((Path(__file__).parent / "hostile" / "cases.yaml").read_text())
TIME_LIMIT_S = 20.0
MEMORY_LIMIT_MIB = 1024  # growth of this process's peak RSS over one case


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.write_bytes(text.encode("latin-1"))  # NOTE: "\x00\xff" cases mean those bytes
    except UnicodeEncodeError:
        path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_hostile_input(tmp_path, case):
    for name, text in case["files"].items():
        write(tmp_path / name, text)
    if case.get("run"):
        r = CliRunner().invoke(app, ["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "run"), "--no-report"])
        assert r.exit_code == 0, r.output
        for name, text in case.get("replace", {}).items():
            if text is None:
                (tmp_path / name).unlink()
            else:
                write(tmp_path / name, text)
    args = [a.replace("{dir}", str(tmp_path)) for a in case["args"]]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, args)
    elapsed = time.perf_counter() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    out = r.output.replace("\n", "")
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{type(r.exception).__name__}: {r.exception}"
    assert "Traceback" not in r.output
    assert r.exit_code == 2, r.output
    for s in case["contains"]:
        assert s.replace("{dir}", str(tmp_path)) in out, f"{s!r} not in: {r.output}"
    assert elapsed < TIME_LIMIT_S and grown_mib < MEMORY_LIMIT_MIB
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
