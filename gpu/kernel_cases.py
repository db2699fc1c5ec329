"""Kernel checks against their PyTorch references on fresh random inputs (the tests and the device check).

Each case builds a pool with shuffled block tables (paged) or spread-out slabs (contiguous), sequence
lengths that are not multiples of the block size, fills the output with NaN before the launch (a row
the kernel forgets stays NaN), and compares with the reference computed in fp64 on the same inputs:

    error = max |kernel - reference| / max |reference|
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention import decode_attention, decode_attention_ref, prefill_attention, prefill_attention_ref
from gpu.kv_cache import copy_blocks, copy_blocks_ref, store_kv

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Shape:
    num_heads: int = 8
    num_kv_heads: int = 2  # GQA ratio 4
    head_dim: int = 32
    block_size: int = 16


@dataclass
class Pool:
    k_cache: torch.Tensor  # [num_slots, H_kv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor | None  # [num_seqs, max_num_blocks] int32
    slab_starts: torch.Tensor | None  # [num_seqs] int64

    def layout(self) -> dict:
        return {"block_tables": self.block_tables, "slab_starts": self.slab_starts}


def make_pool(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, gen: torch.Generator) -> Pool:
    """Random K/V for sequences of ``lens`` tokens, placed in shuffled blocks or in slabs with gaps."""
    B = shape.block_size
    blocks = [-(-n // B) for n in lens]
    num_blocks = sum(blocks) + 3  # a few blocks nobody owns
    num_slots = num_blocks * B
    kv_shape = (num_slots, shape.num_kv_heads, shape.head_dim)
    k = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    v = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    if paged:
        perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32, device=device)
        first = np.cumsum([0] + blocks[:-1])
        for s, (f, nb) in enumerate(zip(first, blocks)):
            tables[s, :nb] = perm[f:f + nb]
        return Pool(k, v, tables, None)
    starts, pos = [], 1  # slabs start off block edges, with a slot of gap between them
    for n in lens:
        starts.append(pos)
        pos += n + 1
    assert pos <= num_slots
    return Pool(k, v, None, torch.tensor(starts, dtype=torch.int64, device=device))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


def decode_case(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *, split_k: bool,
                seed: int = 0) -> float:
    """Error of :func:`decode_attention` (one query per sequence, in shuffled rows of a larger q)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen)
    n = len(lens)
    q = torch.randn((n + 2, shape.num_heads, shape.head_dim), generator=gen, device=device).to(dtype)
    query_loc = torch.randperm(n + 2, generator=gen, device=device)[:n].to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, pool.k_cache, pool.v_cache, seq_lens, query_loc, max_seq_len=max(lens),
                     block_size=shape.block_size, out=out, split_k=split_k, **pool.layout())
    ref = decode_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), seq_lens, query_loc,
                               block_size=shape.block_size, **pool.layout())
    rows = query_loc.long()
    return relative_error(out[rows], ref[rows])


def prefill_case(lens: list[int], num_new: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *,
                 seed: int = 0) -> float:
    """Error of :func:`prefill_attention`: sequence s has ``lens[s]`` tokens of which the last
    ``num_new[s]`` are queries (the rest cached context)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen)
    total = sum(num_new)
    q = torch.randn((total, shape.num_heads, shape.head_dim), generator=gen, device=device).to(dtype)
    query_start = torch.tensor(np.cumsum([0] + num_new[:-1]), dtype=torch.int32, device=device)
    new = torch.tensor(num_new, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, pool.k_cache, pool.v_cache, query_start, new, seq_lens, max_num_new=max(num_new),
                      block_size=shape.block_size, out=out, **pool.layout())
    ref = prefill_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), query_start, new, seq_lens,
                                block_size=shape.block_size, **pool.layout())
    return relative_error(out, ref)


def store_case(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *, seed: int = 0) -> float:
    """:func:`store_kv` of every token of the sequences into a NaN-poisoned pool: the error of the stored
    slots (a plain copy: 0), or inf when a slot outside the mapping was written."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen)
    slots = []
    for s, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        if paged:
            slots.append(pool.block_tables[s, pos // shape.block_size].long() * shape.block_size + pos % shape.block_size)
        else:
            slots.append(pool.slab_starts[s] + pos)
    slot_mapping = torch.cat(slots)
    key, value = pool.k_cache[slot_mapping].clone(), pool.v_cache[slot_mapping].clone()
    k_cache, v_cache = torch.full_like(pool.k_cache, float("nan")), torch.full_like(pool.v_cache, float("nan"))
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
    untouched[slot_mapping] = False
    if not (k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()):
        return float("inf")
    return max(relative_error(k_cache[slot_mapping], key.double()), relative_error(v_cache[slot_mapping], value.double()))


def copy_case(shape: Shape, dtype: torch.dtype, device, *, seed: int = 0) -> float:
    """:func:`copy_blocks` (copy-on-write) into NaN-poisoned blocks against its reference: 0, or inf when
    a block outside the pairs changed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn((2, 2, 16, shape.block_size, shape.num_kv_heads, shape.head_dim), generator=gen,
                     device=device).to(dtype)
    pairs = torch.tensor([[3, 9], [0, 5], [7, 1], [3, 12]], dtype=torch.int64, device=device)  # a source twice
    kv[:, :, pairs[:, 1]] = float("nan")
    want = kv.clone()
    copy_blocks_ref(want, pairs)
    copy_blocks(kv, pairs)
    if not torch.equal(kv.isnan(), want.isnan()):
        return float("inf")
    return relative_error(kv[:, :, pairs[:, 1]], want[:, :, pairs[:, 1]].double())


# The lengths every check uses: a single-token sequence, lengths off block edges, and one that spans
# three split-K partitions of 512 (the last partial), so the merge kernel combines unequal parts.
DECODE_LENS = [1, 37, 16, 1100]
PREFILL_LENS, PREFILL_NEW = [1, 20, 75, 33], [1, 20, 30, 33]  # the third has 45 cached tokens


def all_cases(device, dtypes=(torch.float32, torch.bfloat16), shape: Shape = Shape(),
              decode_lens=DECODE_LENS, prefill_lens=PREFILL_LENS, prefill_new=PREFILL_NEW) -> list[dict]:
    """Every kernel x layout x dtype (x split-K for decode), with its error and tolerance."""
    rows = []
    dl, pl, pn = list(decode_lens), list(prefill_lens), list(prefill_new)
    for dtype in dtypes:
        for paged in (True, False):
            layout = "paged" if paged else "contiguous"
            rows.append({"kernel": "store_kv", "layout": layout, "dtype": dtype,
                         "error": store_case(dl, shape, paged, dtype, device)})
            for split in (False, True):
                rows.append({"kernel": "decode_attention" + ("_split_k" if split else ""), "layout": layout,
                             "dtype": dtype, "error": decode_case(dl, shape, paged, dtype, device, split_k=split)})
            rows.append({"kernel": "prefill_attention", "layout": layout, "dtype": dtype,
                         "error": prefill_case(pl, pn, shape, paged, dtype, device)})
        rows.append({"kernel": "copy_blocks", "layout": "paged", "dtype": dtype,
                     "error": copy_case(shape, dtype, device)})
    for r in rows:
        r["tolerance"] = TOLERANCE[r["dtype"]]
        r["ok"] = bool(r["error"] < r["tolerance"])
        r["dtype"] = str(r["dtype"]).removeprefix("torch.")
    return rows
