"""The kernels compile for NVIDIA targets (sm_90: H100/H200; sm_80: A100) on this machine, without a
GPU, in the configurations the wrappers launch, within each target's shared memory, and with K/V tiles
read by 16-byte vector loads (given the alignment the JIT specialises on). A fresh process: the
tests' interpreter mode makes kernels that cannot be compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_helpers import require_backend

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90_and_sm80():
    require_backend()
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # bf16 (serving) for sm_90; fp32 (the kernel checks) for sm_80, the tighter shared memory. fp32's ieee
    # dots take ~6 s each to compile here: on sm_80 the split prefill (the unsplit one's tiles) is left out
    runs = [(["--cc", "90", "--dtypes", "bf16"], 11), (["--cc", "80", "--dtypes", "fp32", "--no-split-prefill"], 9)]
    for args, configurations in runs:
        p = subprocess.run([sys.executable, "-m", "gpu.compile_check", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        if "ptxas" in p.stderr and "No such file" in p.stderr:  # pragma: no cover
            pytest.skip("this triton ships no ptxas")
        rows = json.loads(p.stdout)
        assert p.returncode == 0, [r for r in rows if not r["ok"]]
        assert len(rows) == configurations and all(r["ok"] for r in rows)
        for r in rows:  # vectorised block loads: no element-by-element bf16 reads anywhere
            assert r["vector_loads"] > 0 and r["scalar_16bit_loads"] == 0, r
