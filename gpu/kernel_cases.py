"""Kernel checks against their PyTorch references on fresh random inputs (the tests and the device check).

Each case builds a pool with shuffled block tables (paged) or spread-out slabs (contiguous), sequence
lengths that are not multiples of the block size, fills the output with NaN before the launch (a row
the kernel forgets stays NaN), and compares with the reference computed in fp64 on the same inputs,
**per sequence**:

    error(s) = RMS(kernel_s - reference_s) / RMS(reference_s)        over sequence s's output rows
    error    = max over sequences

A long sequence's output is small (an average over many values), so an error measured against the
largest output of the batch hides it: a 23 % error on one long sequence passed the old
``max |kernel - reference| / max |reference|``, which each case still reports as ``batch_max_error``
for comparison. A NaN anywhere makes the error infinite.

``broken_case`` feeds the kernel a block table with one wrong entry; it must fail (the check can fail).
``GPU_ONLY`` cases (16k+ contexts, a pool of more than 2^31 elements) are skipped on the CPU, with why.

    python -m gpu.kernel_cases --device cuda --out kernels.json      # all cases, a JSON of rows
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu.attention import (decode_attention, decode_attention_ref, prefill_attention, prefill_attention_ref,
                           sequence_slots)
from gpu.kv_cache import copy_blocks, copy_blocks_ref, store_kv

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


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


@dataclass
class CaseError:
    """Per-sequence RMS relative errors, and the old batch-wide max error for comparison."""

    per_sequence: list[float]
    batch_max_error: float
    extra: dict = field(default_factory=dict)

    @property
    def worst(self) -> float:
        return max(self.per_sequence) if self.per_sequence else 0.0

    def __float__(self) -> float:
        return self.worst


def sequence_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref) over one sequence's rows (ref in fp64); inf if ``out`` holds a NaN; the
    absolute RMS where the reference is all zeros."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    rms = ref.double().pow(2).mean().sqrt()
    err = (out - ref).pow(2).mean().sqrt()
    return float(err / rms) if rms > 0 else float(err)


def batch_max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The old metric: max |out - ref| / max |ref| over the whole batch."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max())


def case_error(out: torch.Tensor, ref: torch.Tensor, rows: list[torch.Tensor]) -> CaseError:
    """Errors of ``out`` against ``ref`` where sequence s owns ``rows[s]`` (indices of the first axis)."""
    per = [sequence_error(out[r], ref[r]) for r in rows]
    allr = torch.cat(rows)
    return CaseError(per, batch_max_error(out[allr], ref[allr]))


def make_pool(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, gen: torch.Generator,
              first_block: int = 0, num_blocks: int | None = None, k_cache: torch.Tensor | None = None,
              v_cache: torch.Tensor | None = None) -> Pool:
    """Random K/V for sequences of ``lens`` tokens, placed in shuffled blocks or in slabs with gaps.

    By default a fresh pool of just enough blocks (plus 3 nobody owns). With ``k_cache``/``v_cache`` (a
    larger pool, e.g. one of more than 2^31 elements), the sequences take shuffled blocks from
    ``first_block`` on, and only those blocks are filled."""
    B = shape.block_size
    blocks = [-(-n // B) for n in lens]
    used = sum(blocks) + 3  # a few blocks nobody owns
    kv_shape = (used * B, shape.num_kv_heads, shape.head_dim)
    fresh_k = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    fresh_v = torch.randn(kv_shape, generator=gen, device=device).to(dtype)
    if k_cache is None:
        k, v = fresh_k, fresh_v
    else:
        k, v = k_cache, v_cache
        k[first_block * B:(first_block + used) * B] = fresh_k
        v[first_block * B:(first_block + used) * B] = fresh_v
    if paged:
        perm = (first_block + torch.randperm(used, generator=gen, device=device)).to(torch.int32)
        tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32, device=device)
        first = np.cumsum([0] + blocks[:-1])
        for s, (f, nb) in enumerate(zip(first, blocks)):
            tables[s, :nb] = perm[f:f + nb]
        return Pool(k, v, tables, None)
    starts, pos = [], first_block * B + 1  # slabs start off block edges, with a slot of gap between them
    for n in lens:
        starts.append(pos)
        pos += n + 1
    assert pos <= (first_block + used) * B
    return Pool(k, v, None, torch.tensor(starts, dtype=torch.int64, device=device))


def _decode_inputs(lens, shape, dtype, device, gen):
    n = len(lens)
    q = torch.randn((n + 2, shape.num_heads, shape.head_dim), generator=gen, device=device).to(dtype)
    query_loc = torch.randperm(n + 2, generator=gen, device=device)[:n].to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, query_loc, seq_lens


def _decode_error(pool: Pool, q, query_loc, seq_lens, lens, shape, split_k, launch_tables=None, **launch) -> CaseError:
    out = torch.full_like(q, float("nan"))
    layout = pool.layout() if launch_tables is None else {"block_tables": launch_tables, "slab_starts": None}
    decode_attention(q, pool.k_cache, pool.v_cache, seq_lens, query_loc, max_seq_len=max(lens),
                     block_size=shape.block_size, out=out, split_k=split_k, **layout, **launch)
    ref = decode_attention_ref(q.double(), pool.k_cache, pool.v_cache, seq_lens, query_loc,
                               block_size=shape.block_size, **pool.layout(), dtype=torch.float64)
    return case_error(out, ref, [query_loc[s:s + 1].long() for s in range(len(lens))])


def decode_case(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *, split_k: bool | None,
                seed: int = 0, **launch) -> CaseError:
    """Error of :func:`decode_attention` (one query per sequence, in shuffled rows of a larger q)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen)
    q, query_loc, seq_lens = _decode_inputs(lens, shape, dtype, device, gen)
    return _decode_error(pool, q, query_loc, seq_lens, lens, shape, split_k, **launch)


def broken_case(lens: list[int], shape: Shape, dtype: torch.dtype, device, *, seed: int = 0) -> CaseError:
    """A deliberately broken launch that the check must catch: the longest sequence's block table has one
    entry pointing at a block nobody owns (stale data: a bug an allocator or a table copy could make).
    One block of keys out of the whole context, on the longest sequence only."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, True, dtype, device, gen)
    q, query_loc, seq_lens = _decode_inputs(lens, shape, dtype, device, gen)
    owned = set(pool.block_tables.flatten().tolist())
    spare = next(b for b in range(pool.k_cache.shape[0] // shape.block_size) if b not in owned)
    longest = int(np.argmax(lens))
    wrong = pool.block_tables.clone()
    wrong[longest, (-(-lens[longest] // shape.block_size)) // 2] = spare
    return _decode_error(pool, q, query_loc, seq_lens, lens, shape, None, launch_tables=wrong)


def prefill_case(lens: list[int], num_new: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *,
                 seed: int = 0, pool_args: dict | None = None, **launch) -> CaseError:
    """Error of :func:`prefill_attention`: sequence s has ``lens[s]`` tokens of which the last
    ``num_new[s]`` are queries (the rest cached context). ``launch``: split_k, partition_size, ..."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen, **(pool_args or {}))
    total = sum(num_new)
    q = torch.randn((total, shape.num_heads, shape.head_dim), generator=gen, device=device).to(dtype)
    starts = np.cumsum([0] + num_new[:-1])
    query_start = torch.tensor(starts, dtype=torch.int32, device=device)
    new = torch.tensor(num_new, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, pool.k_cache, pool.v_cache, query_start, new, seq_lens, max_num_new=max(num_new),
                      block_size=shape.block_size, out=out, max_seq_len=max(lens), **pool.layout(), **launch)
    ref = prefill_attention_ref(q.double(), pool.k_cache, pool.v_cache, query_start, new, seq_lens,
                                block_size=shape.block_size, **pool.layout(), dtype=torch.float64)
    return case_error(out, ref, [torch.arange(a, a + n, device=device) for a, n in zip(starts.tolist(), num_new)])


def window_case(lens: list[int], num_new: list[int] | None, window: int, shape: Shape, paged: bool,
                dtype: torch.dtype, device, *, seed: int = 0, launch_window: int | None = None,
                **launch) -> CaseError:
    """Error of a sliding-``window`` launch (decode when ``num_new`` is None, else prefill of the last
    ``num_new[s]`` tokens) against the windowed reference on the intact pool, with every key no query of
    its sequence may see **poisoned with NaN** before the launch, and (paged) each block wholly before
    the window dropped from the table: its entry points at a spare NaN block. A kernel that reads any of
    them returns NaN (error inf). ``launch_window``: give the kernel another window (a check that fails)."""
    launch_window = window if launch_window is None else launch_window
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen)
    B = shape.block_size
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    layout = pool.layout()
    if num_new is None:
        q, query_loc, _ = _decode_inputs(lens, shape, dtype, device, gen)
        ref = decode_attention_ref(q.double(), pool.k_cache, pool.v_cache, seq_lens, query_loc, block_size=B,
                                   **layout, dtype=torch.float64, window=window)
        first_query = list(lens)  # the decode query sits at position len - 1: first visible key len - window
        rows = [query_loc[s:s + 1].long() for s in range(len(lens))]
    else:
        q = torch.randn((sum(num_new), shape.num_heads, shape.head_dim), generator=gen, device=device).to(dtype)
        starts = np.cumsum([0] + num_new[:-1])
        query_start = torch.tensor(starts, dtype=torch.int32, device=device)
        new = torch.tensor(num_new, dtype=torch.int32, device=device)
        ref = prefill_attention_ref(q.double(), pool.k_cache, pool.v_cache, query_start, new, seq_lens,
                                    block_size=B, **layout, dtype=torch.float64, window=window)
        first_query = [n - k + 1 for n, k in zip(lens, num_new)]
        rows = [torch.arange(a, a + n, device=device) for a, n in zip(starts.tolist(), num_new)]
    tables = pool.block_tables.clone() if paged else None
    used = set(tables.flatten().tolist()) if paged else set()
    spare = next((b for b in range(pool.k_cache.shape[0] // B) if b not in used), None)
    for s, n in enumerate(lens):
        lo = max(first_query[s] - window, 0)  # keys 0 .. lo-1 are invisible to every query of s
        if lo:
            slots = sequence_slots(s, lo, B, pool.block_tables, pool.slab_starts)
            pool.k_cache[slots] = float("nan")
            pool.v_cache[slots] = float("nan")
        if paged and lo // B:
            tables[s, :lo // B] = spare
    if paged:
        pool.k_cache[spare * B:(spare + 1) * B] = float("nan")
        pool.v_cache[spare * B:(spare + 1) * B] = float("nan")
        layout = {"block_tables": tables, "slab_starts": None}
    out = torch.full_like(q, float("nan"))
    if num_new is None:
        decode_attention(q, pool.k_cache, pool.v_cache, seq_lens, query_loc, max_seq_len=max(lens), block_size=B,
                         out=out, window=launch_window, **layout, **launch)
    else:
        prefill_attention(q, pool.k_cache, pool.v_cache, query_start, new, seq_lens, max_num_new=max(num_new),
                          block_size=B, out=out, max_seq_len=max(lens), window=launch_window, **layout, **launch)
    return case_error(out, ref, rows)


def store_case(lens: list[int], shape: Shape, paged: bool, dtype: torch.dtype, device, *, seed: int = 0,
               pool_args: dict | None = None) -> CaseError:
    """:func:`store_kv` of every token of the sequences (and two padded tokens, slot -1) into a
    NaN-poisoned pool: the error of the stored slots (a plain copy: 0), or inf when a slot outside the
    mapping was written."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = make_pool(lens, shape, paged, dtype, device, gen, **(pool_args or {}))
    slots = []
    for s, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        if paged:
            slots.append(pool.block_tables[s, pos // shape.block_size].long() * shape.block_size + pos % shape.block_size)
        else:
            slots.append(pool.slab_starts[s] + pos)
    pad = torch.full((2,), -1, dtype=torch.int64, device=device)
    slot_mapping = torch.cat(slots + [pad])
    real = slot_mapping[:-2]
    key, value = pool.k_cache[real].clone(), pool.v_cache[real].clone()
    key = torch.cat([key, torch.randn_like(key[:2].float()).to(dtype)])  # padded rows: never stored
    value = torch.cat([value, torch.randn_like(value[:2].float()).to(dtype)])
    if pool_args:  # a shared large pool: poison only its used region
        lo = int(real.min()) // shape.block_size * shape.block_size
        hi = (int(real.max()) // shape.block_size + 1) * shape.block_size
        k_cache, v_cache = pool.k_cache, pool.v_cache
        k_cache[lo:hi] = float("nan")
        v_cache[lo:hi] = float("nan")
        region = slice(lo, hi)
    else:
        k_cache, v_cache = torch.full_like(pool.k_cache, float("nan")), torch.full_like(pool.v_cache, float("nan"))
        region = slice(0, k_cache.shape[0])
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=device)
    untouched[real] = False
    untouched[:region.start] = False
    untouched[region.stop:] = False
    if not (k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()):
        return CaseError([math.inf], math.inf, {"wrote_outside_mapping": True})
    rows, offset = [], 0
    for n in lens:
        rows.append(torch.arange(offset, offset + n, device=device))
        offset += n
    ek = case_error(k_cache[real], key[:-2].double(), rows)
    ev = case_error(v_cache[real], value[:-2].double(), rows)
    return CaseError([max(a, b) for a, b in zip(ek.per_sequence, ev.per_sequence)],
                     max(ek.batch_max_error, ev.batch_max_error))


def copy_case(shape: Shape, dtype: torch.dtype, device, *, seed: int = 0) -> CaseError:
    """:func:`copy_blocks` (copy-on-write) into NaN-poisoned blocks against its reference: 0 per pair, or
    inf when a block outside the pairs changed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn((2, 2, 16, shape.block_size, shape.num_kv_heads, shape.head_dim), generator=gen,
                     device=device).to(dtype)
    pairs = torch.tensor([[3, 9], [0, 5], [7, 1], [3, 12]], dtype=torch.int64, device=device)  # a source twice
    kv[:, :, pairs[:, 1]] = float("nan")
    want = kv.clone()
    copy_blocks_ref(want, pairs)
    copy_blocks(kv, pairs)
    if not torch.equal(kv.isnan(), want.isnan()):
        return CaseError([math.inf], math.inf, {"wrote_outside_pairs": True})
    got, ref = kv[:, :, pairs[:, 1]].movedim(2, 0), want[:, :, pairs[:, 1]].movedim(2, 0).double()
    return case_error(got, ref, [torch.tensor([i], device=device) for i in range(pairs.shape[0])])


def high_pool_cases(dtype: torch.dtype, device) -> list[tuple[str, CaseError]]:
    """Block ids near the top of a pool of more than 2^31 elements per K (and V) tensor (Llama-3-8B heads:
    8 x 128 per slot, blocks of 16 -> 131,136 blocks, 4.3 GB each in bf16): any 32-bit offset product
    wraps and reads the wrong slots (or faults). Decode (one pass and split-K), prefill, store_kv."""
    shape = Shape(32, 8, 128, 16)
    per_block = shape.block_size * shape.num_kv_heads * shape.head_dim
    num_blocks = (1 << 31) // per_block + 64
    kv = torch.empty((2, num_blocks * shape.block_size, shape.num_kv_heads, shape.head_dim), dtype=dtype,
                     device=device)
    kv.fill_(float("nan"))
    k, v = kv[0], kv[1]
    assert k.numel() > 1 << 31
    lens, news = [300, 700], [300, 40]
    first = num_blocks - (sum(-(-n // 16) for n in lens) + 3)
    args = {"first_block": first, "k_cache": k, "v_cache": v}
    rows = []
    for paged in (True, False):
        layout = "paged" if paged else "contiguous"
        for split in (False, True):
            gen = torch.Generator(device=device).manual_seed(11)
            pool = make_pool(lens, shape, paged, dtype, device, gen, **args)
            q, loc, sl = _decode_inputs(lens, shape, dtype, device, gen)
            rows.append((f"decode_attention{'_split_k' if split else ''}/{layout}",
                         _decode_error(pool, q, loc, sl, lens, shape, split)))
        rows.append((f"prefill_attention/{layout}", prefill_case(lens, news, shape, paged, dtype, device, seed=12,
                                                                 pool_args=args)))
        rows.append((f"store_kv/{layout}", store_case(lens, shape, paged, dtype, device, seed=13, pool_args=args)))
    del kv, k, v
    return rows


# The lengths every check uses: a single-token sequence, lengths off block edges, and one that spans
# three split-K partitions of 512 (the last partial), so the merge kernel combines unequal parts.
DECODE_LENS = [1, 37, 16, 1100]
PREFILL_LENS, PREFILL_NEW = [1, 20, 75, 33], [1, 20, 30, 33]  # the third has 45 cached tokens
# Chunks over longer cached contexts, split over keys into partitions of 48 (the last partial).
SPLIT_PREFILL_LENS, SPLIT_PREFILL_NEW, SPLIT_PARTITION = [150, 40], [8, 5], 48
# GPU only: contexts of 16k and 33k tokens (33 and 65 split-K partitions: the merge loops over its
# 16-partition chunks), and a 64-token chunk over 16k cached tokens (split over keys by the heuristic).
LONG_DECODE_LENS = [1, 16411, 33000]
LONG_PREFILL_LENS, LONG_PREFILL_NEW = [16411, 300], [64, 300]
GPU_ONLY_REASON = ("GPU only: contexts of 16k-33k tokens and a pool of more than 2^31 elements (8.6 GB) take "
                   "minutes and gigabytes under the CPU interpreter")


@dataclass(frozen=True)
class Settings:
    dtypes: tuple = (torch.float32, torch.bfloat16)
    shape: Shape = Shape()
    decode_lens: tuple = tuple(DECODE_LENS)
    store_lens: tuple = tuple(DECODE_LENS)  # store_kv runs one program per token: slow under the interpreter
    prefill_lens: tuple = tuple(PREFILL_LENS)
    prefill_new: tuple = tuple(PREFILL_NEW)
    block_sizes: tuple = (8, 32)  # besides the shape's own (16): paged decode, prefill, store
    block_size_lens: tuple = (1, 37, 130)
    gpu_only: bool = False  # long contexts and the > 2^31-element pool
    quick: bool = False  # paged only, no no-prefetch variant (the CPU tests of the check itself)


def _row(kernel: str, layout: str, dtype: torch.dtype, err: CaseError, **extra) -> dict:
    tol = TOLERANCE[dtype]
    return {"kernel": kernel, "layout": layout, "dtype": str(dtype).removeprefix("torch."), **extra,
            "error": err.worst, "per_sequence": err.per_sequence, "batch_max_error": err.batch_max_error,
            "tolerance": tol, "ok": bool(err.worst < tol), **err.extra}


def all_cases(device, settings: Settings = Settings(), progress=None) -> list[dict]:
    """Every kernel x layout x dtype (x split-K), block sizes, the broken case (``must_fail``: ok when it
    fails) and, on a GPU, the long-context and large-pool cases (else rows with ``skipped``)."""
    device = torch.device(device)
    s = settings
    dl, pl, pn = list(s.decode_lens), list(s.prefill_lens), list(s.prefill_new)
    rows = []

    def add(row):
        rows.append(row)
        if progress:
            progress(row)

    def main_cases(dtype):
        for paged in ((True,) if s.quick else (True, False)):
            layout = "paged" if paged else "contiguous"
            add(_row("store_kv", layout, dtype, store_case(list(s.store_lens), s.shape, paged, dtype, device)))
            for split in (False, True):
                add(_row("decode_attention" + ("_split_k" if split else ""), layout, dtype,
                         decode_case(dl, s.shape, paged, dtype, device, split_k=split)))
            add(_row("prefill_attention", layout, dtype, prefill_case(pl, pn, s.shape, paged, dtype, device)))
            add(_row("prefill_attention_split_keys", layout, dtype,
                     prefill_case(SPLIT_PREFILL_LENS, SPLIT_PREFILL_NEW, s.shape, paged, dtype, device, seed=6,
                                  split_k=True, partition_size=SPLIT_PARTITION)))
        add(_row("copy_blocks", "paged", dtype, copy_case(s.shape, dtype, device)))
        for bs in s.block_sizes:
            shape = Shape(s.shape.num_heads, s.shape.num_kv_heads, s.shape.head_dim, bs)
            bl = list(s.block_size_lens)
            for split in (False, True):
                add(_row("decode_attention" + ("_split_k" if split else ""), "paged", dtype,
                         decode_case(bl, shape, True, dtype, device, split_k=split, seed=7), block_size=bs))
            new = [n if i % 2 == 0 else max(1, n // 2) for i, n in enumerate(bl)]  # whole prompts and chunks
            add(_row("prefill_attention", "paged", dtype, prefill_case(bl, new, shape, True, dtype, device, seed=8),
                     block_size=bs))
            add(_row("store_kv", "paged", dtype, store_case(bl, shape, True, dtype, device, seed=9), block_size=bs))
        if not s.quick:  # paged decode with the block ids loaded in the same iteration: the same function
            add(_row("decode_attention_no_prefetch", "paged", dtype,
                     decode_case(dl, s.shape, True, dtype, device, split_k=False, prefetch=False)))

    def broken():
        row = _row("broken: wrong block-table entry", "paged", torch.bfloat16,
                   broken_case(dl, s.shape, torch.bfloat16, device, seed=10), must_fail=True)
        row["ok"] = not row["ok"]  # it passes only by failing
        row["caught"] = row["ok"]
        add(row)

    def long_cases(dtype):
        shape = Shape(32, 8, 128, 16)
        for paged in (True, False):
            layout = "paged" if paged else "contiguous"
            for split in (None, True):
                add(_row(f"decode_attention{'_split_k' if split else ''} (16k-33k)", layout, dtype,
                         decode_case(LONG_DECODE_LENS, shape, paged, dtype, device, split_k=split, seed=14)))
            add(_row("prefill_attention over 16k cached", layout, dtype,
                     prefill_case(LONG_PREFILL_LENS, LONG_PREFILL_NEW, shape, paged, dtype, device, seed=15)))

    # the first dtype's cases, the broken one and (on a GPU) the long and large-pool ones first: on a GPU
    # the first is bf16, what serving runs, so a cut-short check still has what matters most
    for i, dtype in enumerate(s.dtypes):
        main_cases(dtype)
        if i == 0:
            broken()
        if s.gpu_only:
            long_cases(dtype)
            if dtype == torch.bfloat16:
                for name, err in high_pool_cases(dtype, device):
                    kernel, layout = name.split("/")
                    add(_row(kernel + " (pool > 2^31 elements)", layout, dtype, err))
    if not s.gpu_only:
        for name in ("decode_attention (16k-33k)", "decode_attention_split_k (16k-33k)",
                     "prefill_attention over 16k cached", "pool > 2^31 elements"):
            add({"kernel": name, "skipped": GPU_ONLY_REASON, "ok": None})
    return rows


def settings_for(device: torch.device, quick: bool = False) -> Settings:
    """The device check's cases: Llama-3-8B heads and a 2100-token context on a GPU (plus the GPU-only
    cases); small heads and a 600-token context under the CPU interpreter; ``quick`` (CPU, the tests of
    the check itself): bf16 only, one block size, shorter sequences."""
    if quick:
        return Settings(dtypes=(torch.bfloat16,), shape=Shape(4, 1, 16), decode_lens=(1, 37, 530),
                        prefill_lens=(1, 20, 45), prefill_new=(1, 20, 12), store_lens=(1, 37), block_sizes=(8,),
                        block_size_lens=(1, 37), quick=True)
    if device.type == "cuda":
        return Settings(dtypes=(torch.bfloat16, torch.float32), shape=Shape(32, 8, 128), decode_lens=(1, 37, 16, 2100),
                        store_lens=(1, 37, 16, 2100), gpu_only=True)
    return Settings(shape=Shape(8, 2, 32), decode_lens=(1, 37, 16, 600), store_lens=(1, 37, 16, 130))


def failed(rows: list[dict]) -> list[dict]:
    """The rows that did not pass (skipped rows aside)."""
    return [r for r in rows if r.get("ok") is False]


def main(argv: list[str] | None = None) -> int:
    """Run every case on ``--device`` and write the rows as JSON (``--out``), one line per case on stdout.
    The device check runs this in a process of its own, so a fault in a kernel cannot take down the rest."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller cases (the CPU tests of the check)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        from gpu.kv_cache import interpreting

        if not interpreting():
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 set before Python starts")
    rows: list[dict] = []
    t0 = time.perf_counter()

    def progress(row):
        rows.append(row)
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": rows, "complete": False}, f, default=str)
        os.replace(tmp, a.out)
        state = "skipped" if row.get("skipped") else ("ok" if row["ok"] else "FAILED")
        err = "" if row.get("skipped") else f" error {row['error']:.2e}"
        print(f"[{time.perf_counter() - t0:6.1f} s] {row['kernel']} {row.get('layout', '')} {row.get('dtype', '')}"
              f"{err} {state}", flush=True)

    all_cases(device, settings_for(device, a.quick), progress=progress)
    with open(a.out + ".tmp", "w") as f:
        json.dump({"rows": rows, "complete": True}, f, default=str)
    os.replace(a.out + ".tmp", a.out)
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
