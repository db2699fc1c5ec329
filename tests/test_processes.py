"""Processes and files: sweep workers die with their parent however it ends; SIGTERM ends a sweep as
Ctrl-C does; two sweeps into one folder are refused; a reused `sim run --out` keeps no old files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app

ROOT = Path(__file__).resolve().parents[1]
SLOW_SWEEP = """\
name: slow
base:
  name: slow
  model: opt-13b
  gpu: a100-40gb
  workload: {arrival: {kind: poisson, rate: 6}, lengths: sharegpt, num_requests: 4000}
  policies: [vllm]
  exact: true
axes: {seed: [0, 1, 2, 3, 4, 5, 6, 7]}
"""


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_sweep(tmp_path: Path) -> subprocess.Popen:
    (tmp_path / "w.yaml").write_text(SLOW_SWEEP)
    return subprocess.Popen([sys.executable, "-c", "from cli import app; app()", "sweep", str(tmp_path / "w.yaml"),
                             "--out", str(tmp_path / "out"), "-j", "2", "--no-report"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_workers(proc: subprocess.Popen, n: int = 2, timeout_s: float = 60) -> list[int]:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        workers = [c for c in _children(proc.pid) if "spawn" in Path(f"/proc/{c}/cmdline").read_bytes().decode(
            errors="replace")]
        if len(workers) >= n:
            return workers
        time.sleep(0.2)
    pytest.fail("the sweep's workers did not start")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_workers_die_when_the_sweep_is_killed(tmp_path):
    proc = _start_sweep(tmp_path)
    workers = _wait_for_workers(proc)
    proc.kill()  # SIGKILL: the parent runs no cleanup at all
    proc.wait()
    t0 = time.time()
    while any(_alive(w) for w in workers) and time.time() - t0 < 10:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers), "workers outlived their sweep"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_sigterm_ends_a_sweep_like_ctrl_c_and_a_second_sweep_is_refused(tmp_path):
    proc = _start_sweep(tmp_path)
    workers = _wait_for_workers(proc)
    second = CliRunner().invoke(app, ["sweep", str(tmp_path / "w.yaml"), "--out", str(tmp_path / "out"), "-j", "1"])
    assert second.exit_code == 2 and f"pid {proc.pid}" in second.output and "another sweep" in second.output
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err and b"Traceback" not in err
    t0 = time.time()
    while any(_alive(w) for w in workers) and time.time() - t0 < 10:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers)


def test_point_files_are_written_under_unique_temporary_names(tmp_path):
    from sim.sweep.drive import Outcome, PointStore
    from sim.sweep.tasks import Task

    store = PointStore(tmp_path)
    seen = []
    orig = Path.replace

    def spy(self, target):
        seen.append(self.name)
        return orig(self, target)

    Path.replace = spy
    try:
        for _ in range(2):
            store.put(Outcome("k", "p", {"x": 1.0}, None, None, 0.1), Task("k", "p", {}))
    finally:
        Path.replace = orig
    assert len(seen) == 2 and seen[0] != seen[1] and str(os.getpid()) in seen[0]
    assert (tmp_path / "points" / "k.json").exists() and not list((tmp_path / "points").glob("*.tmp"))


def test_reusing_run_out_keeps_no_old_files(tmp_path):
    s = tmp_path / "s.yaml"
    s.write_text("name: r\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {arrival: {kind: poisson, rate: 2}, "
                 "lengths: alpaca, num_requests: 5}\npolicies: [vllm, orca-max]\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["run", str(s), "--out", str(out)]).exit_code == 0
    assert (out / "report.html").exists()
    s.write_text(s.read_text().replace("[vllm, orca-max]", "[vllm]"))
    assert CliRunner().invoke(app, ["run", str(s), "--out", str(out), "--no-report"]).exit_code == 0
    assert not (out / "report.html").exists()  # the old run's page is gone, not left beside new tables
    import pandas as pd

    assert set(pd.read_parquet(out / "requests.parquet").policy.astype(str)) == {"vllm"}
