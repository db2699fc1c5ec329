"""Device choice, timing and provenance: what every measurement records about where it ran."""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from typing import Callable, TypeVar

import torch
import triton

from gpu.kv_cache import interpreting

T = TypeVar("T")
GIB = 1 << 30


def _user_error(msg: str) -> Exception:
    """The simulator's ScenarioError (the CLI prints it plainly), imported only when raised: the kernels
    and this module run without the simulator's dependencies (pydantic): without them, a ValueError with
    the same message (not the missing package's ImportError in its place)."""
    try:
        from sim.config import ScenarioError
    except ImportError:
        return ValueError(msg)
    return ScenarioError(msg)


def resolve_device(name: str | torch.device) -> torch.device:
    """``cuda`` (or ``cuda:N``) or ``cpu``; a CUDA request without a CUDA device is a user error."""
    name = str(name)
    if name != "cpu" and not name.startswith("cuda"):
        raise _user_error(f"--device {name!r}: expected cuda or cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # "cuda:x"
        raise _user_error(f"--device {name!r}: expected cpu, cuda or cuda:N (N a device index)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _user_error(f"--device {name}: torch {torch.__version__} sees no CUDA device (use --device cpu)")
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


def usable_memory(device: torch.device) -> dict | None:
    """The device's memory as the driver reports it (``torch.cuda.mem_get_info``): what a run can really
    allocate, not a datasheet figure (an H200 shows about 139.8 GiB of its 141 GB). None on the CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"free_bytes": int(free), "total_bytes": int(total), "free_gib": free / GIB, "total_gib": total / GIB}


def free_memory_bytes(device: torch.device) -> int | None:
    """What can still be allocated on ``device``: on a GPU the driver's free memory plus what PyTorch's
    caching allocator holds unused (freed tensors it keeps: the driver counts them as taken, and an earlier
    run in the same process leaves them); the host's available memory (``MemAvailable`` of /proc/meminfo)
    on the CPU; None where it is not known."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(int(cached), 0)
    if device.type != "cpu":
        return None
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


SMALLER_MODEL = ("the GPU backend holds the whole model on one device; use a smaller model (a config.json with "
                 "fewer layers, such as gpu/configs/tiny-llama.json) or a device with more memory")


def check_fits(what: str, nbytes: int, device: torch.device, advice: str = SMALLER_MODEL) -> None:
    """Refuse, before allocating, ``nbytes`` that ``device`` does not have free (on the CPU, filling more
    than the host has ends in swapping or the kernel's out-of-memory killer, not an error)."""
    free = free_memory_bytes(device)
    if free is not None and nbytes > free:
        where = "host memory" if device.type == "cpu" else str(device)
        raise _user_error(f"{what}: {_size(nbytes)}, more than the {_size(free)} free in {where}: {advice}")


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB // 10 else f"{nbytes / (1 << 20):,.1f} MiB"


def provenance(device: torch.device) -> dict:
    """Where and with what a measurement was taken."""
    out = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "triton_interpreter": interpreting(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(sm_count=props.multi_processor_count, compute_capability=f"{props.major}.{props.minor}",
                   memory=usable_memory(device))
        out["nvml"] = nvml_info(device)
    return out


def _nvml(device: torch.device):
    """(pynvml, handle) of the device, or (None, reason) when nvidia-ml-py is missing or NVML fails."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception as e:  # noqa: BLE001 - provenance is best effort, and says why it is missing
        return None, f"NVML: {e.__class__.__name__}: {e}"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_info(device: torch.device) -> dict:
    """Driver, board and limits from NVML (nvidia-ml-py), each field guarded."""
    nv, h = _nvml(device)
    if nv is None:
        return {"error": h}
    out: dict = {}
    fields = {
        "driver": lambda: _text(nv.nvmlSystemGetDriverVersion()),
        "name": lambda: _text(nv.nvmlDeviceGetName(h)),
        "memory_total_bytes": lambda: int(nv.nvmlDeviceGetMemoryInfo(h).total),
        "power_limit_w": lambda: nv.nvmlDeviceGetPowerManagementLimit(h) / 1000,
        "max_sm_clock_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
        "max_memory_clock_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),
        "persistence_mode": lambda: nv.nvmlDeviceGetPersistenceMode(h),
    }
    return _read_fields(fields, out)


def _read_fields(fields: dict, out: dict) -> dict:
    """Each NVML field into ``out``, or why it is unavailable (an older driver lacks some queries)."""
    for k, f in fields.items():
        try:
            out[k] = f()
        except Exception as e:  # noqa: BLE001
            out[k] = f"unavailable ({e.__class__.__name__})"
    return out


def clocks(device: torch.device) -> dict | None:
    """Clocks, temperature, power and throttle reasons now (NVML), for before and after each section.
    None on the CPU; ``{"error": ...}`` where NVML is missing."""
    if device.type != "cuda":
        return None
    nv, h = _nvml(device)
    if nv is None:
        return {"error": h}
    fields = {
        "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
        "memory_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
        "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000,
        "clock_event_reasons": lambda: int((getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                                            or nv.nvmlDeviceGetCurrentClocksThrottleReasons)(h)),
        "memory_used_bytes": lambda: int(nv.nvmlDeviceGetMemoryInfo(h).used),
    }
    out = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    return _read_fields(fields, out)


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


def host_and_device_s(device: torch.device, fn: Callable[[], T]) -> tuple[T, float, float | None]:
    """Run ``fn`` (which must not wait for the device) and return (its result, host seconds to enqueue it,
    device seconds between CUDA events around it, None on the CPU). Device time >= host time means the
    device, not Python, set the pace; host time close to device time means the step was host-bound
    (the GPU waited for launches)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0, None
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    out = fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return out, host, start.elapsed_time(end) / 1e3


def configure_cpu(threads: int | None) -> None:
    """Torch CPU threads for a measured run. One by default in the commands: on a machine shared with
    other work, multi-threaded CPU timings stall erratically (spinning threads wait for a busy core)."""
    if threads is not None:
        torch.set_num_threads(threads)
