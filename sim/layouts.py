"""Today's KV layouts: a model's layers as KV-cache groups, derived once (issue 16).

A model is a list of layer kinds (``catalog.LAYER_KINDS``): ``full`` attention, ``sliding`` window (a token
attends to itself and the ``W - 1`` before it), ``chunked`` local attention (within its ``C``-token chunk),
``mla`` (one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer) and ``mamba`` (a
fixed state per sequence, no per-token cache).

Groups follow vLLM's hybrid KV cache manager (its design doc "Hybrid KV Cache Manager"): layers of one kind
are split into groups of ``group_size`` layers -- the smallest kind's layer count, or the largest's when
it is within 1.25x of it -- padding the last group of a kind; every group's page holds ``block_size``
tokens of ``group_size`` layers, so pages of all groups have the same bytes and share one pool. A group
with fewer layers leaves the rest of its pages unused (padding, counted as internal fragmentation).
A Mamba group's per-sequence state takes ``state_pages`` whole pages (vLLM instead grows the attention
block size until one page holds a state; the bytes are the same up to rounding).

``hybrid_allocator: false`` is vLLM's fallback: one group of every layer, window layers kept whole (blocks
for all tokens), pages of ``block_size`` tokens of all layers -- exactly the classic layout, handled by
``kv.PagedKv`` / ``kv.ContiguousKv``. A Mamba layer has no such fallback: it needs the hybrid allocator.

The one rule of what a window group keeps (``first_kept``) is used by the allocators (``sim/hybrid.py``),
the capacity table and the tests.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from sim.catalog import ModelSpec


class LayoutError(ValueError):
    """A model and policy whose KV layout cannot be built (the message names the key)."""


@dataclass(frozen=True)
class KvGroup:
    kind: str  # full | sliding | chunked | mla | mamba
    layers: int  # layers of the model in this group (at most the layout's group_size)
    window: int = 0  # sliding: W; chunked: C; 0: every token is kept
    state_pages: int = 0  # mamba: pages of one sequence's state

    @property
    def attention(self) -> bool:
        return self.kind != "mamba"


def first_kept(g: KvGroup, computed: int, block_size: int) -> int:
    """Index of the first block a sequence of ``g`` still needs once ``computed`` tokens are cached and
    the next is being written (blocks before it are freed). Full and MLA groups keep everything; a sliding
    group the blocks holding positions >= computed + 1 - W; a chunked group those of the current chunk."""
    if g.kind == "sliding":
        return max(0, computed + 1 - g.window) // block_size
    if g.kind == "chunked":
        return (computed // g.window) * g.window // block_size
    return 0


def head_sum(offs: list[int], total: int, i: int) -> int:
    """sum(offs[:i]), ``total`` being sum(offs): from whichever end is nearer (a typed loop, no slice). A
    window group's sums need the values below a bisection point, most often all but a few of them."""
    n, s = len(offs), 0
    if i <= n - i:
        for q in range(i):
            s += offs[q]
        return s
    for q in range(i, n):
        s += offs[q]
    return total - s


def window_runs(offs: list[int], total: int, d: int, window: int, k: int) -> list[tuple[int, int, int, int]]:
    """sum(min(o + d + j, window) for o in offs) for j = 0 .. k - 1 -- the keys a window group reads over ``k``
    decode steps, or the slots it holds (``offs`` sorted, ``total`` their sum) -- as runs ``(j0, j1, base,
    slope)``: for j0 <= j < j1 the sum is ``base + j * slope``. Linear in j while no value reaches the window
    (the ``slope`` below it grow, the rest hold ``window``): one run per such stretch, the next found by
    bisection. (Runs, not the k sums: a caller prices each step as it goes, with no list of them.)"""
    n = len(offs)
    out: list[tuple[int, int, int, int]] = []
    w = window - d  # o + d + j reaches the window at j = w - o
    i, j = bisect_left(offs, w), 0
    while j < k:
        end = k if i == 0 else min(k, w - offs[i - 1])
        out.append((j, end, head_sum(offs, total, i) + i * d + window * (n - i), i))
        j = end
        if j < k:
            i = bisect_left(offs, w - j, 0, i)
    return out


@dataclass(frozen=True)
class KvLayout:
    """A model's KV groups on one rank, in pages of ``block_size`` token slots; one slot is one token of
    ``group_size`` layers (``slot_bytes``)."""

    groups: tuple[KvGroup, ...]
    group_size: int
    layer_bytes: int  # one token in one attention layer on one rank (the largest kind's)
    block_size: int

    @property
    def slot_bytes(self) -> int:
        return self.group_size * self.layer_bytes

    @property
    def single(self) -> bool:
        """One group keeping every token: the classic paged / contiguous managers serve it."""
        return len(self.groups) == 1 and self.groups[0].kind in ("full", "mla")

    @property
    def num_attention_groups(self) -> int:
        return sum(g.attention for g in self.groups)

    def pages_held(self, tokens: int) -> int:
        """Pages one sequence of ``tokens`` cached tokens holds right after its last block crossing
        (what the paged hybrid allocator holds; the capacity table's rule)."""
        B = self.block_size
        cross = (tokens - 1) // B * B  # the last computed count at which it took a block
        n = 0
        for g in self.groups:
            n += g.state_pages if g.kind == "mamba" else -(-tokens // B) - first_kept(g, cross, B)
        return n


def kv_layout(model: ModelSpec, tp: int, block_size: int, kv_dtype_bytes: int | None = None,
              hybrid: bool = True) -> KvLayout:
    """The model's groups (see the module's doc). ``kv_dtype_bytes``: None for the model's dtype, 1 for fp8."""
    kinds = model.kinds
    if not hybrid:
        if "mamba" in kinds:
            raise LayoutError(f"{model.name} has Mamba layers (a state per sequence, not per token): "
                              f"hybrid_allocator: false cannot treat them as full attention; set it to true")
        layers = len(kinds)
        per_token = model.kv_bytes_per_token(tp, kv_dtype_bytes)
        if per_token % layers:  # attention layers of different sizes: one group of their total
            return KvLayout((KvGroup("full", 1),), 1, per_token, block_size)
        kind = "mla" if set(kinds) == {"mla"} else "full"
        return KvLayout((KvGroup(kind, layers),), layers, per_token // layers, block_size)
    types: dict[tuple[str, int], int] = {}
    for k in kinds:
        w = model.sliding_window if k == "sliding" else model.attention_chunk_size if k == "chunked" else 0
        types[(k, w)] = types.get((k, w), 0) + 1
    counts = list(types.values())
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    attn = [model.kv_bytes_per_token_layer(k, tp, kv_dtype_bytes) for k in set(kinds) if k != "mamba"]
    if not attn:
        raise LayoutError(f"{model.name}: no attention layer, so no page size to share with its Mamba state")
    layer_bytes = max(attn)
    page_layer = block_size * layer_bytes
    groups = []
    for (k, w), n in types.items():
        state = -(-model.mamba_state_bytes(tp) // page_layer) if k == "mamba" else 0
        while n > 0:
            groups.append(KvGroup(k, min(size, n), w, state))
            n -= size
    return KvLayout(tuple(groups), size, layer_bytes, block_size)


def capacity_tokens(layout: KvLayout, num_pages: int, context: int) -> int:
    """Tokens the pool holds when filled with ``context``-token sequences (the capacity table): pages over
    the pages one such sequence holds, times its tokens (fractions of a sequence counted)."""
    return num_pages * context // layout.pages_held(context)
