"""A Llama-architecture decoder with random (seeded) weights in the shapes of the simulator's catalog.

    tokens -> embedding -> L x [ RMSNorm -> QKV -> rotary -> attention (GQA) -> O  (+ residual)
                                 RMSNorm -> SwiGLU MLP (gate, up, down)           (+ residual) ]
           -> RMSNorm -> LM head (sampled rows only) -> greedy next token

The weights are random, so the text is noise, but every matrix has the catalog model's shape and the
step does the real work: the time measured is the time that model would take. Attention goes through
an ``attention`` callable, so one forward serves the KV-cached path (kernels over the pool, see
``gpu.executor``) and a plain full recomputation (``full_attention``, the test reference).

Sliding-window layers (``layer_windows``, from the catalog's ``layer_kinds`` and ``sliding_window``)
attend to their last W keys; the executor runs each layer through its KV group's block tables (the hybrid
allocator's, without the blocks it freed) or, with one group, the full tables through the window mask.
MLA, Mamba, chunked-local and mixture-of-experts layers are simulator-only: ``from_spec`` refuses them.

NOTE: models whose catalog entry has no gated MLP (OPT) get a two-matrix ReLU MLP of their FFN size,
so the matrix shapes and FLOPs match; positions stay rotary (OPT's learned position table is left out).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from gpu.attention import attend
from sim.catalog import ModelSpec
from sim.config import ScenarioError

# (layer index, q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]) -> attention output [T, H, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = True
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window W, 0 for full attention; () all full

    def __post_init__(self) -> None:
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"{self.name}: layer_windows needs {self.num_layers} non-negative entries, "
                             f"got {self.layer_windows}")

    @classmethod
    def from_spec(cls, spec: ModelSpec, num_layers: int | None = None) -> "ModelShape":
        """The catalog model's shape, optionally with fewer layers (the first ``num_layers``: their kinds)."""
        n = num_layers or spec.num_layers
        kinds = tuple(getattr(spec, "layer_kinds", ()) or ())
        # (ScenarioError: a user's choice of model, said in one line; a ValueError was a traceback)
        if set(kinds) - {"full", "sliding"}:
            raise ScenarioError(f"{spec.name}: layers of kind {sorted(set(kinds) - {'full', 'sliding'})} are "
                             "simulator-only; the GPU backend runs full and sliding-window attention")
        if getattr(spec, "num_experts", 0):
            raise ScenarioError(f"{spec.name}: mixture-of-experts layers are simulator-only; the GPU backend runs "
                             "dense (Llama-architecture) MLPs")
        window = getattr(spec, "sliding_window", 0)
        windows = tuple(window if k == "sliding" else 0 for k in kinds[:n]) if "sliding" in kinds[:n] else ()
        return cls(spec.name, n, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.ffn_size,
                   spec.vocab_size, spec.max_model_len, spec.gated_mlp, spec.tie_embeddings, layer_windows=windows)

    def with_layers(self, num_layers: int) -> "ModelShape":
        return replace(self, num_layers=num_layers, layer_windows=self.layer_windows[:num_layers])

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 H_kv) D, hidden]
    o: torch.Tensor  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    up: torch.Tensor  # [2 ffn, hidden] (gate and up, gated) or [ffn, hidden]
    down: torch.Tensor  # [hidden, ffn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, D] with cos, sin [T, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class LlamaModel:
    """Weights and the forward pass; no KV cache of its own (the executor owns the pool)."""

    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.shape = shape
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        half = shape.head_dim // 2
        inv_freq = shape.rope_theta ** (-torch.arange(half, device=self.device, dtype=torch.float32) / half)
        angles = torch.arange(shape.max_model_len, device=self.device, dtype=torch.float32)[:, None] * inv_freq
        self.cos, self.sin = angles.cos(), angles.sin()

    @classmethod
    def random(cls, shape: ModelShape, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> "LlamaModel":
        """Weights ~ N(0, 1/fan_in) (embedding N(0, 1)), norms 1: activations stay O(1) through the layers."""
        device = torch.device(device)
        g = None  # the meta device (shapes only) has no generator
        if device.type != "meta":
            g = torch.Generator(device=device)
            g.manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.empty((rows, cols), device=device, dtype=dtype)
            return t.normal_(0.0, cols ** -0.5, generator=g)

        s = shape
        qkv_rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        if device.type != "meta":
            from gpu.device import check_fits

            elem = torch.empty((), dtype=dtype).element_size()
            check_fits(f"{s.name}: its random weights in {str(dtype).removeprefix('torch.')}",
                       cls.num_weights(shape) * elem, device)
        ones = torch.ones(s.hidden_size, device=device, dtype=dtype)
        layers = [LayerWeights(ones.clone(), w(qkv_rows, s.hidden_size), w(s.hidden_size, s.num_heads * s.head_dim),
                               ones.clone(), w((2 if s.gated_mlp else 1) * s.ffn_size, s.hidden_size),
                               w(s.hidden_size, s.ffn_size))
                  for _ in range(s.num_layers)]
        embed = torch.empty((s.vocab_size, s.hidden_size), device=device, dtype=dtype).normal_(0.0, 1.0, generator=g)
        lm_head = embed if s.tie_embeddings else w(s.vocab_size, s.hidden_size)
        return cls(shape, embed, layers, ones.clone(), lm_head)

    @staticmethod
    def num_weights(shape: ModelShape) -> int:
        """Elements ``random`` allocates for ``shape``: every matrix and norm (a tied LM head once)."""
        s = shape
        layer = ((s.num_heads + 2 * s.num_kv_heads) * s.head_dim * s.hidden_size + s.hidden_size * s.num_heads * s.head_dim
                 + (3 if s.gated_mlp else 2) * s.ffn_size * s.hidden_size + 2 * s.hidden_size)
        return s.num_layers * layer + s.vocab_size * s.hidden_size * (1 if s.tie_embeddings else 2) + s.hidden_size

    @property
    def num_params(self) -> int:
        """Matrix parameters (norms excluded, a tied LM head counted once), as ``ModelSpec.num_params``."""
        mats = [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])
        mats += [t for lw in self.layers for t in (lw.qkv, lw.o, lw.up, lw.down)]
        return sum(t.numel() for t in mats)

    def _mlp(self, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        h = x @ lw.up.T
        if self.shape.gated_mlp:
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(gate) * up
        else:
            h = torch.relu(h)
        return h @ lw.down.T

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                sample_rows: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) of the rows ``sample_rows`` of the step's tokens ``input_ids`` [T] at ``positions``."""
        s = self.shape
        T = input_ids.shape[0]
        h = self.embed[input_ids]
        cos, sin = self.cos[positions], self.sin[positions]
        q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, s.rms_norm_eps)
            qkv = x @ lw.qkv.T
            # q and k heads rotated in one call (fewer kernel launches per layer)
            qk = apply_rotary(qkv[:, :q_dim + kv_dim].view(T, s.num_heads + s.num_kv_heads, s.head_dim), cos, sin)
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
            o = attention(i, q, k, qkv[:, q_dim + kv_dim:].view(T, s.num_kv_heads, s.head_dim))
            h = h + o.reshape(T, q_dim) @ lw.o.T
            h = h + self._mlp(rms_norm(h, lw.post_norm, s.rms_norm_eps), lw)
        h = rms_norm(h[sample_rows], self.final_norm, s.rms_norm_eps)
        return (h @ self.lm_head.T).float()

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of the last token after recomputing the whole sequence with plain causal attention
        (no cache): the reference the cached paths must reproduce."""
        ids = torch.tensor(token_ids, device=self.device)
        scale = self.shape.head_dim ** -0.5

        def full_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(q, k, v, scale, causal_offset=0, window=self.shape.window(layer))

        last = torch.tensor([len(token_ids) - 1], device=self.device)
        return self.forward(ids, torch.arange(len(token_ids), device=self.device), full_attention, last)[0]
