"""Shared set-up of the GPU backend's tests: they run on the CPU through Triton's interpreter, which
must be switched on before triton is first imported, and skip with the reason when torch or triton
is missing (the ``gpu`` extra)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

REASON = "the GPU backend's tests need torch and triton (pip install -e '.[gpu]')"


def require_backend():
    torch = pytest.importorskip("torch", reason=REASON)
    pytest.importorskip("triton", reason=REASON)
    return torch


def kernel_device() -> str:
    """The interpreter runs kernels on CPU tensors; with it switched off (TRITON_INTERPRET=0) on a GPU
    machine, the same tests run the compiled kernels on the GPU."""
    from gpu.kv_cache import interpreting

    return "cpu" if interpreting() else "cuda"
