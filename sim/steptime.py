"""Step-time models: ``StepPlan`` -> seconds. The simulator's executor.

The roofline model prices a step's GPU work op by op, per tensor-parallel rank (ranks run in parallel),
plus the all-reduces that join them, plus the host's work around it:

    per layer   4 GEMMs (QKV, output projection, gate/up, down)     OpPricer.gemm_s
                elementwise ops (2 norms, rope, activation, 2 adds) OpPricer.elementwise_s
                2 all-reduces of tokens * hidden * 2 bytes          OpPricer.allreduce_s   (tp > 1)
    prefill attn 2 * (head_dim + v_head_dim) * heads / tp * layers * (query-key pairs) / (attention_efficiency
                 * FLOP/s): QK^T and PV (v_head_dim is head_dim but in MLA, computed decompressed: 192 and 128)
    decode attn  keys read * KV bytes per token (one rank) / (bandwidth_efficiency * HBM bandwidth);
                 a paged kernel also reads the padding of each sequence's last block and pays each block
                 it visits (block-table read, partial tile) as much as ``paged_block_cost_tokens`` keys.
                 MLA decodes in the absorbed form, 2 * (kv_lora_rank + qk_rope_head_dim) + 2 * kv_lora_rank
                 FLOPs per key and head: a key costs the larger of its bytes and its FLOPs (_mla_key_s)
    LM head      a GEMM of the sampled rows; gpu_overhead_s per step
    host         an engine profile (``sim/engines.py``): serial host work adds to the GPU's, overlapped
                 host work hides behind it:  step = serial_host + max(gpu, overlapped_host)
    swap         bytes over the host link + a fixed cost per block copy (per layer, K and V); CPU-tier
                 prefix-cache loads (``plan.host_loads``): their bytes over the host link + one batched
                 copy per layer, K and V (``load_s``)

GEMMs and elementwise ops use the coefficients fitted to measured operator profiles when the GPU's
catalog entry has them (``sim/profiles.py``; a smooth transition between the weight-streaming and the
compute-bound regimes, compute on whole tiles of rows), else the datasheet roofline ``max(compute, memory)``
at fixed efficiencies.

A decode-only span (the same batch, every context one longer each step) has a closed form, which
the engine uses to skip quiet stretches: everything but decode attention depends on the batch size
alone, and decode attention is linear in the keys read.

The profile model (``ProfileStepTime``) replaces the datasheet with coefficients that ``sim calibrate``
fitted to steps measured on a real device; it is linear in the same physical terms, so it keeps the
closed form.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from pathlib import Path
from typing import Protocol

import numpy as np

from sim.buffers import append, vec
from sim.catalog import GPUS, GpuSpec, ModelSpec
from sim.config import MAX_BLOCK_SIZE, MAX_COST_S, RooflineConfig, ScenarioError
from sim.core import StepPlan
from sim.engines import engine_profile
from sim.layouts import head_sum, kv_layout, window_runs
from sim.userfile import read_json


class Executor(Protocol):
    """What the engine needs of whatever runs (or prices) a step. One that has ``bind_kv(kv)`` is handed
    the engine's KV manager once (the GPU replay reads the hybrid allocator's per-group tables from it)."""

    def step_time_s(self, plan: StepPlan) -> float:
        """Seconds the step takes (predicted or measured)."""

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float] | None:
        """Seconds of each of ``k`` decode steps that repeat ``plan`` with every context one token
        longer each step; None where no closed form exists (the engine then steps one at a time)."""


class OpPricer:
    """Seconds of one layer's ops on one tensor-parallel rank: fitted coefficients when the GPU has
    them (and ``cfg.operators`` is "fitted"), else the datasheet roofline. Works on floats and on numpy
    arrays of token counts alike (``sim profiles validate`` prices whole profiles with it)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig) -> None:
        self.model, self.gpu, self.tp, self.cfg = model, gpu, tp, cfg
        self.fit = gpu.operators if cfg.operators == "fitted" else None
        self.gemms = model.layer_gemms(tp)
        self.elementwise = model.layer_elementwise_bytes(tp)
        if model.learned_positions:  # OPT: learned positions, no rotary embedding
            del self.elementwise["attn_rope"]
        self._matmul_flops = gpu.flops_per_s * cfg.matmul_efficiency
        self._bw = gpu.hbm_bytes_per_s * cfg.bandwidth_efficiency

    @property
    def source(self) -> str:
        if self.fit is not None:
            return self.gpu.operators_note
        return "datasheet roofline" + (" (operators: datasheet)" if self.gpu.operators else ": no measurements")

    def gemm_s(self, m, n, k, weight_bytes=None):
        """Numbers or numpy arrays. ``weight_bytes``: the weights' bytes per element when not the model
        dtype's (fp8 checkpoints); their FLOPs stay at the model dtype's peak (fp8 tensor cores are not
        credited: conservative)."""
        if self.fit is not None:
            return self.fit.gemm.time_s(m, n, k, self.gpu, self.model.dtype_bytes, weight_bytes)
        w = self.model.dtype_bytes
        moved = w * (m * k + k * n + m * n) if weight_bytes is None else w * (m * k + m * n) + weight_bytes * k * n
        return np.maximum(2.0 * m * n * k / self._matmul_flops, moved / self._bw)

    def elementwise_s(self, op: str, m):
        nbytes = m * self.elementwise[op]
        if self.fit is not None and op in self.fit.elementwise:
            e = self.fit.elementwise[op]
            return e.launch_s + nbytes / (e.bandwidth_efficiency * self.gpu.hbm_bytes_per_s)
        return nbytes / self._bw

    def allreduce_s(self, nbytes):
        """One all-reduce of ``nbytes`` among the tp ranks (0 without tensor parallelism)."""
        if self.tp == 1:
            return 0.0 * nbytes
        if self.fit is not None and self.tp in self.fit.allreduce:
            return self.fit.allreduce[self.tp].time_s(nbytes)
        bw, latency, _ = self.gpu.ring_link(self.tp)
        ring = 2 * (self.tp - 1) / self.tp * nbytes / bw
        return (self.cfg.allreduce_latency_s if latency is None else latency) + ring

    @property
    def allreduce_source(self) -> str:
        """Where this TP degree's all-reduce time comes from (``sim steptime`` prints it)."""
        if self.tp == 1:
            return "none (TP 1)"
        if self.fit is not None and self.tp in self.fit.allreduce:
            return f"fitted at TP {self.tp} ({self.fit.topology or 'measured'})"
        measured = sorted(self.fit.allreduce) if self.fit is not None else []
        return (f"datasheet ring over {self.gpu.ring_link(self.tp)[2]}; not measured"
                + (f" (measured at TP {', '.join(map(str, measured))})" if measured else ""))

    def layer_s(self, m) -> dict:
        """One layer's non-attention parts for ``m`` tokens: linear, elementwise, all-reduce seconds."""
        linear = sum(self.gemm_s(m, n, k) for n, k in self.gemms.values())
        elementwise = sum(self.elementwise_s(op, m) * (2 if op == "add" else 1) for op in self.elementwise)
        allreduce = 2 * self.allreduce_s(m * self.model.hidden_size * self.model.dtype_bytes)
        return {"linear": linear, "elementwise": elementwise, "allreduce": allreduce}

    def lm_head_s(self, m):
        return self.gemm_s(m, self.model.vocab_size // self.tp, self.model.hidden_size) if m else 0.0


def distinct_experts(num_experts: int, per_token: int, tokens):
    """Expected distinct experts a batch of ``tokens`` tokens routes to, each token to ``per_token`` of
    ``num_experts`` experts, spread uniformly and independently: E * (1 - (1 - k/E)**tokens). A first model:
    real routers are skewed, which makes fewer experts busy."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def _pair_flops(model: ModelSpec) -> int:
    """FLOPs of one query-key pair of prefill attention per head and layer: QK^T over head_dim, PV over the
    value's width (MLA's prefill runs decompressed, as vLLM's: 2 * 192 + 2 * 128 for DeepSeek-V3)."""
    return 2 * model.head_dim + 2 * (model.v_head_dim or model.head_dim)


def _mla_key_s(model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig) -> float:
    """Compute seconds of one key of one MLA layer in a decode, in vLLM's absorbed form (queries projected
    into the latent): 2 * (kv_lora_rank + qk_rope_head_dim) FLOPs for the scores and 2 * kv_lora_rank for
    the weighted latents, per head on the rank; with many heads per rank (tp 1 or 2) this outweighs reading
    the latent. 0 for a model without MLA."""
    r = model.kv_lora_rank
    flops = (2 * (r + model.qk_rope_head_dim) + 2 * r) * (model.num_heads / tp)
    return flops / (gpu.flops_per_s * cfg.attention_efficiency)


_PRICING_CACHES: dict[tuple, tuple[dict, dict]] = {}


def _pricing_cache(model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig) -> tuple[dict, dict]:
    """The caches of ``RooflineStepTime._fixed_parts`` ((tokens, sequences, samples) -> (GPU, serial host,
    overlapped host) seconds; tokens -> GPU seconds of the layers but attention) for these inputs, which
    are all that those depend on: a fleet's replicas, a scenario's policies and a sweep's points on the
    same model and GPU price each shape once. Each is bounded as before (``_fixed_parts``), and a process
    keeps those of at most 8 inputs."""
    key = (repr(model), repr(gpu), tp, cfg.model_dump_json())
    got = _PRICING_CACHES.get(key)
    if got is None:
        if len(_PRICING_CACHES) >= 8:  # at most 8 x 65,536 shapes (about 100 MiB) outlive their runs
            _PRICING_CACHES.clear()
        got = _PRICING_CACHES[key] = ({}, {})
    return got


class RooflineStepTime:
    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig, paged: bool,
                 layout=None) -> None:
        self.cfg = cfg
        self.tp = tp
        self.paged = paged
        m = model
        self.ops = OpPricer(model, gpu, tp, cfg)
        self.engine = engine_profile(cfg)
        self._num_layers = m.num_layers
        bw = gpu.hbm_bytes_per_s * cfg.bandwidth_efficiency
        self._bw = bw
        # seconds per query-key pair of prefill attention, per key read by a decode
        self._pair_s = _pair_flops(m) * (m.num_heads / tp) * m.num_layers / (gpu.flops_per_s * cfg.attention_efficiency)
        self._key_s = max(m.kv_bytes_per_token(tp) / bw, m.kinds.count("mla") * _mla_key_s(m, gpu, tp, cfg))
        self._host = gpu.host_bytes_per_s
        self._block_copies = 2 * m.num_layers  # a block is one K and one V slice per layer
        self._kv_bytes_per_token = m.kv_bytes_per_token(tp)
        # see _fixed_parts; shared by every pricer of the same model, GPU, TP and config in this process
        self._fixed, self._layers = _pricing_cache(model, gpu, tp, cfg)
        self._paged_terms: dict[int, tuple[float, float]] = {}
        self.model, self.gpu = model, gpu
        self.layout = layout
        # several KV groups: attention priced per group (_groups_attention_s)
        self._groups: list[tuple[str, int, float, float]] | None = None
        # (plan, (sorted decode offsets, their sum, shift)): _decode_contexts
        self._contexts: tuple[StepPlan, tuple[list[int], int, int]] | None = None
        if layout is not None:
            self._set_layout(layout)

    # ------------------------------------------------------------------ today's layouts (sim/layouts.py)

    def _set_layout(self, layout) -> None:
        """Decode reads follow the layout's bytes (fp8, MLA's latent); with several groups, a window
        group reads at most W keys per decode (C for a chunk: the keys of its chunk) and its prefill
        attends to as many; a Mamba layer reads and writes its state once per decode and scans
        6 * d_inner * d_state FLOPs per prefill token."""
        m, gpu, tp, cfg, bw = self.model, self.gpu, self.tp, self.cfg, self._bw
        mla_s = _mla_key_s(m, gpu, tp, cfg)
        if layout.single:
            self._key_s = max(layout.slot_bytes / bw, m.kinds.count("mla") * mla_s)
            self._kv_bytes_per_token = layout.slot_bytes
            return
        self._kv_bytes_per_token = layout.slot_bytes * layout.num_attention_groups
        self._key_s = self._kv_bytes_per_token / bw  # a token in every attention group (the per-sequence terms)
        flops = gpu.flops_per_s * cfg.attention_efficiency
        pair = _pair_flops(m) * (m.num_heads / tp) / flops  # one layer's query-key pair
        layers: dict[tuple[str, int], int] = {}  # groups of one kind and window read alike: priced together
        for g in layout.groups:
            if g.attention:
                layers[(g.kind, g.window)] = layers.get((g.kind, g.window), 0) + g.layers
        self._groups = [(kind, w, max(n * layout.layer_bytes / bw, n * mla_s if kind == "mla" else 0.0), n * pair)
                        for (kind, w), n in layers.items()]
        mamba = sum(g.layers for g in layout.groups if not g.attention)
        self._mamba_seq_s = 2 * mamba * m.mamba_state_bytes(tp) / bw
        self._mamba_token_s = 6 * mamba * (m.mamba_d_inner / tp) * m.mamba_d_state / flops

    @staticmethod
    def _keys(kind: str, window: int, c: int) -> int:
        """Keys the token at position ``c`` reads in a group of ``kind``."""
        if kind == "sliding":
            return min(c + 1, window)
        if kind == "chunked":
            return c % window + 1
        return c + 1

    def _decode_contexts(self, plan: StepPlan) -> tuple[list[int], int, int]:
        """The clocked decodes' keys (cached context + the token) as ``offs[i] + d``: ``offs`` sorted, with
        their sum; kept for the plan (the engine prices a span's first step, then the span, from the
        same plan). The scheduler's decode clock keeps its offsets sorted (``DecodeClock.decode_contexts``),
        so nothing here is per sequence. Python lists: batches are small, and numpy's per-call overhead
        dominated."""
        got = self._contexts
        if got is not None and got[0] is plan:
            return got[1]
        if plan._contexts is not None:
            ctx = plan._contexts()
        else:  # a plan built elsewhere: its decodes' keys, sorted
            a = sorted([s.num_computed_tokens + 1 for s in plan._decoding])
            ctx = (a, sum(a), 0)
        self._contexts = (plan, ctx)
        return ctx

    def _groups_attention_s(self, plan: StepPlan) -> float:
        """Attention of a step of a model with several KV groups: the clocked decodes' keys summed over
        their sorted contexts (``_decode_contexts``), the other sequences one by one. Key and pair counts
        are integers, so how they are summed does not change the figure."""
        ctx = self._decode_contexts(plan)
        # (typed: unpacked from a bare tuple, and the entries' counts read untyped, every sum and product
        # below was Python's generic one)
        offs: list[int] = ctx[0]
        total: int = ctx[1]
        d: int = ctx[2]
        m = len(offs)
        dec: list[int] = []  # the other sequences: one-token steps (their keys: context + 1)
        pre: list[tuple[int, int]] = []  # and chunks
        for s, k in plan._entries:
            n: int = k
            if n == 1:
                dec.append(s.num_computed_tokens + 1)
            else:
                pre.append((s.num_computed_tokens, n))
        per_key, _ = self.decode_key_terms(plan.block_size)
        f = per_key / self._key_s  # the paged kernel's block overhead, as for the classic layout
        t = 0.0
        groups = self._groups
        assert groups is not None  # (set: several groups; narrowed, the compiled build's arithmetic is unboxed)
        for kind, window, key_s, pair_s in groups:
            if kind == "sliding":  # keys offs + d below W grow, the rest read W
                i = bisect_left(offs, window - d)
                keys = head_sum(offs, total, i) + i * d + window * (m - i)
                for x in dec:
                    keys += x if x < window else window
            elif kind == "chunked":
                keys = sum((o + d - 1) % window + 1 for o in offs) + sum([(x - 1) % window + 1 for x in dec])
            else:
                keys = total + m * d + sum(dec)
            pairs = 0
            for c, n in pre:
                if kind == "sliding":  # sum over positions c..c+n-1 of min(p + 1, W)
                    lo, hi = c + 1, c + n
                    below = max(0, min(hi, window) - lo + 1)
                    pairs += (lo + lo + below - 1) * below // 2 + (n - below) * window
                elif kind == "chunked":
                    pairs += sum(self._keys(kind, window, p) for p in range(c, c + n))
                else:
                    pairs += n * c + n * (n + 1) // 2
            t += keys * key_s * f + pairs * pair_s
        prefill = sum(n for _, n in pre)
        return t + (m + len(dec)) * self._mamba_seq_s + prefill * self._mamba_token_s

    def _groups_span_s(self, plan: StepPlan, k: int) -> list[float] | None:
        """``decode_span_s`` with several KV groups: a window group's keys stop growing at W (a chunk's
        restart at each chunk boundary), so the keys of each step are summed over the sequences (sorted
        contexts and their sum), then priced with the same float operations as ``step_time_s`` (a span is
        decode-only: no copies or swaps to add)."""
        n = plan.num_seqs
        gpu, serial, hidden = self._fixed_parts(n, n, n)
        per_key, per_seq = self.decode_key_terms(plan.block_size)
        f = per_key / self._key_s
        ctx = self._decode_contexts(plan)
        r0, r1, r2 = n * self._mamba_seq_s, 0 * self._mamba_token_s, n * per_seq
        # NOTE: plain floats in step_time_s's order (spans are short: numpy's overhead would dominate), so
        # each step's figure is the same bits as stepping's: there a step's attention is 0.0 + each group's
        # keys * key_s * f + pairs * pair_s in turn, then + r0 + r1 + r2; adding an exact zero to a float
        # >= 0 changes no bit, so the zeros (no pairs in a decode; no Mamba layer) are left out
        # NOTE: concrete types (the groups narrowed from None, ``t`` a vec[float]) so that the compiled build
        # does the arithmetic unboxed: read through an Optional, every multiply went through Python's generic
        # number protocol (ten times the single-group span's cost). Each step's figure is built in ``t``,
        # group after group, and boxed once at the end; a window group's keys come as runs of one slope
        # (layouts.window_runs)
        offs, total, d = ctx
        m = len(offs)
        t = vec[float](capacity=k)
        first = True
        groups = self._groups
        assert groups is not None  # (set: several groups; narrowed, key_s is a float to the compiled build)
        for kind, window, key_s, _ in groups:
            if kind == "sliding":  # keys stop growing at W
                for j0, j1, base, slope in window_runs(offs, total, d, window, k):
                    for q in range(j0, j1):
                        x = (base + q * slope) * key_s * f
                        if first:
                            t = append(t, x)
                        else:
                            t[q] = t[q] + x
            else:
                for q in range(k):
                    if kind == "chunked":  # a chunk's keys restart at each chunk boundary: summed per step
                        x = sum([(o + d - 1 + q) % window + 1 for o in offs]) * key_s * f
                    else:
                        x = (total + m * d + m * q) * key_s * f
                    if first:
                        t = append(t, x)
                    else:
                        t[q] = t[q] + x
            first = False
        if r0 == 0.0 and r1 == 0.0:
            return [serial + (g if (g := gpu + (x + r2)) >= hidden else hidden) for x in t]
        return [serial + (g if (g := gpu + (x + r0 + r1 + r2)) >= hidden else hidden) for x in t]

    def _modern_layers_s(self, m: int) -> float:
        """GPU seconds of every layer's projections, MLP or experts, norms and all-reduces for ``m`` tokens
        (models with layer kinds, MoE or packed weights). MoE layers: active experts' FLOPs, and the
        weights of the expected distinct experts (``distinct_experts``), at the roofline; fp8 or MXFP4
        weights are read at their bytes there, and the other linear layers' at ``dense_weight_bytes`` (fp8
        checkpoints); the LM head and the router at the model dtype."""
        model, ops, tp, h = self.model, self.ops, self.tp, self.model.hidden_size
        elementwise = sum(ops.elementwise_s(op, m) * (2 if op == "add" else 1) for op in ops.elementwise)
        allreduce = 2 * ops.allreduce_s(m * h * model.dtype_bytes)
        total = 0.0
        wb = model.weight_bytes or model.dtype_bytes
        dw = model.dense_weight_bytes or None  # None: the model dtype (the formula as it was)

        def gemm(n: int, k: int):
            return ops.gemm_s(m, n, k, dw)

        counts: dict[tuple[str, bool], int] = {}  # layers of one kind and MLP cost the same: priced once
        for i, kind in enumerate(model.kinds):
            key = (kind if kind in ("mamba", "mla") else "attention", i in model.moe_layers)
            counts[key] = counts.get(key, 0) + 1
        for (kind, moe), count in counts.items():
            if kind == "mamba":
                d, r = model.mamba_d_inner // tp, model.mamba_dt_rank
                proj = gemm(2 * d, h) + gemm(r + 2 * model.mamba_d_state, d) + gemm(d, r) + gemm(h, d)
            elif kind == "mla":
                heads = model.num_heads // tp
                q = model.q_lora_rank or h
                proj = (gemm(model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim, h)
                        + gemm(heads * (model.qk_nope_head_dim + model.qk_rope_head_dim), q)
                        + gemm(heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank)
                        + gemm(h, heads * model.v_head_dim))
            else:
                proj = gemm(*ops.gemms["attn_pre_proj"]) + gemm(*ops.gemms["attn_post_proj"])
            if moe:
                f = model.moe_ffn_size // tp
                busy = distinct_experts(model.num_experts, model.num_experts_per_tok, m)
                compute = 2.0 * m * model.num_experts_per_tok * 3 * h * f / ops._matmul_flops
                memory = (busy * 3 * h * f * wb + 2 * m * model.num_experts_per_tok * h * model.dtype_bytes) / ops._bw
                mlp = max(compute, memory) + ops.gemm_s(m, model.num_experts, h)  # experts, and the router
                if model.num_shared_experts:  # each shared_expert_ffn_size wide (Qwen2-MoE), else as a routed one
                    fs = model.num_shared_experts * (model.shared_ffn_size // tp)
                    mlp += gemm(2 * fs, h) + gemm(h, fs)
            else:
                mlp = gemm(*ops.gemms["mlp_up_proj"]) + gemm(*ops.gemms["mlp_down_proj"])
            total += count * (proj + mlp)
        return float(total + self._num_layers * (elementwise + allreduce))

    def _fixed_parts(self, num_tokens: int, num_seqs: int, num_sampled: int) -> tuple[float, float, float]:
        """(GPU seconds of everything but attention, serial host seconds, overlapped host seconds): they
        depend on the token, sequence and sample counts only, so they are cached."""
        key = (num_tokens, num_seqs, num_sampled)
        got = self._fixed.get(key)
        if got is None:
            gpu = self._layers.get(num_tokens)  # the costly part depends on the tokens only
            if gpu is None:
                if self.model.modern:
                    gpu = self._modern_layers_s(num_tokens)
                else:
                    layer = self.ops.layer_s(num_tokens)
                    gpu = self._num_layers * (layer["linear"] + layer["elementwise"] + layer["allreduce"])
                self._layers[num_tokens] = gpu
            gpu += self.ops.lm_head_s(num_sampled) + self.cfg.gpu_overhead_s
            e = self.engine
            serial = e.serial_step_s + e.serial_per_seq_s * num_seqs + e.serial_per_token_s * num_sampled
            hidden = e.overlapped_step_s + e.overlapped_per_seq_s * num_seqs + e.overlapped_per_token_s * num_sampled
            got = self._fixed[key] = (float(gpu), serial, hidden)
            if len(self._fixed) > 65536:  # bounded: prefill steps of many sizes
                self._fixed.clear()
                self._layers.clear()
        return got

    def decode_key_terms(self, block_size: int) -> tuple[float, float]:
        """(seconds per key read, seconds per decoding sequence) of decode attention at this block size.

        A paged kernel reads whole blocks: a sequence of L keys visits ceil(L / b) blocks, reads the
        padding of the last one, and pays ``paged_block_cost_tokens`` keys' worth per block visited.
        Over uniformly spread last-block fills, E[ceil(L / b)] = L / b + (b - 1) / (2b) and the mean
        padding is (b - 1) / 2 keys, so the cost stays linear in the keys (the closed form holds):

            per key:      key_s * (1 + beta / b)
            per sequence: key_s * (b - 1) / 2 * (1 + beta / b)
        """
        got = self._paged_terms.get(block_size)
        if got is None:
            if self.paged:
                f = 1.0 + self.cfg.paged_block_cost_tokens / block_size
                got = (self._key_s * f, self._key_s * (block_size - 1) / 2 * f)
            else:
                got = (self._key_s, 0.0)
            self._paged_terms[block_size] = got
        return got

    def swap_s(self, num_blocks: int, block_size: int) -> float:
        if not num_blocks:
            return 0.0
        return (num_blocks * block_size * self._kv_bytes_per_token / self._host
                + num_blocks * self._block_copies * self.cfg.swap_copy_overhead_s)

    def load_s(self, num_blocks: int, block_size: int) -> float:
        """CPU-tier prefix-cache loads (``sim/offload.py``): the bytes over the host link, as one batched
        copy per layer for K and for V (offloading connectors move a step's blocks together), where a
        swap pays a copy per block."""
        return (num_blocks * block_size * self._kv_bytes_per_token / self._host
                + self._block_copies * self.cfg.swap_copy_overhead_s)

    def copy_s(self, plan: StepPlan) -> float:
        """Forks and copy-on-write: each copied slot read and written once in HBM, one launch."""
        slots = len(plan.copy_blocks) * plan.block_size + sum(n for _, _, n in plan.copy_slots)
        return 2 * slots * self._kv_bytes_per_token / self._bw + self.cfg.swap_copy_overhead_s if slots else 0.0

    def _step_s(self, fixed: tuple[float, float, float], attention_s: float) -> float:
        # NOTE: the one place GPU and host combine; step_time_s and decode_span_s both end here
        gpu, serial, hidden = fixed
        g = gpu + attention_s
        return serial + (g if g >= hidden else hidden)

    def step_time_s(self, plan: StepPlan) -> float:
        fixed = self._fixed_parts(plan.num_tokens, plan.num_seqs, plan.num_sampled)
        per_key, per_seq = self.decode_key_terms(plan.block_size)
        if self._groups is not None:
            attn = self._groups_attention_s(plan) + plan.num_decode_tokens * per_seq
        else:
            attn = plan.prefill_attention_pairs * self._pair_s
            if plan.num_decode_tokens:
                attn += plan.decode_context_tokens * per_key + plan.num_decode_tokens * per_seq
        t = self._step_s(fixed, attn)
        if plan.copy_blocks or plan.copy_slots:
            t += self.copy_s(plan)
        if plan.host_loads:
            t += self.load_s(len(plan.host_loads), plan.block_size)
        return t + self.swap_s(len(plan.swap_in) + len(plan.swap_out), plan.block_size)

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float] | None:
        # NOTE: the same float operations as step_time_s, so a span reproduces stepping exactly
        if self._groups is not None:
            return self._groups_span_s(plan, k)
        n = plan.num_seqs
        fixed = self._fixed_parts(n, n, n)
        per_key, per_seq = self.decode_key_terms(plan.block_size)
        keys, seq_s = plan.decode_context_tokens, n * per_seq
        return [self._step_s(fixed, (keys + n * j) * per_key + seq_s) for j in range(k)]

    def breakdown(self, num_tokens: int, context_tokens: int = 0, block_size: int = 16) -> dict[str, float]:
        """Milliseconds of a prefill step of ``num_tokens`` new tokens of one sequence over
        ``context_tokens`` cached ones, by part (``sim steptime``): per layer ``linear_ms``,
        ``elementwise_ms``, ``attention_ms``, ``allreduce_ms`` and ``layer_ms``; for the whole step
        ``gpu_ms`` (all layers, LM head, GPU overhead), ``host_ms`` (serial + overlapped host work) and
        ``step_ms`` (what the simulator charges)."""
        n, c = num_tokens, context_tokens
        layer = self.ops.layer_s(n)
        per_key, per_seq = self.decode_key_terms(block_size)
        if self._groups is not None:  # several KV groups: each group's keys or pairs, as step_time_s prices them
            attn = per_seq + self._mamba_seq_s if n == 1 else n * self._mamba_token_s  # (a Mamba state: decodes)
            for kind, window, key_s, pair_s in self._groups:
                if n == 1:
                    attn += self._keys(kind, window, c) * key_s * (per_key / self._key_s)
                else:
                    attn += sum(self._keys(kind, window, q) for q in range(c, c + n)) * pair_s
        elif n == 1:
            attn = (c + 1) * per_key + per_seq
        else:
            attn = (n * c + n * (n + 1) // 2) * self._pair_s
        fixed = self._fixed_parts(n, 1, 1)
        ms = {"linear_ms": layer["linear"], "elementwise_ms": layer["elementwise"],
              "attention_ms": attn / self._num_layers, "allreduce_ms": layer["allreduce"]}
        ms["layer_ms"] = sum(ms.values())
        ms = {k: float(v) * 1e3 for k, v in ms.items()}
        ms["gpu_ms"] = (fixed[0] + attn) * 1e3
        ms["host_ms"] = (fixed[1] + fixed[2]) * 1e3
        ms["step_ms"] = self._step_s(fixed, attn) * 1e3
        return ms


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


def measured_gpu(device: str) -> str | None:
    """The catalog GPU a profile's ``provenance.device`` names (``torch.cuda.get_device_name``: "NVIDIA
    A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"): the one whose name's parts are all words of it; None when
    none is (a CPU, a test device, an unlisted GPU)."""
    words = set(re.split(r"[^a-z0-9]+", device.lower()))
    found = [g for g in GPUS if set(g.split("-")) <= words]
    return found[0] if len(found) == 1 else None


def load_profile(path: str | Path, model: ModelSpec | None = None, gpu: str | None = None,
                 kv_cache_dtype: str = "auto") -> dict:
    """Read a profile written by ``sim calibrate``; when ``model`` is given it must be the profiled shape, and
    when ``gpu`` is a catalog GPU's name, the profile must not have been measured on another catalog GPU. A
    profile's KV cache is in the model's dtype (``sim calibrate`` stores it so): fp8 KV is not its to price."""
    path = Path(path)
    prof = read_json(path, "step-time profile", ScenarioError, " (write one with sim calibrate)")
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT:
        raise ScenarioError(f"{path}: not a step-time profile (expected format {PROFILE_FORMAT!r})")

    def number(v) -> bool:  # a finite number >= 0 (not true/false)
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    def mapping(v, key: str) -> dict:
        if not isinstance(v, dict):
            raise ScenarioError(f"{path}: {key}: expected a mapping, got {type(v).__name__}")
        return v

    if "terms" in prof and prof["terms"] != list(PROFILE_TERMS):  # (another step-time model's profile was read)
        raise ScenarioError(f"{path}: terms: {prof['terms']!r:.80}; this step-time model's are {list(PROFILE_TERMS)}")
    layouts = mapping(prof.get("layouts"), "layouts")
    for layout in ("paged", "contiguous"):
        coef = mapping(mapping(layouts.get(layout), f"layouts.{layout}").get("coefficients"),
                       f"layouts.{layout}.coefficients")
        unknown = sorted(str(t) for t in coef if t not in PROFILE_TERMS)
        if unknown:  # (a term the model does not have was ignored: its cost left out of every step)
            raise ScenarioError(f"{path}: layouts.{layout}.coefficients: unknown term {unknown[0]!r}; the profile's "
                                f"terms are {', '.join(PROFILE_TERMS)}")
        bad = [t for t in PROFILE_TERMS if not number(coef.get(t))]
        if bad:
            raise ScenarioError(f"{path}: layouts.{layout}.coefficients: {', '.join(bad)}: expected a finite number "
                                f">= 0 of seconds (got {', '.join(repr(coef.get(t)) for t in bad)})")
        huge = [t for t in PROFILE_TERMS if coef[t] > MAX_COST_S]  # (1e300 s: steps past any horizon)
        if huge:
            raise ScenarioError(f"{path}: layouts.{layout}.coefficients: {', '.join(huge)}: more than "
                                f"{MAX_COST_S:,.0f} s per unit (got {', '.join(repr(coef[t]) for t in huge)})")
        for part in ("prefill", "decode"):  # (a step of no time: the engine divided by it)
            terms = [t for t in PROFILE_TERMS if t.startswith(part)]
            if not any(coef[t] > 0 for t in terms):
                raise ScenarioError(f"{path}: layouts.{layout}.coefficients: {', '.join(terms)} are all 0: a "
                                    f"{part} step would take no time")
    # (bounded as the coefficients are: a swap_block_s of 1e300 ran, its steps past any horizon)
    for key, what, most in (("swap_block_s", "seconds", MAX_COST_S),
                            ("paged_block_cost_tokens", "tokens", MAX_BLOCK_SIZE)):
        if key in prof and not (number(prof[key]) and prof[key] <= most):
            raise ScenarioError(f"{path}: {key}: expected a finite number of {what} from 0 to {most:,.0f} "
                                f"(got {prof[key]!r})")
    b = prof.get("block_size")
    if b is not None and (not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= MAX_BLOCK_SIZE):
        raise ScenarioError(f"{path}: block_size: expected a whole number of tokens from 1 to {MAX_BLOCK_SIZE:,} "
                            f"(got {b!r})")
    if model is not None:
        if "model" not in prof:  # (was "profiled model None is not ...")
            raise ScenarioError(f"{path}: model: missing (the profiled model's shape, as sim calibrate writes it)")
        want, got = profile_model(model), mapping(prof["model"], "model")
        diff = [k for k in PROFILE_MODEL_KEYS if got.get(k) != want[k]]
        if diff:  # (the model priced: a scenario's, or sim steptime's MODEL)
            shown = ", ".join(f"{k} {got.get(k)} vs {want[k]}" for k in diff)
            raise ScenarioError(f"{path}: profiled model {got.get('name')!r} is not the model priced, {model.name!r} "
                                f"({shown}); calibrate this model")
    if kv_cache_dtype != "auto" and prof.get("kv_cache_dtype", "auto") != kv_cache_dtype:  # (priced as bf16's)
        raise ScenarioError(f"{path}: measured with the KV cache in the model's dtype ({prof.get('dtype')}), and this "
                            f"policy stores it as {kv_cache_dtype} (kv_cache_dtype), whose attention reads fewer "
                            f"bytes: use the roofline (step_time: {{kind: roofline}}) for it")
    device = (prof.get("provenance") or {}).get("device") if isinstance(prof.get("provenance"), dict) else None
    on = measured_gpu(device) if isinstance(device, str) else None
    if gpu in GPUS and on is not None and on != gpu:  # (an inline GPU: its own name, which no device records)
        raise ScenarioError(f"{path}: measured on {device!r} ({on}), and this run's GPU is {gpu}: its step times "
                            f"are {on}'s; calibrate on {gpu}, or use the roofline (step_time: {{kind: roofline}})")
    return prof


class ProfileStepTime:
    """Step time from a calibration profile: ``coefficients`` (PROFILE_TERMS, in seconds per unit) dotted
    with ``profile_features``, plus ``swap_block_s`` per block copied to or from the host."""

    def __init__(self, coefficients: dict[str, float], swap_block_s: float = 0.0, block_size: int | None = None,
                 block_cost_tokens: float = 0.0) -> None:
        self.coef = np.array([float(coefficients[t]) for t in PROFILE_TERMS])
        self.swap_block_s = float(swap_block_s)
        # NOTE: a paged profile is measured at one block size; at another, the per-key decode cost scales
        # by (1 + beta / b) / (1 + beta / b0) with the measured block cost beta (RooflineStepTime's model)
        self.block_size, self.block_cost_tokens = block_size, float(block_cost_tokens)
        self._by_block: dict[int, np.ndarray] = {}

    @classmethod
    def from_profile(cls, profile: dict, paged: bool) -> "ProfileStepTime":
        layout = profile["layouts"]["paged" if paged else "contiguous"]
        return cls(layout["coefficients"], profile.get("swap_block_s", 0.0),
                   profile.get("block_size") if paged else None,
                   profile.get("paged_block_cost_tokens", 0.0) if paged else 0.0)

    def _coef(self, block_size: int) -> np.ndarray:
        if self.block_size is None or not self.block_cost_tokens or block_size == self.block_size:
            return self.coef
        got = self._by_block.get(block_size)
        if got is None:
            got = self.coef.copy()
            beta = self.block_cost_tokens
            got[PROFILE_TERMS.index("decode_key_s")] *= (1 + beta / block_size) / (1 + beta / self.block_size)
            self._by_block[block_size] = got
        return got

    def predict(self, num_prefill_tokens, prefill_attention_pairs, num_decode_tokens, decode_context_tokens,
                num_swap_blocks=0, block_size: int | None = None):
        """Seconds of steps given by their terms (scalars or arrays)."""
        x = profile_features(num_prefill_tokens, prefill_attention_pairs, num_decode_tokens, decode_context_tokens)
        coef = self.coef if block_size is None else self._coef(block_size)
        return x @ coef + self.swap_block_s * np.asarray(num_swap_blocks, dtype=np.float64)

    def step_time_s(self, plan: StepPlan) -> float:
        return float(self.predict(plan.num_prefill_tokens, plan.prefill_attention_pairs, plan.num_decode_tokens,
                                  plan.decode_context_tokens, plan.host_link_blocks, plan.block_size))

    def decode_span_s(self, plan: StepPlan, k: int) -> list[float]:
        n = plan.num_seqs
        keys = plan.decode_context_tokens + n * np.arange(k, dtype=np.float64)
        return self.predict(0, 0, n, keys, 0, plan.block_size).tolist()


# ---------------------------------------------------------------------------------------------- tables

STEPTIME_COLUMNS = ("tokens", "linear_ms", "elementwise_ms", "attention_ms", "allreduce_ms", "layer_ms", "gpu_ms",
                    "host_ms", "step_ms")


def load_step_time(path: str | Path):
    """A ``step_time`` block from a file: a calibration profile (JSON), or YAML holding a scenario's
    ``step_time`` block (a whole scenario, or the block alone); None for a scenario without one (the
    roofline's defaults)."""
    from pydantic import ValidationError

    from sim.config import ProfileConfig, StepTimeAdapter, read_yaml

    path = Path(path)
    if path.suffix == ".json":
        return ProfileConfig(kind="profile", path=str(path))
    doc, _ = read_yaml(path, "step_time")
    if isinstance(doc, dict) and ({"base", "axes", "zip", "traffic", "search"} & doc.keys()):
        raise ScenarioError(f"{path}: a sweep or a plan, not a scenario: give a scenario (its step_time block), "
                            "the block alone, or a calibration profile (.json)")
    if isinstance(doc, dict) and "step_time" in doc:
        doc = doc["step_time"]
    elif isinstance(doc, dict) and {"model", "workload", "policies"} & doc.keys():
        return None  # a whole scenario without a step_time block: the roofline's defaults, as its runs use
    if not isinstance(doc, dict):
        raise ScenarioError(f"{path}: expected a step_time block (kind: roofline | profile, ...)")
    doc.setdefault("kind", "roofline")
    try:
        cfg = StepTimeAdapter.validate_python(doc)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ScenarioError(f"{path}: step_time.{where}: {first['msg']}") from None
    if isinstance(cfg, ProfileConfig) and not Path(cfg.path).is_absolute():
        cfg = ProfileConfig(kind="profile", path=str(path.parent / cfg.path))
    return cfg


def steptime_rows(model: ModelSpec, gpu: GpuSpec, tp: int, tokens: list[int], context: int = 0,
                  step_time=None, block_size: int = 16) -> list[dict]:
    """``sim steptime``: one row per token count (STEPTIME_COLUMNS). A calibration profile has no
    per-part breakdown: only ``step_ms`` (its parts are None)."""
    from sim.config import ProfileConfig

    cfg = RooflineConfig() if step_time is None else step_time  # type: ignore[call-arg]  # pydantic defaults
    rows = []
    if isinstance(cfg, ProfileConfig):
        if tp != 1:
            raise ScenarioError(f"step_time profiles are measured on one GPU; --tp must be 1, not {tp}")
        prof = ProfileStepTime.from_profile(load_profile(cfg.path, model, gpu.name), paged=True)
        for n in tokens:
            pairs = n * context + n * (n + 1) // 2
            t = prof.predict(n, pairs, 0, 0) if n > 1 else prof.predict(0, 0, 1, context + 1)
            rows.append({"tokens": n, **{c: None for c in STEPTIME_COLUMNS[1:-1]}, "step_ms": float(t) * 1e3})
        return rows
    layout = kv_layout(model, tp, block_size) if model.modern else None  # windows, chunks, MLA, Mamba as a run has them
    st = RooflineStepTime(model, gpu, tp, cfg, paged=True, layout=layout)
    return [{"tokens": n, **st.breakdown(n, context, block_size)} for n in tokens]


def decode_step_ms(model: ModelSpec, gpu: GpuSpec, tp: int, batch: int, context: int, cfg: RooflineConfig,
                   block_size: int = 16) -> dict[str, float]:
    """A decode step of ``batch`` sequences of ``context`` cached tokens each: GPU, host and step ms."""
    st = RooflineStepTime(model, gpu, tp, cfg, paged=True)
    plan = StepPlan(num_seqs=batch, num_tokens=batch, num_prefill_tokens=0, num_decode_tokens=batch,
                    num_sampled=batch, decode_context_tokens=batch * (context + 1), prefill_attention_pairs=0,
                    block_size=block_size, paged=True)
    gpu_s, serial, hidden = st._fixed_parts(batch, batch, batch)
    per_key, per_seq = st.decode_key_terms(block_size)
    attn = plan.decode_context_tokens * per_key + batch * per_seq
    return {"gpu_ms": (gpu_s + attn) * 1e3, "host_ms": (serial + hidden) * 1e3, "step_ms": st.step_time_s(plan) * 1e3}
