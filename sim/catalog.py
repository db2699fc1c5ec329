"""Model and GPU catalogs: the shapes and datasheet figures the simulator computes from.

Figures come from `../shared/docs/references.md` (models' published config.json, vendor datasheets).
A model can also be read from a Hugging Face ``config.json``; a GPU can be given inline in a scenario.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the per-layer matrices (QKV, output projection, MLP); norms and biases ignored."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_size
        return q + kv + o + mlp

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
class GpuSpec:
    """One GPU's datasheet figures (dense bf16/fp16, no sparsity)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    flops_per_s: float  # bf16/fp16 tensor-core peak
    host_bytes_per_s: float  # host link, one direction (swap traffic)
    interconnect_bytes_per_s: float  # GPU-GPU link, one direction (tensor-parallel all-reduce)


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

# NOTE: datasheet memory sizes are read as GiB (an "A100 40GB" has 40 GiB of HBM); the driver keeps a
# little of it, which the scenario's `runtime_overhead_gib` stands for.
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40gb", 40 * GIB, 1555e9, 312e12, 32e9, 300e9),
        GpuSpec("a100-80gb", 80 * GIB, 2039e9, 312e12, 32e9, 300e9),
        GpuSpec("h100", 80 * GIB, 3350e9, 989e12, 64e9, 450e9),
        GpuSpec("h200", 141 * GIB, 4800e9, 989e12, 64e9, 450e9),
        GpuSpec("l4", 24 * GIB, 300e9, 121e12, 32e9, 32e9),
    ]
}


class CatalogError(ValueError):
    """A model or GPU name or file the catalog cannot resolve."""


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama/Mistral/Qwen-style or OPT-style)."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such model config file") from None
    except json.JSONDecodeError as e:
        raise CatalogError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
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
    if hidden % heads:
        raise CatalogError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
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
    )
