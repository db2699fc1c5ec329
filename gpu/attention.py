"""Attention over the KV pool: decode (paged or contiguous, optionally split-K) and prefill, each a
Triton kernel with a PyTorch reference beside it.

Every kernel reads keys and values from a ``[num_slots, H_kv, D]`` view of the pool (see ``kv_cache``)
and finds a sequence's token ``p`` at::

    PAGED:      slot = block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
    contiguous: slot = slab_start + p

which is the only difference between the paged kernel and the contiguous baseline (``PAGED`` is a
constexpr, so each is compiled on its own and the comparison measures exactly what paging costs).

Grouped-query attention: one program owns one (sequence, KV head) and all ``G = H / H_kv`` query heads
that share it, so each K/V tile is loaded once for the group. Decode pads the group to 16 rows (the
smallest ``tl.dot``); prefill packs ``BLOCK_M`` rows as (query token, head in group) pairs::

    row r of a prefill tile  ->  token  q_block * (BLOCK_M // G) + r // G,   head  kv_head * G + r % G

Softmax is online (running max and sum, rescaled per tile), in base 2 with the log2(e) folded into the
scale. Split-K decode cuts a long context into ``PARTITION_SIZE``-token partitions (vLLM's "v2": 512),
each program writing an unnormalised partial result with its max and sum; a second kernel merges them.

Sliding window (``window`` W > 0, a layer's ``sliding_window``): the query at position p sees keys
p - W + 1 .. p (W keys, itself included: Hugging Face's and vLLM's convention). Each key loop starts at
the first block holding a visible key (earlier blocks are never read, so a window layer's block table
may drop them) and masks the keys before the window inside that block. ``window = 0``: full attention.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu.kv_cache import check_head_major, check_launch, interpreting

# In the kernels: scores are scaled by log2(e) = 1.4426950408889634 (softmax by exp2), and the running max
# starts at -1e30, finite, so a fully masked tile gives exp2(-inf) = 0, never NaN (written out: a kernel reads
# no Python global that is not a constexpr)
PARTITION_SIZE = 512
# Software pipeline depth of the 16-bit decode kernel on a GPU. Measured on an H200 (64 sequences x 4k keys,
# bf16, 64 keys per tile, 4 warps; reports/device_check_run1.json): 2 stages 239 us contiguous / 242 us paged
# with block ids prefetched, against Triton's default 3 stages 273 / 291 us and 1 stage 258 / 434 us. Over
# the 30 shapes of reports/device_check.json, paged runs faster at 2 stages at 23 and contiguous at 3 stages
# at 19 (by a median 2 %): no depth is best everywhere (README, GPU figures).
DECODE_NUM_STAGES = 2


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # NOTE: Triton's CPU interpreter multiplies the raw bits of bfloat16 operands (triton-lang/triton#11584,
    # unsupported upstream), so under the interpreter both operands go to fp32 first. Products of bf16
    # values are exact in fp32, so this matches what tensor cores compute; on a GPU UPCAST is False.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _cast(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``x`` to ``dtype``. NOTE: Triton's CPU interpreter truncates fp32 -> bf16 where a GPU rounds to
    nearest even (a bias of -2^-9 relative: it doubles a bf16 kernel's error against its reference), so
    under the interpreter (UPCAST) the rounding is done here first; on a GPU this is a plain cast."""
    if UPCAST:
        if dtype == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            x = b.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _token_slots(offs, block_table_row_ptr, slab_start, mask, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Slots (int64) of token positions ``offs`` of one sequence."""
    if PAGED:
        block_id = tl.load(block_table_row_ptr + offs // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        return block_id * BLOCK_SIZE + offs % BLOCK_SIZE
    else:
        return slab_start + offs


@triton.jit
def _attend_tile(q, m_i, l_i, acc, slots, n_mask, visible, k_cache_ptr, v_cache_ptr, kv_head, d, d_mask, stride_cs,
                 stride_ch, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (pool ``slots`` [BLOCK_N] int64, present where ``n_mask``) for the query rows
    ``q``: load K and V, mask what each row may not see (``visible`` [rows, BLOCK_N]), and fold the tile
    into the running max ``m_i``, sum ``l_i`` and output ``acc`` (base-2 online softmax)."""
    kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * qk_scale  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(_cast(p, v.dtype, UPCAST), v, UPCAST, PRECISION)
    return m_new, l_i, acc


# ------------------------------------------------------------------------------------------ decode


@triton.jit(do_not_specialize=["window", "stride_bt", "stride_ps", "stride_ph", "stride_ms", "stride_mh"])
def _decode_attention_kernel(
    q_ptr,  # [num_tokens, H, D]: the query of sequence s is row query_loc[s]
    k_cache_ptr,  # [num_slots, H_kv, D]
    v_cache_ptr,  # [num_slots, H_kv, D]
    out_ptr,  # [num_tokens, H, D] (written when PARTITION_SIZE == 0)
    part_out_ptr,  # [num_seqs, H, max_num_partitions, D] fp32 (PARTITION_SIZE > 0)
    part_max_ptr,  # [num_seqs, H, max_num_partitions] fp32, log2 domain
    part_sum_ptr,  # [num_seqs, H, max_num_partitions] fp32
    query_loc_ptr,  # [num_seqs] int32
    seq_lens_ptr,  # [num_seqs] int32: keys each query attends to (cached tokens + itself)
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32 (PAGED)
    slab_starts_ptr,  # [num_seqs] int64 (not PAGED)
    sm_scale,
    window,  # keys visible to the query (sliding window), 0: all
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
    stride_ps, stride_ph, stride_ms, stride_mh,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr = True,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # first visible key (sliding window), and the loop's start: the first block holding it
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    if PARTITION_SIZE > 0:
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
    else:
        start = 0
        end = seq_len
    start = tl.maximum(start, (lo // BLOCK_SIZE) * BLOCK_SIZE)
    row = tl.load(query_loc_ptr + seq).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * NUM_QUERIES_PER_KV + g
    g_mask = g < NUM_QUERIES_PER_KV
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    slab_start = 0
    if not PAGED:
        slab_start = tl.load(slab_starts_ptr + seq)

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    # Paged with PREFETCH: the next tile's block ids are loaded one iteration ahead, so a tile's K/V
    # addresses never wait on a block-table load issued in the same iteration.
    offs = start + tl.arange(0, BLOCK_N)
    ids = tl.zeros([BLOCK_N], dtype=tl.int32)
    if PAGED and PREFETCH:
        ids = tl.load(block_table_row + offs // BLOCK_SIZE, mask=(offs < end) & (offs >= lo), other=0)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs < end) & (offs >= lo)
        if PAGED and PREFETCH:
            slots = ids.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
            nxt = offs + BLOCK_N
            ids = tl.load(block_table_row + nxt // BLOCK_SIZE, mask=nxt < end, other=0)
        else:
            slots = _token_slots(offs, block_table_row, slab_start, n_mask, BLOCK_SIZE, PAGED)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, slots, n_mask, n_mask[None, :], k_cache_ptr, v_cache_ptr,
                                     kv_head, d, d_mask, stride_cs, stride_ch, qk_scale, UPCAST, PRECISION)

    if PARTITION_SIZE > 0:
        base = seq.to(tl.int64) * stride_ps + head * stride_ph + part
        tl.store(part_out_ptr + base[:, None] * BLOCK_D + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        mbase = seq.to(tl.int64) * stride_ms + head * stride_mh + part
        tl.store(part_max_ptr + mbase, m_i, mask=g_mask)
        tl.store(part_sum_ptr + mbase, l_i, mask=g_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :],
                 _cast(out, out_ptr.dtype.element_ty, UPCAST), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["stride_ps", "stride_ph", "stride_ms", "stride_mh"])
def _decode_reduce_kernel(
    out_ptr,  # [num_tokens, H, D]
    part_out_ptr,  # [num_seqs, H, max_num_partitions, D] fp32
    part_max_ptr,  # [num_seqs, H, max_num_partitions] fp32
    part_sum_ptr,  # [num_seqs, H, max_num_partitions] fp32
    query_loc_ptr,  # [num_seqs] int32
    seq_lens_ptr,  # [num_seqs] int32
    stride_ot, stride_oh, stride_ps, stride_ph, stride_ms, stride_mh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (sequence, query head): merge its partitions' partial softmaxes."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m_run = tl.full([1], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = seq.to(tl.int64) * stride_ms + head * stride_mh
    obase = seq.to(tl.int64) * stride_ps + head * stride_ph
    for p0 in range(0, num_parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_mask = p < num_parts
        m_p = tl.load(part_max_ptr + base + p, mask=p_mask, other=float("-inf"))
        l_p = tl.load(part_sum_ptr + base + p, mask=p_mask, other=0.0)
        acc_p = tl.load(part_out_ptr + (obase + p)[:, None] * BLOCK_D + d[None, :],
                        mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_p, 0))
        scale = tl.exp2(m_p - m_new)
        alpha = tl.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.sum(l_p * scale, 0)
        acc = acc * alpha + tl.sum(acc_p * scale[:, None], 0)
        m_run = m_new
    row = tl.load(query_loc_ptr + seq).to(tl.int64)
    out = acc / l_run
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, _cast(out, out_ptr.dtype.element_ty, UPCAST), mask=d_mask)


def _layout_args(num_seqs: int, block_tables: torch.Tensor | None, slab_starts: torch.Tensor | None,
                 seq_lens: torch.Tensor, block_size: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """(block_tables, slab_starts, block-table row stride, paged): the unused one is a placeholder. A block
    table must be wide enough for ``max_seq_len`` tokens: a kernel would read past its row otherwise."""
    if (block_tables is None) == (slab_starts is None):
        raise ValueError("give exactly one of block_tables (paged) or slab_starts (contiguous)")
    if block_tables is not None:
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs \
                or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables must be int32 [num_seqs={num_seqs}, max_num_blocks] with contiguous rows")
        if num_seqs and block_tables.shape[1] * block_size < max_seq_len:
            raise ValueError(f"block_tables has {block_tables.shape[1]} columns: {block_tables.shape[1]} x block_size "
                             f"{block_size} = {block_tables.shape[1] * block_size} slots, fewer than max_seq_len "
                             f"{max_seq_len}")
        return block_tables, seq_lens, block_tables.stride(0), True
    if slab_starts.dtype != torch.int64 or slab_starts.shape != (num_seqs,):
        raise ValueError(f"slab_starts must be int64 [num_seqs={num_seqs}]")
    return seq_lens, slab_starts, 0, False


def _check_bound(name: str, values: torch.Tensor, bound: int) -> None:
    """A host bound the caller gives (``max_seq_len``, ``max_num_new``) must cover every value: a kernel
    sized by it would skip the keys or queries past it, silently. Checked where that costs no device sync
    (CPU tensors, the interpreter's); on a GPU the caller's bound is trusted (the replay executor derives it
    from the same host lists as the tensors)."""
    if values.device.type == "cpu" and values.numel() and int(values.max()) > bound:
        raise ValueError(f"{name} {bound} is below the largest value it bounds, {int(values.max())}")


def _check_attention_args(name: str, q, k_cache, v_cache, out, seq_lens, query_loc) -> tuple[int, int]:
    for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        check_head_major(f"{name}: {n}", t)
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache differ in shape or strides")
    if not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        raise ValueError(f"{name}: dtypes differ (q {q.dtype}, cache {k_cache.dtype}, out {out.dtype})")
    if out.shape != q.shape or q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, out {tuple(out.shape)}, cache {tuple(k_cache.shape)}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{name}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for n, t in (("seq_lens", seq_lens), ("query_loc", query_loc)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name}: {n} must be a 1-d int32 tensor")
    return num_heads, num_kv_heads


def _check_window(name: str, window: int) -> int:
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{name}: window must be a non-negative int (0: full attention), got {window!r}")
    return window


def _dot_args(dtype: torch.dtype) -> dict:
    """Dot-product options and, for fp32, one pipeline stage: fp32 tiles with Triton's default stages
    need up to 180 KB of shared memory (more than an A100's 164 KB); bf16 ones need at most 41 KB."""
    opts = {"UPCAST": interpreting(), "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    if dtype == torch.float32:
        opts["num_stages"] = 1
    return opts


def use_split_k(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> bool:
    """Split-K pays when one program per (sequence, KV head) leaves most of the GPU idle on a long context."""
    if max_seq_len <= PARTITION_SIZE:
        return False
    if device.type != "cuda":
        return num_seqs * num_kv_heads < 8
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return num_seqs * num_kv_heads < 2 * sms


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     query_loc: torch.Tensor, *, max_seq_len: int, block_size: int,
                     block_tables: torch.Tensor | None = None, slab_starts: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, sm_scale: float | None = None, split_k: bool | None = None,
                     block_n: int = 64, num_warps: int | None = None, num_stages: int | None = None,
                     prefetch: bool = True, window: int = 0) -> torch.Tensor:
    """One query token per sequence (row ``query_loc[s]`` of ``q`` [num_tokens, H, D]) against its first
    ``seq_lens[s]`` cached tokens, read through ``block_tables`` (paged) or from ``slab_starts``
    (contiguous). Writes rows ``query_loc`` of ``out``; ``max_seq_len`` (a host int, at least every
    ``seq_lens[s]``) sizes the grid. ``block_n`` keys per tile, ``num_warps``, ``num_stages`` (software
    pipeline depth; when None, ``DECODE_NUM_STAGES`` for 16-bit caches on a GPU, else Triton's default)
    and ``prefetch`` (paged: load the next tile's block ids one iteration ahead) are launch choices the
    device check sweeps. ``window`` > 0: a sliding-window
    layer's (each query sees its last ``window`` keys; blocks wholly before them are never read)."""
    out = torch.empty_like(q) if out is None else out
    window = _check_window("decode_attention", window)
    num_heads, num_kv_heads = _check_attention_args("decode_attention", q, k_cache, v_cache, out, seq_lens, query_loc)
    num_seqs = seq_lens.shape[0]
    if query_loc.shape != (num_seqs,):
        raise ValueError("decode_attention: query_loc needs one row per sequence")
    _check_bound("decode_attention: max_seq_len", seq_lens, max_seq_len)
    tables, slabs, stride_bt, paged = _layout_args(num_seqs, block_tables, slab_starts, seq_lens, block_size,
                                                   max_seq_len)
    check_launch("decode_attention", q, k_cache, v_cache, out, seq_lens, query_loc, tables, slabs)
    if num_seqs == 0:
        return out
    head_dim = q.shape[2]
    group = num_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if split_k is None:
        split_k = use_split_k(num_seqs, num_kv_heads, max_seq_len, q.device)
    block_d = triton.next_power_of_2(head_dim)
    common = dict(NUM_QUERIES_PER_KV=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                  BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged, PREFETCH=prefetch,
                  **_dot_args(q.dtype))
    if num_warps is not None:
        common["num_warps"] = num_warps
    if num_stages is not None:
        common["num_stages"] = num_stages
    elif q.device.type == "cuda" and q.dtype != torch.float32:
        common["num_stages"] = DECODE_NUM_STAGES
    if not split_k:
        _decode_attention_kernel[(num_seqs, num_kv_heads, 1)](
            q, k_cache, v_cache, out, out, seq_lens, seq_lens, query_loc, seq_lens, tables, slabs, sm_scale, window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), stride_bt,
            0, 0, 0, 0, PARTITION_SIZE=0, **common)
        return out
    num_parts = triton.cdiv(max_seq_len, PARTITION_SIZE)
    part_out = torch.empty((num_seqs, num_heads, num_parts, block_d), device=q.device, dtype=torch.float32)
    part_max = torch.empty((num_seqs, num_heads, num_parts), device=q.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, out, part_out, part_max, part_sum, query_loc, seq_lens, tables, slabs, sm_scale, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), stride_bt,
        part_out.stride(0) // block_d, part_out.stride(1) // block_d, part_max.stride(0), part_max.stride(1),
        PARTITION_SIZE=PARTITION_SIZE, **common)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        out, part_out, part_max, part_sum, query_loc, seq_lens,
        out.stride(0), out.stride(1), part_out.stride(0) // block_d, part_out.stride(1) // block_d,
        part_max.stride(0), part_max.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PARTITION_SIZE=PARTITION_SIZE, BLOCK_P=16,
        UPCAST=interpreting())
    return out


# ------------------------------------------------------------------------------------------ prefill


@triton.jit(do_not_specialize=["window", "stride_bt", "part_size", "num_parts", "max_num_new"])
def _prefill_attention_kernel(
    q_ptr,  # [num_tokens, H, D]: sequence s owns rows query_start[s] .. + num_new[s]
    k_cache_ptr,  # [num_slots, H_kv, D] (the new tokens' K/V already stored)
    v_cache_ptr,  # [num_slots, H_kv, D]
    out_ptr,  # [num_tokens, H, D] (written when not SPLIT)
    part_out_ptr,  # [num_seqs, max_num_new, H, num_parts, BLOCK_D] fp32 (SPLIT)
    part_max_ptr,  # [num_seqs, max_num_new, H, num_parts] fp32, log2 domain (SPLIT)
    part_sum_ptr,  # [num_seqs, max_num_new, H, num_parts] fp32 (SPLIT)
    query_start_ptr,  # [num_seqs] int32
    num_new_ptr,  # [num_seqs] int32: new tokens (queries) of the sequence
    seq_lens_ptr,  # [num_seqs] int32: cached + new tokens
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32 (PAGED)
    slab_starts_ptr,  # [num_seqs] int64 (not PAGED)
    sm_scale,
    window,  # keys visible to each query (sliding window), 0: all
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ch, stride_bt,
    part_size, num_parts, max_num_new,
    NUM_QUERIES_PER_KV: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Causal attention of ``BLOCK_Q`` new tokens (x all G heads of one KV head) over the sequence's cache:
    query token i (position num_cached + i) sees keys 0 .. num_cached + i. SPLIT (a split over keys, for
    a short chunk over a long cached context): program axis 2 is (query block, key partition of
    ``part_size`` keys); each writes its unnormalised partial output, max and sum, merged by
    ``_prefill_reduce_kernel``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:
        q_block = tl.program_id(2) // num_parts
        part = tl.program_id(2) % num_parts
    else:
        q_block = tl.program_id(2)
        part = 0
    num_new = tl.load(num_new_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - num_new
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + r // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + r % NUM_QUERIES_PER_KV
    row_mask = (r < BLOCK_Q * NUM_QUERIES_PER_KV) & (tok < num_new)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    pos = num_cached + tok  # absolute position of each row's query token
    qk_scale = sm_scale * 1.4426950408889634
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    slab_start = 0
    if not PAGED:
        slab_start = tl.load(slab_starts_ptr + seq)
    # keys up to the last query of this tile; none when the tile holds no query
    kv_end = tl.minimum(seq_len, num_cached + (q_block + 1) * BLOCK_Q)
    kv_end = tl.where(q_block * BLOCK_Q < num_new, kv_end, 0)
    kv_start = 0
    if SPLIT:
        kv_start = part * part_size
        kv_end = tl.minimum(kv_end, kv_start + part_size)
    # sliding window: the tile's first query (position num_cached + q_block * BLOCK_Q) sees keys from
    # lo_tile on; the loop starts at the block holding it, each row masks its own window below
    lo_tile = tl.where(window > 0, tl.maximum(num_cached + q_block * BLOCK_Q - window + 1, 0), 0)
    kv_start = tl.maximum(kv_start, (lo_tile // BLOCK_SIZE) * BLOCK_SIZE)
    lo = tl.where(window > 0, pos - window + 1, -1)  # [BLOCK_M]: each row's first visible key

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs < kv_end) & (offs >= lo_tile)
        causal = n_mask[None, :] & (offs[None, :] <= pos[:, None]) & (offs[None, :] >= lo[:, None])
        slots = _token_slots(offs, block_table_row, slab_start, n_mask, BLOCK_SIZE, PAGED)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, slots, n_mask, causal, k_cache_ptr, v_cache_ptr, kv_head, d,
                                     d_mask, stride_cs, stride_ch, qk_scale, UPCAST, PRECISION)

    if SPLIT:
        # partial row (seq, tok, head, part); a partition a row cannot see leaves max -1e30 and sum 0
        prow = ((seq.to(tl.int64) * max_num_new + tok) * NUM_HEADS + head) * num_parts + part
        tl.store(part_out_ptr + prow[:, None] * BLOCK_D + d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])
        tl.store(part_max_ptr + prow, m_i, mask=row_mask)
        tl.store(part_sum_ptr + prow, l_i, mask=row_mask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 _cast(out, out_ptr.dtype.element_ty, UPCAST), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_parts", "max_num_new"])
def _prefill_reduce_kernel(
    out_ptr,  # [num_tokens, H, D]
    part_out_ptr,  # [num_seqs, max_num_new, H, num_parts, BLOCK_D] fp32
    part_max_ptr,  # [num_seqs, max_num_new, H, num_parts] fp32
    part_sum_ptr,  # [num_seqs, max_num_new, H, num_parts] fp32
    query_start_ptr,  # [num_seqs] int32
    num_new_ptr,  # [num_seqs] int32
    stride_ot, stride_oh, num_parts, max_num_new,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program per (sequence, new token), all its query heads: merge the token's key partitions one
    at a time (a [heads, head_dim] running output)."""
    pid = tl.program_id(0)
    seq = pid // max_num_new
    tok = pid % max_num_new
    valid = tok < tl.load(num_new_ptr + seq)
    parts = tl.where(valid, num_parts, 0)  # (scalar masks as bounds: the interpreter takes no scalar & tensor)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < NUM_HEADS
    base = ((seq.to(tl.int64) * max_num_new + tok) * NUM_HEADS + h) * num_parts  # [BLOCK_H]
    m_run = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for p in range(0, parts):
        m_p = tl.load(part_max_ptr + base + p, mask=h_mask, other=-1.0e30)
        l_p = tl.load(part_sum_ptr + base + p, mask=h_mask, other=0.0)
        acc_p = tl.load(part_out_ptr + (base + p)[:, None] * BLOCK_D + d[None, :],
                        mask=h_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        m_new = tl.maximum(m_run, m_p)
        alpha = tl.exp2(m_run - m_new)
        scale = tl.exp2(m_p - m_new)
        l_run = l_run * alpha + l_p * scale
        acc = acc * alpha[:, None] + acc_p * scale[:, None]
        m_run = m_new
    row = tl.load(query_start_ptr + seq).to(tl.int64) + tok
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + row * stride_ot + h[:, None] * stride_oh + d[None, :], _cast(out, out_ptr.dtype.element_ty, UPCAST),
             mask=h_mask[:, None] & (d < tl.where(valid, HEAD_DIM, 0))[None, :])


def prefill_partitions(num_programs: int, max_seq_len: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(key partitions, keys per partition) for a prefill of ``num_programs`` (sequence, KV head, query
    block) programs over up to ``max_seq_len`` keys: (1, 0) when one program each already fills the
    device or the context is short; else enough partitions (of whole tiles, at least ``PARTITION_SIZE``
    keys) to give the device about two programs per multiprocessor."""
    target = 2 * (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4)
    if num_programs >= target // 2 or max_seq_len <= PARTITION_SIZE:
        return 1, 0
    parts = min(-(-target // num_programs), -(-max_seq_len // PARTITION_SIZE))
    size = -(-max_seq_len // parts)
    size = -(-size // block_n) * block_n
    return -(-max_seq_len // size), size


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                      num_new: torch.Tensor, seq_lens: torch.Tensor, *, max_num_new: int, block_size: int,
                      block_tables: torch.Tensor | None = None, slab_starts: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, sm_scale: float | None = None, block_m: int = 64,
                      block_n: int = 64, max_seq_len: int | None = None, split_k: bool | None = None,
                      partition_size: int | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's ``num_new[s]`` new tokens (rows ``query_start[s]`` ..) over
    its ``seq_lens[s]`` cached tokens, the new ones included (they must already be stored).

    ``max_seq_len`` (a host int, at least every ``seq_lens[s]``) checks the block table's width and
    decides the split over keys; when None it is read from ``seq_lens`` (a device sync). ``split_k``:
    split each sequence's keys into partitions of ``partition_size`` keys (chosen by
    :func:`prefill_partitions` when None), merged by a second kernel: for a short chunk over a long
    cached context, which otherwise gives the device a handful of programs each walking every key.
    ``window`` > 0: a sliding-window layer's (query at position p sees keys p - window + 1 .. p)."""
    out = torch.empty_like(q) if out is None else out
    window = _check_window("prefill_attention", window)
    num_heads, num_kv_heads = _check_attention_args("prefill_attention", q, k_cache, v_cache, out, seq_lens,
                                                    query_start)
    num_seqs = seq_lens.shape[0]
    if query_start.shape != (num_seqs,) or num_new.shape != (num_seqs,) or num_new.dtype != torch.int32:
        raise ValueError("prefill_attention: query_start and num_new need one int32 entry per sequence")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    _check_bound("prefill_attention: max_seq_len", seq_lens, max_seq_len)
    _check_bound("prefill_attention: max_num_new", num_new, max_num_new)
    tables, slabs, stride_bt, paged = _layout_args(num_seqs, block_tables, slab_starts, seq_lens, block_size,
                                                   max_seq_len)
    check_launch("prefill_attention", q, k_cache, v_cache, out, seq_lens, query_start, num_new, tables, slabs)
    if num_seqs == 0:
        return out
    head_dim = q.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    q_blocks = triton.cdiv(max_num_new, block_q)
    num_parts, part_size = 1, 0
    if partition_size is not None:
        if partition_size < 1:
            raise ValueError(f"prefill_attention: partition_size must be positive, got {partition_size}")
        num_parts, part_size = triton.cdiv(max(max_seq_len, 1), partition_size), partition_size
    elif split_k is not False:
        num_parts, part_size = prefill_partitions(num_seqs * num_kv_heads * q_blocks, max_seq_len, block_n, q.device)
        if split_k and num_parts == 1:  # asked for: split into whole tiles anyway
            part_size = max(block_n, -(-max_seq_len // 2))
            num_parts = triton.cdiv(max(max_seq_len, 1), part_size)
    split = split_k is not False and num_parts > 1
    parts = dummy = None
    if split:
        shape = (num_seqs, max_num_new, num_heads, num_parts)
        parts = (torch.empty((*shape, block_d), device=q.device, dtype=torch.float32),
                 torch.empty(shape, device=q.device, dtype=torch.float32),
                 torch.empty(shape, device=q.device, dtype=torch.float32))
    else:
        num_parts, part_size = 1, 0
        dummy = out
    grid = (num_seqs, num_kv_heads, q_blocks * num_parts)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, *(parts if split else (dummy, dummy, dummy)), query_start, num_new, seq_lens, tables,
        slabs, sm_scale, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), stride_bt, part_size, num_parts, max_num_new,
        NUM_QUERIES_PER_KV=group, NUM_HEADS=num_heads, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged, SPLIT=split, **_dot_args(q.dtype))
    if split:
        _prefill_reduce_kernel[(num_seqs * max_num_new,)](
            out, *parts, query_start, num_new, out.stride(0), out.stride(1), num_parts, max_num_new,
            NUM_HEADS=num_heads, BLOCK_H=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, BLOCK_D=block_d,
            UPCAST=interpreting())
    return out


# ------------------------------------------------------------------------------------------ references


def sequence_slots(seq: int, length: int, block_size: int, block_tables: torch.Tensor | None,
                   slab_starts: torch.Tensor | None, first: int = 0) -> torch.Tensor:
    """Slots of a sequence's tokens ``first`` .. length-1 (int64, on the pool's device)."""
    device = (block_tables if block_tables is not None else slab_starts).device
    pos = torch.arange(first, length, device=device)
    if block_tables is not None:
        return block_tables[seq, pos // block_size].long() * block_size + pos % block_size
    return slab_starts[seq] + pos


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal_offset: int | None,
           window: int = 0):
    """q [T, H, D] over k, v [S, H_kv, D]; query i sees keys 0 .. causal_offset + i (all when None), and
    with ``window`` > 0 only the last ``window`` of those (keys causal_offset + i - window + 1 ..)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q, k) * sm_scale
    last = (k.shape[0] - 1 if causal_offset is None else causal_offset) + torch.arange(q.shape[0], device=q.device)
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    if causal_offset is not None:
        s = s.masked_fill(j > last[:, None], float("-inf"))
    if window:
        s = s.masked_fill(j <= last[:, None] - window, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, dim=-1), v)


def decode_attention_ref(q, k_cache, v_cache, seq_lens, query_loc, *, block_size: int, block_tables=None,
                         slab_starts=None, out=None, sm_scale: float | None = None,
                         dtype: torch.dtype | None = None, window: int = 0) -> torch.Tensor:
    """PyTorch reference of :func:`decode_attention`: gather each sequence's keys and attend (in ``dtype``
    when given: only the gathered keys are converted, so a huge pool is never copied whole)."""
    out = torch.empty_like(q if dtype is None else q.to(dtype)) if out is None else out
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    for s, (n, row) in enumerate(zip(seq_lens.tolist(), query_loc.tolist())):
        lo = max(n - window, 0) if window else 0  # keys before the window are not gathered (tables may drop them)
        slots = sequence_slots(s, n, block_size, block_tables, slab_starts, first=lo)
        out[row] = attend(cast(q[row:row + 1]), cast(k_cache[slots]), cast(v_cache[slots]), sm_scale, None, window)[0]
    return out


def prefill_attention_ref(q, k_cache, v_cache, query_start, num_new, seq_lens, *, block_size: int,
                          block_tables=None, slab_starts=None, out=None, sm_scale: float | None = None,
                          dtype: torch.dtype | None = None, window: int = 0) -> torch.Tensor:
    """PyTorch reference of :func:`prefill_attention` (in ``dtype`` when given, as the decode reference)."""
    out = torch.empty_like(q if dtype is None else q.to(dtype)) if out is None else out
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    for s, (start, n, length) in enumerate(zip(query_start.tolist(), num_new.tolist(), seq_lens.tolist())):
        lo = max(length - n - window + 1, 0) if window else 0  # the first query's first visible key
        slots = sequence_slots(s, length, block_size, block_tables, slab_starts, first=lo)
        out[start:start + n] = attend(cast(q[start:start + n]), cast(k_cache[slots]), cast(v_cache[slots]), sm_scale,
                                      length - n - lo, window)
    return out


def decode_attention_torch(q, k_cache, v_cache, seq_lens, query_loc, *, max_seq_len: int, block_size: int,
                           block_tables=None, slab_starts=None, out=None, sm_scale: float | None = None,
                           window: int = 0) -> torch.Tensor:
    """The same computation batched for speed (the CPU executor's decode path): every sequence's keys
    gathered into a ``[num_seqs, max_seq_len]`` grid, padding masked. Pads (and keys before a sliding
    ``window``) read the sequence's first visible key, so neither uninitialised memory nor a block a
    window layer dropped enters the sums."""
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    pos = torch.arange(max_seq_len, device=q.device)
    lens = seq_lens[:, None].long()
    first = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)  # first visible key
    valid = (pos[None, :] < lens) & (pos[None, :] >= first)
    pos = torch.where(valid, pos[None, :], first)
    if block_tables is not None:
        slots = torch.gather(block_tables.long(), 1, pos // block_size) * block_size + pos % block_size
    else:
        slots = slab_starts[:, None] + pos
    k, v = k_cache[slots], v_cache[slots]  # [num_seqs, S, H_kv, D]
    num_kv_heads = k.shape[2]
    qs = q[query_loc.long()].view(num_seqs, num_kv_heads, -1, q.shape[2])  # [num_seqs, H_kv, G, D]
    s = torch.einsum("bkgd,bskd->bkgs", qs, k).float() * sm_scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bkgs,bskd->bkgd", torch.softmax(s, dim=-1).to(v.dtype), v)
    out[query_loc.long()] = o.reshape(num_seqs, -1, q.shape[2]).to(out.dtype)
    return out
