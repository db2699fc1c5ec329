from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces"
sys.path.insert(0, str(ROOT))

from sim.config import parse_scenario  # noqa: E402


def scenario(**over):
    """A small valid scenario (OPT-13B on an A100-40GB), with top-level keys overridden."""
    data = {
        "name": "t",
        "model": "opt-13b",
        "gpu": "a100-40gb",
        "workload": {"arrival": {"kind": "poisson", "rate": 4.0}, "lengths": "sharegpt", "num_requests": 200, "seed": 1},
        "policies": ["fastertransformer", "orca-max", "orca-pow2", "orca-oracle", "vllm"],
    }
    data.update(over)
    return parse_scenario(data)


@pytest.fixture
def make_scenario():
    return scenario


def shared_trace(rel: str) -> Path:
    p = SHARED_TRACES / rel
    if not p.exists():
        pytest.skip(f"shared trace {rel} not found at {SHARED_TRACES} (real traces live outside the project)")
    return p
