"""The KV pool as one device tensor, the kernel that stores new K/V into it, and the host swap space.

One tensor per model, laid out so that the simulator's block ids *are* slices of it::

    kv[layer, 0 (K) | 1 (V), block_id, offset, kv_head, head_dim]      shape (L, 2, num_blocks, block_size, H_kv, D)

    flat token slots of one layer's K (or V):   slot = block_id * block_size + offset
        slot:   0        B        2B            num_blocks*B
                |block 0 |block 1 |   ...   |block N-1|
    paged:      token position p of a sequence lives in slot  block_table[p // B] * B + p % B
    contiguous: token position p of a sequence lives in slot  slab_start + p   (a slab ignores block edges)

Both layouts address the same ``[num_slots, H_kv, D]`` view through a ``slot_mapping`` (one slot per new
token), which is all :func:`store_kv` needs. ``num_blocks`` and ``block_size`` come from the simulator's
:class:`sim.kv.KvPool`, so every policy of a scenario gets exactly the slots it was simulated with.

Several KV groups (the simulator's hybrid allocator, ``sim/layouts.py``: window layers in groups of their
own): a page holds ``block_size`` tokens of one group's ``group_size`` layers (vLLM's rule), so the first
axis is a layer's place in its group's pages, not the layer, and each group's layers go through that
group's own block tables (:class:`KvGroups`)::

    kv[place, 0 (K) | 1 (V), page_id, offset, kv_head, head_dim]     shape (group_size, 2, num_blocks, ...)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # the kernels need no simulator (nor pydantic): the device check runs them without it
    from gpu.model import ModelShape
    from sim.kv import KvPool


@dataclass(frozen=True)
class KvGroups:
    """Where each layer's KV lives: its group (whose block tables it reads and writes through) and its
    place in that group's pages. One group of every layer is the classic pool (place = layer)."""

    layer_group: tuple[int, ...]  # per layer: its KV group (an index into the step's per-group tables)
    layer_place: tuple[int, ...]  # per layer: its slice of a page, 0 .. page_layers - 1
    page_layers: int  # layers a page holds (the layout's group_size)

    @property
    def num_groups(self) -> int:
        return max(self.layer_group) + 1

    @classmethod
    def single(cls, num_layers: int) -> "KvGroups":
        return cls((0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def of_layout(cls, layer_windows: tuple[int, ...], num_layers: int, layout) -> "KvGroups":
        """The groups of a ``sim.layouts.KvLayout`` of several groups, as ``kv_layout`` builds them: the
        attention groups in order, those of one kind and window taking that kind's layers in layer order,
        ``group_size`` at a time; ``layer_windows`` (``ModelShape``; () all full) gives each layer's kind."""
        windows = layer_windows or (0,) * num_layers
        groups = [g for g in layout.groups if g.attention]
        kinds = {("full", 0) if w == 0 else ("sliding", w) for w in windows}
        if len(groups) != len(layout.groups) or {(g.kind, g.window) for g in groups} != kinds:
            raise ValueError(f"KV groups {[(g.kind, g.window, g.layers) for g in layout.groups]} do not match "
                             f"the model's layer windows {windows}")
        group, place = [0] * num_layers, [0] * num_layers
        for kind, w in kinds:
            layers = [i for i, x in enumerate(windows) if x == w]
            mine = [k for k, g in enumerate(groups) if (g.kind, g.window) == (kind, w)]
            if sum(groups[k].layers for k in mine) != len(layers):
                raise ValueError(f"KV groups of {kind} W={w} hold {sum(groups[k].layers for k in mine)} layers, "
                                 f"the model has {len(layers)}")
            for j, i in enumerate(layers):
                group[i], place[i] = mine[j // layout.group_size], j % layout.group_size
        return cls(tuple(group), tuple(place), layout.group_size)


class KvCache:
    """The device KV pool of one policy's run, plus the host swap space its swaps use.

    Guarantees: ``layer(l)`` returns ``(k_cache, v_cache)``, views ``[num_slots, H_kv, D]`` of the one
    pool tensor (no copies); the pool starts zeroed, so a slot never written reads as zeros. Swapped-out
    blocks live on the host keyed by the scheduler's CPU block id; memory grows with what is swapped.
    On a GPU the host copies are in pinned (page-locked) memory, so a swap is one DMA each way."""

    def __init__(self, shape: ModelShape, pool: KvPool, device: torch.device, dtype: torch.dtype,
                 groups: KvGroups | None = None) -> None:
        self.num_blocks = pool.num_blocks
        self.block_size = pool.block_size
        self.num_slots = pool.num_slots
        self.groups = groups or KvGroups.single(shape.num_layers)
        from gpu.device import check_fits  # (gpu.device imports this module)

        elems = self.groups.page_layers * 2 * pool.num_slots * shape.num_kv_heads * shape.head_dim
        check_fits(f"{shape.name}: the KV pool of {pool.num_slots:,} tokens in {str(dtype).removeprefix('torch.')}",
                   elems * torch.empty((), dtype=dtype).element_size(), torch.device(device),
                   "the replay sizes the pool as the simulator does for the scenario's GPU; lower "
                   "gpu_memory_utilization or give a GPU of less memory (an inline gpu: {memory_gib: ...})")
        self.kv = torch.zeros((self.groups.page_layers, 2, pool.num_blocks, pool.block_size, shape.num_kv_heads,
                               shape.head_dim), device=device, dtype=dtype)
        # CPU block id -> [page_layers, 2, block_size, H_kv, D] on the host
        self.swap_space: dict[int, torch.Tensor] = {}

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K and V over every page (its group's pages are those its tables name)."""
        p = self.groups.layer_place[i]
        k = self.kv[p, 0].view(self.num_slots, *self.kv.shape[-2:])
        v = self.kv[p, 1].view(self.num_slots, *self.kv.shape[-2:])
        return k, v

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def swap_out(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy device blocks to the host: (device block, CPU block) pairs, one gather and one transfer."""
        if not pairs:
            return
        src = torch.tensor([g for g, _ in pairs], device=self.kv.device)
        blocks = self.kv.index_select(2, src)  # [L, 2, n, B, H, D]
        if self.kv.device.type == "cuda":
            # pinned: a real DMA, ordered on the stream before any later swap-in reads it back
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
            host.copy_(blocks, non_blocking=True)
        else:
            host = blocks.to("cpu")
        for i, (_, cpu_block) in enumerate(pairs):
            self.swap_space[cpu_block] = host[:, :, i]

    def swap_in(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy host blocks back: (CPU block, device block) pairs; the host copies are released."""
        if not pairs:
            return
        host = torch.stack([self.swap_space.pop(c) for c, _ in pairs], dim=2)
        dst = torch.tensor([g for _, g in pairs], device=self.kv.device)
        if self.kv.device.type == "cuda":
            host = host.pin_memory()
        self.kv.index_copy_(2, dst, host.to(self.kv.device, non_blocking=True))


    def copy_blocks(self, pairs: tuple[tuple[int, int], ...], use_kernel: bool = True) -> None:
        """Copy-on-write: (source, destination) device blocks, every layer's K and V, in one launch."""
        if not pairs:
            return
        pairs_t = torch.tensor(pairs, dtype=torch.int64, device=self.kv.device).reshape(-1, 2)
        (copy_blocks if use_kernel else copy_blocks_ref)(self.kv, pairs_t)

    def copy_slots(self, copies: tuple[tuple[int, int, int], ...]) -> None:
        """Contiguous forks and beam moves: (source slot, destination slot, slots) runs of every layer's
        K and V. All sources are read before any destination is written (a beam may be both)."""
        if not copies:
            return
        src = torch.cat([torch.arange(a, a + n) for a, _, n in copies]).to(self.kv.device)
        dst = torch.cat([torch.arange(b, b + n) for _, b, n in copies]).to(self.kv.device)
        flat = self.kv.view(*self.kv.shape[:2], self.num_slots, *self.kv.shape[-2:])
        flat[:, :, dst] = flat[:, :, src]  # advanced indexing gathers the sources first


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import time)."""
    if hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")  # triton before 3.4


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches ``triton.language`` at every launch (and undoes it after), and again at
    every call of a nested ``@triton.jit`` function (``_dot``, ``_attend_tile``, ``tl.max``: many per tile),
    walking the modules with ``inspect.getmembers`` each time: about a sixth of an interpreted kernel's
    time here. Within a launch, a nested call's patch of modules this launch has patched already changes
    nothing (their builtins are wrapped), so it is skipped. Results are unchanged: the kernels' reference
    checks run through it. A Triton whose interpreter lacks these internals is left as it is (slower)."""
    import inspect

    from triton.runtime import interpreter as it

    patch, grid = getattr(it, "_patch_lang", None), getattr(it, "GridExecutor", None)
    if patch is None or grid is None or getattr(patch, "once_per_launch", False) or \
            not hasattr(it, "_LangPatchScope") or not hasattr(grid, "__call__"):
        return
    launches: list[set[int]] = []  # per live launch: the language modules patched in it

    def langs(fn) -> set[int]:
        return {id(v) for v in getattr(fn, "__globals__", {}).values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang(fn):
        need = langs(fn)
        if launches and need <= launches[-1]:
            return it._LangPatchScope()  # nothing to undo
        scope = patch(fn)
        if launches:
            launches[-1] |= need
        return scope

    def launch(self, *args, _call=grid.__call__, **kwargs):
        launches.append(set())
        try:
            return _call(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.once_per_launch = True
    it._patch_lang, grid.__call__ = patch_lang, launch


if interpreting():
    _patch_language_once_per_launch()


def check_launch(name: str, *tensors: torch.Tensor) -> None:
    """Kernels need their tensors on one device; on the CPU only the interpreter can run them."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not interpreting():
        raise RuntimeError(f"{name}: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "importing triton, or use the torch attention backend")


def check_head_major(name: str, t: torch.Tensor, ndim: int = 3) -> None:
    if t.dim() != ndim or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a {ndim}-d tensor with a contiguous last dimension, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


# ------------------------------------------------------------------------------------------ store_kv


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, H_kv, D]
    value_ptr,  # [num_tokens, H_kv, D]
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per new token: copy its K and V (all KV heads) into its slot; a negative slot (a padded
    row of a captured batch) writes nothing. Offsets in int64: a token row times its stride, or a slot
    times the cache's, passes 2^31 elements in a large step or pool."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (h * 0 + slot >= 0)  # a tensor compare (the interpreter)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cs + h * stride_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cs + h * stride_ch + d, v, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key[t]``/``value[t]`` ([num_tokens, H_kv, D]) into slot ``slot_mapping[t]`` of the caches;
    tokens whose slot is negative are skipped (padding)."""
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_head_major(name, t)
    if k_cache.stride() != v_cache.stride() or key.shape[1:] != k_cache.shape[1:] or value.shape != key.shape:
        raise ValueError(f"store_kv: shapes differ: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"store_kv: dtypes differ ({key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype})")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError("store_kv: slot_mapping must be int64 with one slot per token")
    check_launch("store_kv", key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, skip_negative: bool = True) -> None:
    """PyTorch reference of :func:`store_kv`. Skipping negative slots costs a device sync on a GPU; the
    executor's torch path, which never pads, passes ``skip_negative=False``."""
    if skip_negative:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache[slot_mapping] = key.to(k_cache.dtype)
    v_cache[slot_mapping] = value.to(v_cache.dtype)


# ------------------------------------------------------------------------------------------ slots


def token_slots(positions: np.ndarray, block_size: int, block_table: list[int] | None = None,
                slab_start: int | None = None) -> np.ndarray:
    """Slots of a sequence's token ``positions``: through its block table (paged) or from its slab start."""
    if block_table is not None:
        return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size
    return slab_start + positions


# ------------------------------------------------------------------------------------------ copy_blocks


@triton.jit
def _copy_blocks_kernel(
    kv_ptr,  # [L, 2, num_blocks, block_size * H_kv * D], the pool
    pairs_ptr,  # [num_pairs, 2] int64: (source block, destination block)
    stride_layer, stride_kv, stride_block,
    BLOCK_ELEMS: tl.constexpr,  # block_size * H_kv * D
    CHUNK: tl.constexpr,
):
    """One program per (pair, layer and K|V): copy one block's slots."""
    p = tl.program_id(0)
    lk = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * p).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
    base = (lk // 2).to(tl.int64) * stride_layer + (lk % 2).to(tl.int64) * stride_kv
    for off in range(0, BLOCK_ELEMS, CHUNK):
        idx = off + tl.arange(0, CHUNK)
        mask = idx < BLOCK_ELEMS
        x = tl.load(kv_ptr + base + src * stride_block + idx, mask=mask)
        tl.store(kv_ptr + base + dst * stride_block + idx, x, mask=mask)


def copy_blocks(kv: torch.Tensor, pairs: torch.Tensor) -> None:
    """``kv[:, :, dst] = kv[:, :, src]`` for each (src, dst) row of ``pairs`` ([n, 2] int64): a batched
    copy-on-write, one launch per step. A destination must not be a source of the same call."""
    if kv.dim() != 6 or not kv.is_contiguous():
        raise ValueError(f"copy_blocks: expected the contiguous 6-d pool, got shape {tuple(kv.shape)}")
    if pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError("copy_blocks: pairs must be an int64 [n, 2] tensor of (source, destination) blocks")
    check_launch("copy_blocks", kv, pairs)
    if pairs.shape[0] == 0:
        return
    layers, _, _, block_size, heads, dim = kv.shape
    elems = block_size * heads * dim
    _copy_blocks_kernel[(pairs.shape[0], layers * 2)](
        kv, pairs, kv.stride(0), kv.stride(1), kv.stride(2),
        BLOCK_ELEMS=elems, CHUNK=min(triton.next_power_of_2(elems), 4096),
    )


def copy_blocks_ref(kv: torch.Tensor, pairs: torch.Tensor) -> None:
    """PyTorch reference of :func:`copy_blocks`."""
    src, dst = pairs[:, 0], pairs[:, 1]
    kv[:, :, dst] = kv[:, :, src]
