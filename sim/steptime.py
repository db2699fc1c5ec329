"""Step-time models: ``StepPlan`` -> seconds. The simulator's executor.

The roofline model prices each part of a step at the slower of its compute and its memory traffic,
at documented fractions of the GPU's peak. Everything is per tensor-parallel rank (ranks run in
parallel), plus the all-reduces that join them.

    linear layers   max(2 * tokens * params / tp / FLOP/s,  weights / tp / bandwidth)
    prefill attn    4 * head_dim * heads / tp * layers * (query-key pairs)  / FLOP/s
    decode attn     keys read * KV bytes per token (one rank)               / bandwidth
    LM head         max(2 * sampled rows * hidden * vocab / tp / FLOP/s,  LM-head weights / tp / bandwidth)
    all-reduce      2 per layer of tokens * hidden * 2 bytes over the GPU link (ring), when tp > 1
    swap            bytes over the host link + a fixed cost per block copy (per layer, K and V)
    overhead        per step + per scheduled sequence

A decode-only span (the same batch, every context one longer each step) has a closed form, which
the engine uses to skip quiet stretches: step j costs ``fixed(batch) + per_key * (keys_0 + j*batch)``.

The profile model (``ProfileStepTime``) replaces the datasheet with coefficients that ``sim calibrate``
fitted to steps measured on a real device; it is linear in the same physical terms, so it keeps the
closed form.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from sim.catalog import GpuSpec, ModelSpec
from sim.config import RooflineConfig, ScenarioError
from sim.core import StepPlan


class Executor(Protocol):
    """What the engine needs of whatever runs (or prices) a step."""

    def step_time_s(self, plan: StepPlan) -> float:
        """Seconds the step takes (predicted or measured)."""

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float] | None:
        """Seconds of each of ``k`` decode steps that repeat ``plan`` with every context one token
        longer each step; None where no closed form exists (the engine then steps one at a time)."""


class RooflineStepTime:
    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig, paged: bool) -> None:
        self.cfg = cfg
        self.tp = tp
        m = model
        flops = gpu.flops_per_s
        bw = gpu.hbm_bytes_per_s * cfg.bandwidth_efficiency
        self._matmul_flops = flops * cfg.matmul_efficiency
        self._attn_flops = flops * cfg.attention_efficiency
        self._bw = bw
        w = m.dtype_bytes
        self._linear_params = m.num_layers * m.linear_params_per_layer / tp
        self._linear_weight_s = self._linear_params * w / bw
        self._lm_params = m.hidden_size * m.vocab_size / tp
        self._lm_weight_s = self._lm_params * w / bw
        # seconds per query-key pair of prefill attention, per key read by a decode
        self._pair_s = 4 * m.head_dim * (m.num_heads / tp) * m.num_layers / self._attn_flops
        self._key_s = m.kv_bytes_per_token(tp) / bw * (1 + (cfg.paged_attention_overhead if paged else 0.0))
        self._ar_bytes_per_token = m.hidden_size * w
        self._ar_count = 2 * m.num_layers if tp > 1 else 0
        self._link = gpu.interconnect_bytes_per_s
        self._host = gpu.host_bytes_per_s
        self._block_copies = 2 * m.num_layers  # a block is one K and one V slice per layer
        self._kv_bytes_per_token = m.kv_bytes_per_token(tp)
        self._decode_fixed: dict[int, float] = {}  # batch size -> fixed cost of a decode step

    def _fixed_s(self, num_tokens: int, num_seqs: int, num_sampled: int) -> float:
        """Everything but attention: it depends on the token and sequence counts only."""
        c = self.cfg
        t = max(2 * num_tokens * self._linear_params / self._matmul_flops, self._linear_weight_s)
        if num_sampled:
            t += max(2 * num_sampled * self._lm_params / self._matmul_flops, self._lm_weight_s)
        if self._ar_count:
            ring = 2 * (self.tp - 1) / self.tp * num_tokens * self._ar_bytes_per_token / self._link
            t += self._ar_count * (c.allreduce_latency_s + ring)
        return t + c.step_overhead_s + c.per_sequence_overhead_s * num_seqs

    def swap_s(self, num_blocks: int, block_size: int) -> float:
        if not num_blocks:
            return 0.0
        return (num_blocks * block_size * self._kv_bytes_per_token / self._host
                + num_blocks * self._block_copies * self.cfg.swap_copy_overhead_s)

    def copy_s(self, plan: StepPlan) -> float:
        """Forks and copy-on-write: each copied slot read and written once in HBM, one launch."""
        slots = len(plan.copy_blocks) * plan.block_size + sum(n for _, _, n in plan.copy_slots)
        return 2 * slots * self._kv_bytes_per_token / self._bw + self.cfg.swap_copy_overhead_s if slots else 0.0

    def step_time_s(self, plan: StepPlan) -> float:
        t = self._fixed_s(plan.num_tokens, plan.num_seqs, plan.num_sampled)
        t += plan.prefill_attention_pairs * self._pair_s + plan.decode_context_tokens * self._key_s
        if plan.copy_blocks or plan.copy_slots:
            t += self.copy_s(plan)
        return t + self.swap_s(len(plan.swap_in) + len(plan.swap_out), plan.block_size)

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float]:
        # NOTE: the same float operations as step_time_s, so a span reproduces stepping exactly
        n = plan.num_seqs
        fixed = self._decode_fixed.get(n)
        if fixed is None:
            fixed = self._decode_fixed[n] = self._fixed_s(n, n, n)
        key_s, keys = self._key_s, plan.decode_context_tokens
        return [fixed + (keys + n * j) * key_s for j in range(k)]


# ---------------------------------------------------------------------------------------------- profile

PROFILE_FORMAT = "kvsim-step-profile/1"
# The fitted terms, in the order of ``profile_features``' last axis.
PROFILE_TERMS = ("prefill_s", "prefill_token_s", "prefill_pair_s", "decode_s", "decode_seq_s", "decode_key_s")
# What a profile must share with the scenario's model (the shape that sets the work of a step).
PROFILE_MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_size", "vocab_size", "gated_mlp")


def profile_features(num_prefill_tokens, prefill_attention_pairs, num_decode_tokens, decode_context_tokens) -> np.ndarray:
    """A step's fitted terms (scalars or arrays; terms on the last axis, as PROFILE_TERMS):

        prefill part  [has prefill chunks, their tokens (sum n), their query-key pairs]
        decode part   [has one-token entries, their count (batch), the keys they read (sum ctx)]

    A mixed step has both parts: it costs their sum."""
    p = np.asarray(num_prefill_tokens, dtype=np.float64)
    d = np.asarray(num_decode_tokens, dtype=np.float64)
    return np.stack(np.broadcast_arrays((p > 0).astype(np.float64), p, np.asarray(prefill_attention_pairs, np.float64),
                                        (d > 0).astype(np.float64), d, np.asarray(decode_context_tokens, np.float64)),
                    axis=-1)


def profile_model(model: ModelSpec) -> dict:
    return {"name": model.name, **{k: getattr(model, k) for k in PROFILE_MODEL_KEYS}}


def load_profile(path: str | Path, model: ModelSpec | None = None) -> dict:
    """Read a profile written by ``sim calibrate``; when ``model`` is given it must be the profiled shape."""
    path = Path(path)
    try:
        prof = json.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such step-time profile (write one with sim calibrate)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScenarioError(f"{path}: not a readable profile ({e.__class__.__name__}: {e})") from None
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT:
        raise ScenarioError(f"{path}: not a step-time profile (expected format {PROFILE_FORMAT!r})")
    for layout in ("paged", "contiguous"):
        coef = prof.get("layouts", {}).get(layout, {}).get("coefficients", {})
        bad = [t for t in PROFILE_TERMS if not isinstance(coef.get(t), (int, float)) or coef[t] < 0]
        if bad:
            raise ScenarioError(f"{path}: layouts.{layout}.coefficients: missing or negative {', '.join(bad)}")
    if model is not None:
        want, got = profile_model(model), prof.get("model", {})
        diff = [k for k in PROFILE_MODEL_KEYS if got.get(k) != want[k]]
        if diff:
            shown = ", ".join(f"{k} {got.get(k)} vs {want[k]}" for k in diff)
            raise ScenarioError(f"{path}: profiled model {got.get('name')!r} is not the scenario's {model.name!r} "
                                f"({shown}); calibrate this model")
    return prof


class ProfileStepTime:
    """Step time from a calibration profile: ``coefficients`` (PROFILE_TERMS, in seconds per unit) dotted
    with ``profile_features``, plus ``swap_block_s`` per block copied to or from the host."""

    def __init__(self, coefficients: dict[str, float], swap_block_s: float = 0.0) -> None:
        self.coef = np.array([float(coefficients[t]) for t in PROFILE_TERMS])
        self.swap_block_s = float(swap_block_s)

    @classmethod
    def from_profile(cls, profile: dict, paged: bool) -> "ProfileStepTime":
        layout = profile["layouts"]["paged" if paged else "contiguous"]
        return cls(layout["coefficients"], profile.get("swap_block_s", 0.0))

    def predict(self, num_prefill_tokens, prefill_attention_pairs, num_decode_tokens, decode_context_tokens,
                num_swap_blocks=0):
        """Seconds of steps given by their terms (scalars or arrays)."""
        x = profile_features(num_prefill_tokens, prefill_attention_pairs, num_decode_tokens, decode_context_tokens)
        return x @ self.coef + self.swap_block_s * np.asarray(num_swap_blocks, dtype=np.float64)

    def step_time_s(self, plan: StepPlan) -> float:
        return float(self.predict(plan.num_prefill_tokens, plan.prefill_attention_pairs, plan.num_decode_tokens,
                                  plan.decode_context_tokens, len(plan.swap_in) + len(plan.swap_out)))

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float]:
        n = plan.num_seqs
        keys = plan.decode_context_tokens + n * np.arange(k, dtype=np.float64)
        return self.predict(0, 0, n, keys).tolist()
