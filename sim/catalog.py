"""Model and GPU catalogs: the shapes and datasheet figures the simulator computes from.

Figures come from `../shared/docs/references.md` (models' published config.json, vendor datasheets).
A model can also be read from a Hugging Face ``config.json``; a GPU can be given inline in a scenario.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sim.userfile import read_json

GIB = 1024**3


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. Weights and KV cache in ``dtype_bytes`` (fp16/bf16 = 2)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool  # SwiGLU (three FFN matrices) vs ReLU/GELU (two)
    tie_embeddings: bool
    learned_positions: bool = False  # OPT has a learned position table of max_model_len rows
    dtype_bytes: int = 2
    # NOTE: 0 means hidden_size // num_heads; config.json may declare another (Mistral-Nemo: 128, not 160)
    head_dim: int = 0
    # Today's layouts (sim/layouts.py turns these into layer groups). Empty / 0: every layer full attention,
    # a dense MLP, weights in dtype_bytes -- the models above, whose figures do not change.
    layer_kinds: tuple[str, ...] = ()  # per layer: full | sliding | chunked | mla | mamba (LAYER_KINDS)
    sliding_window: int = 0  # W of sliding layers: a token attends to itself and the W - 1 before it
    attention_chunk_size: int = 0  # C of chunked-local layers: a token attends within its C-token chunk
    kv_lora_rank: int = 0  # MLA: one latent of kv_lora_rank + qk_rope_head_dim elements per token and layer
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0  # MLA's head_dim is qk_nope_head_dim + qk_rope_head_dim (a query's and key's width)
    v_head_dim: int = 0  # MLA: a value's width (0: head_dim, as in every other attention)
    q_lora_rank: int = 0
    mamba_d_inner: int = 0  # Mamba layers: a state of (d_conv - 1) * d_inner + d_inner * d_state per sequence
    mamba_d_state: int = 0
    mamba_d_conv: int = 0
    mamba_dt_rank: int = 0
    num_experts: int = 0  # MoE: routed experts, each a gated MLP of moe_ffn_size
    num_experts_per_tok: int = 0
    moe_ffn_size: int = 0
    num_shared_experts: int = 0
    shared_expert_ffn_size: int = 0  # width of each shared expert; 0 means moe_ffn_size (Qwen2-MoE's is wider)
    moe_layers: tuple[int, ...] = ()  # indices of the MoE layers (the others use the dense ffn_size MLP)
    weight_bytes: float = 0  # bytes per weight; 0 means dtype_bytes (fp8 checkpoints: 1, MXFP4: 4.25 bits)
    # bytes per weight of the linear layers outside the routed experts (attention projections, dense MLPs,
    # shared experts) as step time reads them; 0 means dtype_bytes. An fp8 checkpoint (DeepSeek-V3) stores
    # them at 1 byte too; MXFP4 (gpt-oss) packs only the experts. The LM head and the router stay at dtype_bytes.
    dense_weight_bytes: float = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def modern(self) -> bool:
        """Described by layer kinds, MoE or packed weights (else the classic formulas below apply as they were)."""
        return bool(self.layer_kinds or self.num_experts or self.weight_bytes or self.dense_weight_bytes)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_kinds or ("full",) * self.num_layers

    def kv_bytes_per_token_layer(self, kind: str, tp: int = 1, kv_dtype_bytes: int | None = None) -> int:
        """KV bytes one token holds in one layer of ``kind`` on one rank (0 for Mamba: a per-sequence state).
        MLA's latent is not split by heads: every rank holds all of it (as vLLM does)."""
        w = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        if kind == "mamba":
            return 0
        if kind == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * w
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim * w

    def mamba_state_bytes(self, tp: int = 1) -> int:
        """One Mamba layer's state for one sequence on one rank: the conv window and the SSM state
        (model dtype; vLLM's fp8 KV cache does not apply to it). d_inner splits over ranks."""
        d = self.mamba_d_inner // tp
        return ((self.mamba_d_conv - 1) * d + d * self.mamba_d_state) * self.dtype_bytes

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the per-layer matrices (QKV, output projection, MLP); norms and biases ignored."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_size
        return q + kv + o + mlp

    def layer_gemms(self, tp: int) -> dict[str, tuple[int, int]]:
        """(N, K) of each per-layer GEMM on one tensor-parallel rank; M is the token count. Column-parallel
        QKV and gate/up split N, row-parallel output and down projections split K; KV heads are
        replicated when there are fewer than ranks (as vLLM does)."""
        q = self.num_heads * self.head_dim // tp
        kv = 2 * self.kv_heads_per_gpu(tp) * self.head_dim
        ffn = self.ffn_size // tp
        return {"attn_pre_proj": (q + kv, self.hidden_size), "attn_post_proj": (self.hidden_size, q),
                "mlp_up_proj": ((2 if self.gated_mlp else 1) * ffn, self.hidden_size),
                "mlp_down_proj": (self.hidden_size, ffn)}

    def layer_elementwise_bytes(self, tp: int) -> dict[str, float]:
        """HBM bytes each elementwise op of a layer reads and writes per token, on one rank."""
        h, w = self.hidden_size, self.dtype_bytes
        heads = self.num_heads // tp + self.kv_heads_per_gpu(tp)  # rope rotates q and k in place
        ffn = self.ffn_size / tp
        return {"input_layernorm": 2 * h * w, "post_attention_layernorm": 2 * h * w,
                "attn_rope": 2 * heads * self.head_dim * w,
                "mlp_act": (3 if self.gated_mlp else 2) * ffn * w,  # gated: read gate and up, write one
                "add": 3 * h * w}

    def attention_params(self, kind: str) -> int:
        """One attention layer's projection weights (MLA: the low-rank q and kv paths; Mamba: its
        in/x/dt/out projections)."""
        h = self.hidden_size
        if kind == "mamba":
            d, r = self.mamba_d_inner, self.mamba_dt_rank
            return 2 * h * d + d * (r + 2 * self.mamba_d_state) + r * d + d * h
        if kind == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk if self.q_lora_rank else h * self.num_heads * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.num_heads * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.num_heads * self.v_head_dim * h
        return (self.hidden_size * self.num_heads * self.head_dim + 2 * self.hidden_size * self.num_kv_heads * self.head_dim
                + self.num_heads * self.head_dim * self.hidden_size)

    @property
    def shared_ffn_size(self) -> int:
        """Each shared expert's width: ``shared_expert_ffn_size``, else a routed expert's."""
        return self.shared_expert_ffn_size or self.moe_ffn_size

    def mlp_params(self, layer: int) -> int:
        """One layer's MLP: dense, or (MoE layers) every routed and shared expert plus the router."""
        h = self.hidden_size
        if layer in self.moe_layers:
            shared = self.num_shared_experts * 3 * h * self.shared_ffn_size
            return self.num_experts * 3 * h * self.moe_ffn_size + shared + h * self.num_experts
        return (3 if self.gated_mlp else 2) * h * self.ffn_size

    @property
    def weights_bytes_total(self) -> float:
        """All weights, every expert included (they all stay in GPU memory)."""
        return self.num_params * (self.weight_bytes or self.dtype_bytes)

    @property
    def embedding_params(self) -> int:
        """Token embedding, the LM head when not tied, and OPT's learned positions."""
        n = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        if self.learned_positions:
            n += self.max_model_len * self.hidden_size
        return n

    @property
    def num_params(self) -> int:
        if self.modern:
            return sum(self.attention_params(k) + self.mlp_params(i) for i, k in enumerate(self.kinds)) + self.embedding_params
        return self.num_layers * self.linear_params_per_layer + self.embedding_params

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each tensor-parallel rank stores; heads are replicated when there are fewer than ranks."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype_bytes: int | None = None) -> int:
        """K and V of one token over all layers (window layers counted as full), on one tensor-parallel rank."""
        if self.modern or kv_dtype_bytes is not None:
            return sum(self.kv_bytes_per_token_layer(k, tp, kv_dtype_bytes) for k in self.kinds)
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GemmFit:
    """A GEMM of M tokens, N outputs and K inputs on one rank (``sim/profiles.py`` fits these):

        launch + (t_c**p + t_m**p)**(1/p),   t_c = 2 R N K / (compute_efficiency * peak) * (1 + tile_tokens / R)
                                             t_m = bytes(A, B, C) / (bandwidth_efficiency * HBM bandwidth)

    R is M rounded up to a whole number of ``tile_rows`` once M exceeds it (a kernel computes whole tiles of
    rows: 129 tokens cost what 256 do at 128-row tiles; a shorter batch runs shorter tiles, so up to
    ``tile_rows`` R is M). ``tile_rows`` 1 rounds nothing: a smooth curve.
    """

    launch_s: float
    compute_efficiency: float
    bandwidth_efficiency: float
    sharpness: float  # p: 1 adds the two regimes, large p approaches max() (the datasheet roofline)
    tile_tokens: float  # rows of compute every GEMM adds (2 (R + tile_tokens) N K FLOPs): felt at small M
    tile_rows: int = 1  # compute priced on whole tiles of this many rows past one tile (1: not rounded)

    def time_s(self, m: float, n: int, k: int, gpu: "GpuSpec", dtype_bytes: int = 2,
               weight_bytes: float | None = None) -> float:
        """``weight_bytes``: the K x N weights' bytes per element when they are not ``dtype_bytes`` (fp8)."""
        t = self.tile_rows
        rows = m if t <= 1 else m + (m > t) * (-(-m // t) * t - m)  # (numbers or numpy arrays alike)
        tc = 2.0 * rows * n * k / (self.compute_efficiency * gpu.flops_per_s) * (1.0 + self.tile_tokens / rows)
        moved = dtype_bytes * (m * k + k * n + m * n) if weight_bytes is None else \
            dtype_bytes * (m * k + m * n) + weight_bytes * k * n
        tm = moved / (self.bandwidth_efficiency * gpu.hbm_bytes_per_s)
        p = self.sharpness
        return self.launch_s + (tc**p + tm**p) ** (1.0 / p)


@dataclass(frozen=True)
class ElementwiseFit:
    """An elementwise op (norm, rope, activation, residual add): launch + bytes / (efficiency * HBM)."""

    launch_s: float
    bandwidth_efficiency: float


@dataclass(frozen=True)
class AllReduceFit:
    """An all-reduce among one group of workers: (latency**p + (bytes / bus_bytes_per_s)**p)**(1/p)."""

    latency_s: float
    bus_bytes_per_s: float
    sharpness: float

    def time_s(self, nbytes: float) -> float:
        p = self.sharpness
        return (self.latency_s**p + (nbytes / self.bus_bytes_per_s) ** p) ** (1.0 / p)

    def time_array(self, nbytes):
        p = self.sharpness
        return (self.latency_s**p + (nbytes / self.bus_bytes_per_s) ** p) ** (1.0 / p)


@dataclass(frozen=True)
class OperatorFit:
    """Coefficients fitted to measured operator times on one GPU (see ``sim/profiles.py``)."""

    gemm: GemmFit
    elementwise: dict[str, ElementwiseFit]
    allreduce: dict[int, AllReduceFit] = field(default_factory=dict)  # by num_workers
    topology: str = ""  # the measured interconnect the all-reduce fits come from
    source: str = ""  # what was measured, and where

    def allreduce_s(self, nbytes: float, workers: int) -> float | None:
        """Seconds of one all-reduce, or None when this worker count was not measured."""
        fit = self.allreduce.get(workers)
        return None if fit is None else fit.time_s(nbytes)


# GPUs in one server: a tensor-parallel group of more spans servers, and its all-reduce crosses the network
SERVER_GPUS = 8


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet figures (dense bf16/fp16, no sparsity), and the operator coefficients fitted
    to measurements on it when there are any (else the datasheet roofline prices its ops)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    flops_per_s: float  # bf16/fp16 tensor-core peak
    host_bytes_per_s: float  # host link, one direction (swap traffic)
    interconnect_bytes_per_s: float  # GPU-GPU link, one direction (tensor-parallel all-reduce)
    operators: OperatorFit | None = None
    operators_note: str = "datasheet roofline: no measurements of this GPU"
    fp8: bool = False  # fp8 tensor cores and KV cache (Hopper, Ada): kv_cache_dtype fp8 needs it
    link_gpus: int = SERVER_GPUS  # GPUs the interconnect joins: an SXM server's NVLink domain; A40's bridge joins
    # pairs; 1: no GPU-GPU link (L4: PCIe only)

    def ring_link(self, tp: int) -> tuple[float, float | None, str]:
        """(bytes/s one way, latency in s or None for the step-time config's, what it is) of the slowest
        link a ring all-reduce among ``tp`` GPUs crosses: the interconnect while the ring fits its span
        (``link_gpus``), then PCIe (the host link) within one server of ``SERVER_GPUS``, then the network
        between servers (``LINKS["infiniband-400g"]``, 50 GB/s per GPU)."""
        if tp <= self.link_gpus:
            return self.interconnect_bytes_per_s, None, f"the GPU-GPU link, {self.interconnect_bytes_per_s / 1e9:g} GB/s"
        if tp <= SERVER_GPUS:
            why = "no GPU-GPU link" if self.link_gpus < 2 else f"the GPU-GPU link joins {self.link_gpus} GPUs"
            return self.host_bytes_per_s, None, f"PCIe, {self.host_bytes_per_s / 1e9:g} GB/s ({why})"
        net = LINKS["infiniband-400g"]
        return (net.bytes_per_s, net.latency_s, f"infiniband-400g between servers, {net.bytes_per_s / 1e9:g} GB/s "
                f"(a group over {SERVER_GPUS} GPUs spans servers)")



def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 50272, 2048,
                     gated_mlp=False, tie_embeddings=True, learned_positions=True)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _opt("opt-13b", 40, 5120, 40),
        _opt("opt-66b", 64, 9216, 72),
        _opt("opt-175b", 96, 12288, 96),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, True, False),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, True, False),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, True, False),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, True, False),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, True, False),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, True, False),
        # Today's layouts (issue 16). Shapes from each model's config.json on Hugging Face (repo in the comment).
        # google/gemma-3-27b-it (text_config): sliding_window 1024, sliding_window_pattern 6 (every 6th layer full)
        ModelSpec("gemma-3-27b", 62, 5376, 32, 16, 21504, 262208, 131072, True, True, head_dim=128,
                  layer_kinds=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(62)), sliding_window=1024),
        # openai/gpt-oss-120b: layer_types alternate sliding (128) / full; 128 experts, 4 per token; MoE weights
        # in MXFP4: the 65 GB checkpoint over its 117 B parameters is 0.56 bytes a weight
        ModelSpec("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 131072, True, False, head_dim=64,
                  layer_kinds=tuple("sliding" if i % 2 == 0 else "full" for i in range(36)), sliding_window=128,
                  num_experts=128, num_experts_per_tok=4, moe_ffn_size=2880, moe_layers=tuple(range(36)),
                  weight_bytes=0.56),
        # meta-llama/Llama-4-Scout-17B-16E-Instruct (text_config): attention_chunk_size 8192 on the RoPE layers,
        # every 4th layer global (no_rope_layers); 16 experts, 1 per token, plus a shared expert, in every layer
        ModelSpec("llama-4-scout", 48, 5120, 40, 8, 16384, 202048, 10485760, True, False, head_dim=128,
                  layer_kinds=tuple("full" if (i + 1) % 4 == 0 else "chunked" for i in range(48)),
                  attention_chunk_size=8192, num_experts=16, num_experts_per_tok=1, moe_ffn_size=8192,
                  num_shared_experts=1, moe_layers=tuple(range(48))),
        # deepseek-ai/DeepSeek-V3: MLA (kv_lora_rank 512 + qk_rope_head_dim 64), 256 routed experts, 8 per token,
        # 1 shared, first_k_dense_replace 3; fp8 weights (quantization_config fp8 e4m3). The MTP layer is not served.
        ModelSpec("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 163840, True, False, head_dim=192,
                  layer_kinds=("mla",) * 61, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128, q_lora_rank=1536, num_experts=256, num_experts_per_tok=8, moe_ffn_size=2048,
                  num_shared_experts=1, moe_layers=tuple(range(3, 61)), weight_bytes=1, dense_weight_bytes=1),
        # ai21labs/Jamba-v0.1: attention every 8th layer (attn_layer_period 8, offset 4), Mamba elsewhere
        # (d_state 16, d_conv 4, expand 2, dt_rank 256); 16 experts, 2 per token, in every other layer
        ModelSpec("jamba-v0.1", 32, 4096, 32, 8, 14336, 65536, 262144, True, False, head_dim=128,
                  layer_kinds=tuple("full" if i % 8 == 4 else "mamba" for i in range(32)), mamba_d_inner=8192,
                  mamba_d_state=16, mamba_d_conv=4, mamba_dt_rank=256, num_experts=16, num_experts_per_tok=2,
                  moe_ffn_size=14336, moe_layers=tuple(range(1, 32, 2))),
    ]
}

# Operator coefficients fitted to Vidur's measured profiles (``sim profiles fit ../shared/profiles/vidur``
# regenerates these literals; ``sim profiles validate`` gives their leave-one-model-out error). The
# efficiencies are fractions of each GPU's own datasheet peak, so a GPU with the same chip and another
# memory (A100 40GB, H200) uses its sibling's coefficients with its own datasheet figures.
A100_FIT = OperatorFit(
    gemm=GemmFit(launch_s=8.495e-06, compute_efficiency=0.735, bandwidth_efficiency=0.7969, sharpness=2.803, tile_tokens=1.409e-09, tile_rows=128),
    elementwise={
        'input_layernorm': ElementwiseFit(4.217e-06, 0.4157),
        'attn_rope': ElementwiseFit(2.871e-06, 0.473),
        'post_attention_layernorm': ElementwiseFit(4.236e-06, 0.3908),
        'mlp_act': ElementwiseFit(3.371e-06, 0.5272),
        'add': ElementwiseFit(1.802e-06, 0.9689),
    },
    allreduce={2: AllReduceFit(4.42e-05, 170300000000.0, 1.0), 4: AllReduceFit(3.795e-05, 106400000000.0, 1.0), 8: AllReduceFit(4.333e-05, 86610000000.0, 1.0)},
    topology='a100_dgx',
    source='Vidur profiles @7d47513363ec: a100, CodeLlama-34b-Instruct-hf, Llama-2-70b-hf, Qwen-72B, phi-2; all-reduce a100_dgx',
)
A40_FIT = OperatorFit(
    gemm=GemmFit(launch_s=5.753e-06, compute_efficiency=0.7721, bandwidth_efficiency=0.8007, sharpness=1.901, tile_tokens=1.353e-09, tile_rows=64),
    elementwise={
        'input_layernorm': ElementwiseFit(3.538e-06, 0.642),
        'attn_rope': ElementwiseFit(1.636e-06, 0.8278),
        'post_attention_layernorm': ElementwiseFit(3.881e-06, 0.6294),
        'mlp_act': ElementwiseFit(2.187e-06, 0.8078),
        'add': ElementwiseFit(7.682e-07, 0.8472),
    },
    allreduce={},
    topology='',
    source='Vidur profiles @7d47513363ec: a40, CodeLlama-34b-Instruct-hf, Llama-2-70b-hf, Qwen-72B, phi-2',
)
H100_FIT = OperatorFit(
    gemm=GemmFit(launch_s=7.168e-06, compute_efficiency=0.7408, bandwidth_efficiency=0.9235, sharpness=10.87, tile_tokens=91.74, tile_rows=128),
    elementwise={
        'input_layernorm': ElementwiseFit(3.52e-06, 0.451),
        'attn_rope': ElementwiseFit(2.219e-06, 0.5157),
        'post_attention_layernorm': ElementwiseFit(3.469e-06, 0.4121),
        'mlp_act': ElementwiseFit(2.543e-06, 0.615),
        'add': ElementwiseFit(1.462e-06, 1.094),
    },
    allreduce={2: AllReduceFit(2.994e-05, 280400000000.0, 1.422), 4: AllReduceFit(3.827e-05, 212800000000.0, 1.601), 8: AllReduceFit(2.973e-05, 195100000000.0, 1.0)},
    topology='h100_dgx',
    source='Vidur profiles @7d47513363ec: h100, CodeLlama-34b-Instruct-hf, Llama-2-70b-hf, Qwen-72B, phi-2; all-reduce h100_dgx',
)


# NOTE: datasheet memory sizes are read as GiB (an "A100 40GB" has 40 GiB of HBM); the driver keeps a
# little of it, which the scenario's `runtime_overhead_gib` stands for.
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40gb", 40 * GIB, 1555e9, 312e12, 32e9, 300e9, A100_FIT,
                "fitted on A100 80GB SXM (same GA100 chip), at this GPU's bandwidth"),
        GpuSpec("a100-80gb", 80 * GIB, 2039e9, 312e12, 32e9, 300e9, A100_FIT, "fitted on A100 80GB SXM"),
        GpuSpec("h100", 80 * GIB, 3350e9, 989e12, 64e9, 450e9, H100_FIT, "fitted on H100 80GB SXM", fp8=True),
        GpuSpec("h200", 141 * GIB, 4800e9, 989e12, 64e9, 450e9, H100_FIT,
                "fitted on H100 80GB SXM (same GH100 chip), at this GPU's bandwidth", fp8=True),
        GpuSpec("l4", 24 * GIB, 300e9, 121e12, 32e9, 32e9, fp8=True, link_gpus=1),  # PCIe only
        # A40 48GB: GDDR6 696 GB/s, 149.7 dense fp16/bf16 tensor TFLOP/s, PCIe 4.0 x16, NVLink bridge
        # 112.5 GB/s in both directions for a pair
        GpuSpec("a40", 48 * GIB, 696e9, 149.7e12, 32e9, 56.25e9, A40_FIT,
                "fitted on A40 48GB; all-reduce from the datasheet (no A40 network profile)", link_gpus=2),
    ]
}


# On-demand list prices in $/GPU-hour, for `sim plan` (a plan's `prices:` overrides them): AWS EC2 on-demand,
# us-east-1, Linux, as listed in 2024 (not re-checked here), the 8-GPU instance's hourly price divided by 8 --
# p4d.24xlarge (8x A100 40GB) $32.77, p4de.24xlarge (8x A100 80GB) $40.97, p5.48xlarge (8x H100 80GB) $98.32; https://aws.amazon.com/ec2/pricing/on-demand/
# (AWS cut the P4/P5 prices in June 2025, and other clouds charge less: give your own in the plan). The
# other catalog GPUs have no default: a plan that uses one must price it.
GPU_PRICES: dict[str, float] = {"a100-40gb": 32.77 / 8, "a100-80gb": 40.97 / 8, "h100": 98.32 / 8}


@dataclass(frozen=True)
class LinkSpec:
    """A KV-transfer link of prefill/decode disaggregation (``cluster.kv_transfer``): one direction."""

    name: str
    bytes_per_s: float
    latency_s: float


# KV-transfer links, one direction, decimal GB (1e9 bytes):
# - nvlink: NVLink 4 (H100 SXM) is 900 GB/s per GPU in both directions together, 450 GB/s one way
#   (NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/);
# - infiniband-400g: InfiniBand NDR, 400 Gb/s per port = 50 GB/s (NVIDIA ConnectX-7 / Quantum-2 NDR);
# - pcie-gen5: PCIe 5.0 x16, 32 GT/s x 16 lanes with 128b/130b coding, about 63 GB/s one way (64 as usually
#   quoted; PCI-SIG PCIe 5.0 specification).
# The latencies are our order-of-magnitude choices for starting one transfer (a few microseconds on the
# wire, more in a connector's software), not measurements: give {gb_per_s, latency_ms} for your own.
LINKS: dict[str, LinkSpec] = {
    k.name: k
    for k in [
        LinkSpec("nvlink", 450e9, 10e-6),
        LinkSpec("infiniband-400g", 50e9, 20e-6),
        LinkSpec("pcie-gen5", 64e9, 10e-6),
    ]
}


class CatalogError(ValueError):
    """A model or GPU name or file the catalog cannot resolve."""


def _did_you_mean(name: str, names) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(names), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def resolve_model(name: str, base: Path = Path(".")) -> ModelSpec:
    """A catalog model by name, or a Hugging Face config.json (a file, or a folder holding one)."""
    if name in MODELS:
        return MODELS[name]
    p = Path(name).expanduser()
    p = p if p.is_absolute() else base / p
    if p.is_dir():
        if not (p / "config.json").is_file():  # (was the catalog's list, "or a path to a config.json")
            raise CatalogError(f"{p}: a folder without a config.json (a Hugging Face model's folder holds one)")
        p = p / "config.json"
    if name.endswith(".json") or p.exists():
        return model_from_hf_config(p)
    raise CatalogError(f"unknown model {name!r}{_did_you_mean(name, MODELS)} (expected one of {', '.join(MODELS)} "
                       f"or a path to a config.json)")


def resolve_gpu(name: str) -> GpuSpec:
    if name in GPUS:
        return GPUS[name]
    raise CatalogError(f"unknown gpu {name!r}{_did_you_mean(name, GPUS)} (expected one of {', '.join(GPUS)})")


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama/Mistral/Qwen-style or OPT-style)."""
    path = Path(path)
    cfg = read_json(path, "model config file", CatalogError)
    if not isinstance(cfg, dict):
        raise CatalogError(f"{path}: expected a JSON object")

    def need(*keys: str) -> int:
        for k in keys:
            if k in cfg:
                v = cfg[k]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise CatalogError(f"{path}: '{k}' must be a positive integer, got {v!r}")
                most = MAX_LAYERS if k == "num_hidden_layers" else MAX_CONFIG_INT
                if v > most:
                    raise CatalogError(f"{path}: '{k}' must be at most {most:,}, got {_count(v)}")
                return v
        raise CatalogError(f"{path}: missing '{keys[0]}'")

    if isinstance(cfg.get("text_config"), dict):  # multimodal configs (Gemma 3, Llama 4): the language model's
        cfg = {**cfg, **cfg["text_config"]}
    # Hugging Face omits the fields at its config class's defaults (google/gemma-3-27b-it lists no vocab_size,
    # max_position_embeddings or sliding_window_pattern): read them as transformers would
    cfg = {**_HF_DEFAULTS.get(str(cfg.get("model_type")), {}), **cfg}
    is_opt = cfg.get("model_type") == "opt" or "ffn_dim" in cfg
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    # NOTE: head_dim when declared (Mistral-Nemo: 128 with hidden 5120 / 32 heads = 160); null means the default.
    # MLA (DeepSeek-V2/V3): a query's and key's width, qk_nope_head_dim + qk_rope_head_dim (128 + 64); a head_dim
    # there is transformers' rotary width (qk_rope_head_dim), not the head's
    if cfg.get("kv_lora_rank") is not None:
        head_dim = need("qk_nope_head_dim") + need("qk_rope_head_dim")
    elif cfg.get("head_dim") is not None:
        head_dim = need("head_dim")
    elif hidden % heads:
        raise CatalogError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                           f"(and no head_dim is declared)")
    else:
        head_dim = hidden // heads
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in cfg else heads
    if heads % kv_heads:
        raise CatalogError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    max_len = need("max_position_embeddings")
    if max_len < 2:  # a prompt token and an output token at least (truncation keeps max_len - 1 of a prompt)
        raise CatalogError(f"{path}: 'max_position_embeddings' must be at least 2, got {max_len}")
    if max_len > MAX_TOKENS:  # token counts are 32-bit
        raise CatalogError(f"{path}: 'max_position_embeddings' must be at most {MAX_TOKENS:,}, got {max_len:,}")
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):  # ("no" would read as true)
        raise CatalogError(f"{path}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    layout = _hf_layout(path, cfg, need, hidden)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or path.parent.name or path.stem),
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        # Llama 4: intermediate_size is the experts' width, intermediate_size_mlp the dense layers'
        ffn_size=need("ffn_dim", "intermediate_size_mlp", "intermediate_size"),
        vocab_size=need("vocab_size"),
        max_model_len=max_len,
        gated_mlp=not is_opt,  # Llama-family configs use a gated (SwiGLU-style) MLP; OPT a plain one
        tie_embeddings=is_opt if tie is None else tie,
        learned_positions=is_opt,
        head_dim=head_dim,
        **layout,
    )


# Token counts are 32-bit (int32 kernels' offsets): a model's length, a request's, a trace's, a batch's. Declared
# here, the lowest layer; sim.config, traces/ and the command line read it from here.
MAX_TOKENS = 2**31 - 1
# NOTE: a config.json's sizes and counts (heads, widths, vocabulary, experts) are at most int32's largest: 2**1100
# overflowed a float (OverflowError); layers at most MAX_LAYERS, 32 times Llama 3.1 405B's 126: state is kept per
# layer (2**27 layers took 1.1 GB, 2**40 a MemoryError, 2**63 an OverflowError)
MAX_CONFIG_INT = MAX_TOKENS
MAX_LAYERS = 4096


def _count(v: int) -> str:
    """A config.json's number for a message: 1,099,511,627,776, or a 332-digit number (its digits in full made a
    line of 400 characters)."""
    return f"{v:,}" if v < 10**24 else f"a {len(str(v)):,}-digit number"


def _whole(path: Path, cfg: dict, key: str, default: int = 0) -> int:
    """An optional count or offset of a config.json: a whole number >= 0 (null or absent: ``default``)."""
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CatalogError(f"{path}: '{key}' must be a whole number (0 or more), got {v!r}")
    if v > MAX_CONFIG_INT:
        raise CatalogError(f"{path}: '{key}' must be at most {MAX_CONFIG_INT:,}, got {_count(v)}")
    return v


LAYER_KINDS = ("full", "sliding", "chunked", "mla", "mamba")
# transformers' defaults of the fields that set a shape, by model_type, for config.json files that omit them
# (Gemma3TextConfig, Gemma2Config: every sliding_window_pattern-th layer full attention, the others sliding)
_GEMMA3 = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
           "tie_word_embeddings": True, "sliding_window": 4096, "sliding_window_pattern": 6}
_HF_DEFAULTS = {"gemma3_text": _GEMMA3, "gemma3": _GEMMA3,
                "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                           "max_position_embeddings": 8192, "tie_word_embeddings": True, "sliding_window": 4096,
                           "sliding_window_pattern": 2}}
# model types whose layers mix sliding and full attention: a window without layer_types or a pattern is an error
_MIXED_WINDOWS = ("gemma2", "gemma3", "gemma3_text", "cohere2", "gpt_oss")
# config.json's names for a layer's kind (layer_types, Jamba's layers_block_type)
_HF_KINDS = {"full_attention": "full", "attention": "full", "global_attention": "full",
             "sliding_attention": "sliding", "chunked_attention": "chunked", "mamba": "mamba"}


def _hf_layout(path: Path, cfg: dict, need, hidden: int) -> dict:
    """The ModelSpec fields of today's layouts from a config.json: layer kinds (``layer_types``,
    ``sliding_window_pattern``, Llama 4's ``attention_chunk_size`` with ``no_rope_layers``, Jamba's
    ``attn_layer_period``/``offset`` or ``layers_block_type``), MLA sizes, Mamba sizes, experts and fp8 or
    MXFP4 weights. Nothing of this in the file: {} (a classic model, as before)."""
    n = need("num_hidden_layers")
    max_len = need("max_position_embeddings")
    out: dict = {}
    kinds: list[str] | None = None
    for key in ("layer_types", "layers_block_type"):
        if cfg.get(key) is not None:  # null: absent
            lt = cfg[key]
            if not isinstance(lt, list):
                raise CatalogError(f"{path}: '{key}' must be a list of layer kinds, got {lt!r}")
            if len(lt) != n:
                raise CatalogError(f"{path}: '{key}' has {len(lt)} entries but num_hidden_layers is {n}")
            kinds = []
            for i, k in enumerate(lt):
                if k not in _HF_KINDS:
                    raise CatalogError(f"{path}: '{key}[{i}]' is {k!r}, an unknown layer kind (expected one of "
                                       f"{', '.join(_HF_KINDS)})")
                kinds.append(_HF_KINDS[k])
            break
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window") is not False:
        window = need("sliding_window")
        if window > max_len:
            raise CatalogError(f"{path}: 'sliding_window' {window} is larger than max_position_embeddings {max_len}")
        if kinds is None:
            if cfg.get("sliding_window_pattern") is not None:  # Gemma 2/3: every pattern-th layer is full attention
                pattern = need("sliding_window_pattern")
                kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
            elif cfg.get("model_type") in _MIXED_WINDOWS:
                raise CatalogError(f"{path}: model_type {cfg['model_type']!r} mixes sliding and full attention layers: "
                                   f"give 'layer_types' or 'sliding_window_pattern'")
            else:  # Mistral 7B v0.1: every layer sliding
                kinds = ["sliding"] * n
        out["sliding_window"] = window
    elif kinds is not None and "sliding" in kinds:
        raise CatalogError(f"{path}: 'layer_types' has sliding_attention layers but no 'sliding_window'")
    chunk = cfg.get("attention_chunk_size")
    if chunk is not None:
        chunk = need("attention_chunk_size")
        if chunk > max_len:
            raise CatalogError(f"{path}: 'attention_chunk_size' {chunk} is larger than max_position_embeddings {max_len}")
        if kinds is None:  # Llama 4: chunked attention on the RoPE layers (no_rope_layers[i] == 1), global on the others
            rope = cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
            if not isinstance(rope, list) or len(rope) != n:
                raise CatalogError(f"{path}: 'no_rope_layers' must list {n} layers")
            kinds = ["chunked" if r else "full" for r in rope]
        out["attention_chunk_size"] = chunk
    elif kinds is not None and "chunked" in kinds:
        raise CatalogError(f"{path}: 'layer_types' has chunked_attention layers but no 'attention_chunk_size'")
    if "attn_layer_period" in cfg and kinds is None:  # Jamba
        period, offset = need("attn_layer_period"), _whole(path, cfg, "attn_layer_offset")
        if offset >= period:  # (no layer would be attention)
            raise CatalogError(f"{path}: 'attn_layer_offset' {offset} must be below attn_layer_period {period}")
        kinds = ["full" if i % period == offset else "mamba" for i in range(n)]
    if kinds is not None and "mamba" in kinds:
        d_state = need("mamba_d_state", "ssm_state_size", "state_size")
        d_conv = need("mamba_d_conv", "conv_kernel")
        expand = need("mamba_expand", "expand")
        rank = cfg.get("mamba_dt_rank", cfg.get("time_step_rank", "auto"))
        out.update(mamba_d_inner=expand * hidden, mamba_d_state=d_state, mamba_d_conv=d_conv,
                   mamba_dt_rank=-(-hidden // 16) if rank == "auto" else need("mamba_dt_rank", "time_step_rank"))
    if "kv_lora_rank" in cfg and cfg["kv_lora_rank"] is not None:  # MLA: every attention layer keeps a latent
        out.update(kv_lora_rank=need("kv_lora_rank"), qk_rope_head_dim=need("qk_rope_head_dim"),
                   qk_nope_head_dim=need("qk_nope_head_dim"), v_head_dim=need("v_head_dim"),
                   q_lora_rank=need("q_lora_rank") if cfg.get("q_lora_rank") else 0)
        kinds = ["mla" if k == "full" else k for k in (kinds or ["full"] * n)]
    experts = next((k for k in ("num_local_experts", "n_routed_experts", "num_experts") if cfg.get(k)), None)
    if experts:
        out.update(num_experts=need(experts), num_experts_per_tok=need("num_experts_per_tok"),
                   moe_ffn_size=need("moe_intermediate_size", "intermediate_size"),
                   num_shared_experts=_whole(path, cfg, "n_shared_experts") or (
                       1 if cfg.get("model_type") == "llama4_text" else 0))
        if out["num_experts_per_tok"] > out["num_experts"]:
            raise CatalogError(f"{path}: 'num_experts_per_tok' {out['num_experts_per_tok']} is more than the "
                               f"{out['num_experts']} experts ('{experts}')")
        if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert of its own width
            out.update(num_shared_experts=1, shared_expert_ffn_size=need("shared_expert_intermediate_size"))
        first = _whole(path, cfg, "first_k_dense_replace")
        # Jamba: expert_layer_period / offset; Llama 4: every interleave_moe_layer_step-th layer (the last of each step)
        period = need("expert_layer_period", "interleave_moe_layer_step") if (
            "expert_layer_period" in cfg or "interleave_moe_layer_step" in cfg) else 1
        offset = _whole(path, cfg, "expert_layer_offset", 0 if "expert_layer_period" in cfg else period - 1)
        out["moe_layers"] = tuple(i for i in range(first, n) if i % period == offset % period)
    quant = (cfg.get("quantization_config") or {}).get("quant_method") if isinstance(cfg.get("quantization_config"), dict) else None
    if quant == "fp8":  # every linear layer's weights (the LM head and router excepted)
        out["weight_bytes"] = out["dense_weight_bytes"] = 1
    elif quant == "mxfp4":
        out["weight_bytes"] = 0.56
    if kinds is not None and set(kinds) != {"full"}:
        out["layer_kinds"] = tuple(kinds)
    return out
