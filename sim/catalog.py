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

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

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

    @property
    def embedding_params(self) -> int:
        """Token embedding, the LM head when not tied, and OPT's learned positions."""
        n = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        if self.learned_positions:
            n += self.max_model_len * self.hidden_size
        return n

    @property
    def num_params(self) -> int:
        return self.num_layers * self.linear_params_per_layer + self.embedding_params

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each tensor-parallel rank stores; heads are replicated when there are fewer than ranks."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of one token over all layers, on one tensor-parallel rank."""
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GemmFit:
    """A GEMM of M tokens, N outputs and K inputs on one rank (``sim/profiles.py`` fits these):

        launch + (t_c**p + t_m**p)**(1/p),   t_c = 2MNK / (compute_efficiency * peak) * (1 + tile_tokens / M)
                                             t_m = bytes(A, B, C) / (bandwidth_efficiency * HBM bandwidth)
    """

    launch_s: float
    compute_efficiency: float
    bandwidth_efficiency: float
    sharpness: float  # p: 1 adds the two regimes, large p approaches max() (the datasheet roofline)
    tile_tokens: float  # small-M tile under-use: compute time grows by (1 + tile_tokens / M)

    def time_s(self, m: float, n: int, k: int, gpu: "GpuSpec", dtype_bytes: int = 2) -> float:
        tc = 2.0 * m * n * k / (self.compute_efficiency * gpu.flops_per_s) * (1.0 + self.tile_tokens / m)
        tm = dtype_bytes * (m * k + k * n + m * n) / (self.bandwidth_efficiency * gpu.hbm_bytes_per_s)
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
    ]
}

# Operator coefficients fitted to Vidur's measured profiles (``sim profiles fit ../shared/profiles/vidur``
# regenerates these literals; ``sim profiles validate`` gives their leave-one-model-out error). The
# efficiencies are fractions of each GPU's own datasheet peak, so a GPU with the same chip and another
# memory (A100 40GB, H200) uses its sibling's coefficients with its own datasheet figures.
A100_FIT = OperatorFit(
    gemm=GemmFit(launch_s=7.952e-06, compute_efficiency=0.7301, bandwidth_efficiency=0.875, sharpness=1.459, tile_tokens=1.857e-11),
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
    gemm=GemmFit(launch_s=4.799e-06, compute_efficiency=0.7801, bandwidth_efficiency=0.7991, sharpness=1.588, tile_tokens=5.507e-16),
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
    gemm=GemmFit(launch_s=7.222e-06, compute_efficiency=0.746, bandwidth_efficiency=0.9782, sharpness=8.662, tile_tokens=156.5),
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
        GpuSpec("h100", 80 * GIB, 3350e9, 989e12, 64e9, 450e9, H100_FIT, "fitted on H100 80GB SXM"),
        GpuSpec("h200", 141 * GIB, 4800e9, 989e12, 64e9, 450e9, H100_FIT,
                "fitted on H100 80GB SXM (same GH100 chip), at this GPU's bandwidth"),
        GpuSpec("l4", 24 * GIB, 300e9, 121e12, 32e9, 32e9),
        # A40 48GB: GDDR6 696 GB/s, 149.7 dense fp16/bf16 tensor TFLOP/s, PCIe 4.0 x16, NVLink bridge
        # 112.5 GB/s in both directions for a pair
        GpuSpec("a40", 48 * GIB, 696e9, 149.7e12, 32e9, 56.25e9, A40_FIT,
                "fitted on A40 48GB; all-reduce from the datasheet (no A40 network profile)"),
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
                return v
        raise CatalogError(f"{path}: missing '{keys[0]}'")

    is_opt = cfg.get("model_type") == "opt" or "ffn_dim" in cfg
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    # NOTE: head_dim when declared (Mistral-Nemo: 128 with hidden 5120 / 32 heads = 160); null means the default
    if cfg.get("head_dim") is not None:
        head_dim = need("head_dim")
    elif hidden % heads:
        raise CatalogError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                           f"(and no head_dim is declared)")
    else:
        head_dim = hidden // heads
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in cfg else heads
    if heads % kv_heads:
        raise CatalogError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or path.parent.name or path.stem),
        num_layers=need("num_hidden_layers"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_size=need("ffn_dim", "intermediate_size"),
        vocab_size=need("vocab_size"),
        max_model_len=need("max_position_embeddings"),
        gated_mlp=not is_opt,  # Llama-family configs use a gated (SwiGLU-style) MLP; OPT a plain one
        tie_embeddings=bool(cfg.get("tie_word_embeddings", is_opt)),
        learned_positions=is_opt,
        head_dim=head_dim,
    )
