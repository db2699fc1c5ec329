"""Device choice, timing and provenance: what every measurement records about where it ran."""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from typing import Callable, TypeVar

import torch
import triton

from gpu.kv_cache import interpreting
from sim.config import ScenarioError

T = TypeVar("T")


def resolve_device(name: str | torch.device) -> torch.device:
    """``cuda`` (or ``cuda:N``) or ``cpu``; a CUDA request without a CUDA device is a user error."""
    name = str(name)
    if name != "cpu" and not name.startswith("cuda"):
        raise ScenarioError(f"--device {name!r}: expected cuda or cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScenarioError(f"--device {name}: torch {torch.__version__} sees no CUDA device (use --device cpu)")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (what serving uses); fp32 on the CPU (CPU bf16 matmuls are slow and its tests tighter)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def default_attention(device: torch.device) -> str:
    """Triton kernels on a GPU; on the CPU the PyTorch path (the interpreter runs kernels, but far too slowly
    to time a replay)."""
    return "triton" if device.type == "cuda" else "torch"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def provenance(device: torch.device) -> dict:
    """Where and with what a measurement was taken."""
    return {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton_interpreter": interpreting(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], T]) -> tuple[T, float]:
    """Run ``fn`` and return (its result, seconds): CUDA events on a GPU (the GPU timeline from the first
    to the last event, host stalls between launches included), ``perf_counter`` on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3


def configure_cpu(threads: int | None) -> None:
    """Torch CPU threads for a measured run. One by default in the commands: on a machine shared with
    other work, multi-threaded CPU timings stall erratically (spinning threads wait for a busy core)."""
    if threads is not None:
        torch.set_num_threads(threads)
