"""Engine profiles: the host (CPU) work a serving engine does around each GPU step.

A step's host work is priced per step, per scheduled sequence and per sampled token. Work the engine
does between GPU steps (scheduling, preparing inputs) is *serial*: it adds to the GPU's time. Work it
does while the GPU runs (in another process, or asynchronously) is *overlapped*: it only shows when it
is longer than the GPU's work. So

    step = serial_host + max(gpu, overlapped_host)

and the host cost never shrinks with tensor parallelism (one scheduler drives every rank), which is why
real step times at large batches barely shrink when GPUs are added.

The defaults are **assumptions reasoned from public sources, not measurements**; `sim calibrate`
measures host enqueue time against GPU time on a device. Sources:

- vLLM's v0.6.0 performance post (blog.vllm.ai, 2024-09-05) profiled Llama-3-8B on one H100 with
  v0.5.3: the HTTP API server took 33 % of the time, scheduling and input preparation 29 %, and the
  GPU was busy for the remaining 38 %. v0.6.0 moved the API server to its own process, made output
  processing asynchronous (overlapped with the next step) and added multi-step scheduling.
- vLLM V1's design (its architecture docs and the V1 alpha post, 2025-01): the engine core runs the
  scheduler and the model in a busy loop, keeps a persistent batch (inputs updated incrementally), and
  detokenizes and streams in a separate front-end process.

Per-item costs are of the order of Python work per object: tens of microseconds per sequence for a
pure-Python scheduler that rebuilds inputs every step (v0), about ten for incremental updates (V1),
and tens per sampled token for detokenizing and streaming. A consistency check, not a fit: with the
`vllm-0.5` profile, Llama-3-8B on one H100 at a decode batch of 150 spends about 6 ms on the GPU and
2 + 150 x 0.07 = 12.5 ms on the host, so the GPU is busy about 32 % of the time (the post: 38 %).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineProfile:
    """Host seconds per step, per scheduled sequence and per sampled token, serial and overlapped."""

    name: str
    serial_step_s: float = 0.0
    serial_per_seq_s: float = 0.0
    serial_per_token_s: float = 0.0
    overlapped_step_s: float = 0.0
    overlapped_per_seq_s: float = 0.0
    overlapped_per_token_s: float = 0.0
    summary: str = ""


ENGINES: dict[str, EngineProfile] = {
    e.name: e
    for e in [
        EngineProfile("none", summary="no host cost: the GPU's work alone (kernel-level comparisons)"),
        EngineProfile("vllm-0.5", serial_step_s=2e-3, serial_per_seq_s=35e-6, serial_per_token_s=35e-6,
                      summary="vLLM v0 up to 0.5: API server, scheduling, input preparation and output "
                              "processing all on the critical path (serial)"),
        EngineProfile("vllm-0.6", serial_step_s=1e-3, serial_per_seq_s=30e-6, overlapped_per_token_s=35e-6,
                      summary="vLLM 0.6: scheduling and input preparation serial; output processing "
                              "asynchronous and the API server in its own process (overlapped)"),
        EngineProfile("vllm-v1", serial_step_s=0.3e-3, serial_per_seq_s=10e-6, overlapped_per_token_s=25e-6,
                      summary="vLLM V1: scheduler and persistent batch in a busy loop (serial, cheap); "
                              "detokenizing and streaming in the front-end process (overlapped)"),
    ]
}


def engine_profile(cfg) -> EngineProfile:
    """The step-time config's engine profile, with any host costs it overrides."""
    base = ENGINES[cfg.engine]
    over = cfg.host_overrides()
    return replace(base, **over) if over else base
