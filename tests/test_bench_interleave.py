"""benchmarks/bench_interleave.py: its driver changes only the order of the servers' events, never their
results; its bad inputs get a clear message."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from sim.config import parse_scenario
from sim.outputs import Columns
from sim.workload import load_requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_interleave  # noqa: E402


def _servers(assigned):
    base = parse_scenario({"name": "t", "model": "opt-13b", "gpu": "a100-40gb", "policies": ["vllm"],
                           "record_steps": True, "decompose": False,
                           "workload": {"arrival": {"kind": "poisson", "rate": 8.0}, "lengths": "sharegpt",
                                        "num_requests": 240, "seed": 3}})
    return bench_interleave.lone_servers(base, load_requests(base), assigned)


def test_taking_servers_together_gives_each_the_results_it_gets_alone():
    assigned = np.arange(240) % 4
    apart, together = _servers(assigned), _servers(assigned)
    events = bench_interleave.drive(apart, 1), bench_interleave.drive(together, 4)
    assert events[0] == events[1] > 240
    for (_, ca, a), (_, ct, t) in zip(apart, together):
        assert ca.now == ct.now
        ra, rt = a.results(), t.results()
        assert ra.summary == rt.summary
        for name in ("requests", "steps", "timeline"):
            x, y = Columns.of(ra.table(name)), Columns.of(rt.table(name))
            assert list(x.data) == list(y.data), name
            assert all(np.array_equal(x[k], y[k], equal_nan=True) for k in x.data), name


def test_blocks_of_events_change_nothing_either():
    assigned = np.arange(240) % 3
    one, blocks = _servers(assigned), _servers(assigned)
    bench_interleave.drive(one, 3)
    bench_interleave.drive(blocks, 3, blocks=5)
    for (_, _, a), (_, _, b) in zip(one, blocks):
        assert a.results().summary == b.results().summary


def test_zero_processes_is_a_clear_error():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_interleave.py"), "--cpu", "0", "3"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2
    assert "PROCESSES and ROUNDS must be at least 1" in out.stderr
