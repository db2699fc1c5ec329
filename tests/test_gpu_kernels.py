"""Each Triton kernel against its PyTorch reference (fp64) on fresh random inputs, output poisoned
with NaN: shuffled block tables, lengths off block edges, a single-token sequence, GQA ratio 4."""

import pytest

from gpu_helpers import kernel_device, require_backend

torch = require_backend()

from gpu.attention import decode_attention_ref, decode_attention_torch  # noqa: E402
from gpu.kernel_cases import (DECODE_LENS, PREFILL_LENS, PREFILL_NEW, TOLERANCE, Shape, decode_case,  # noqa: E402
                              make_pool, prefill_case, store_case)

DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = [True, False]  # paged, contiguous
ids = {"dtype": ["fp32", "bf16"], "paged": ["paged", "contiguous"]}


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_store_kv_writes_exactly_the_mapped_slots(dtype, paged):
    assert store_case(DECODE_LENS, Shape(), paged, dtype, kernel_device(), seed=1) == 0.0


@pytest.mark.parametrize("split_k", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_decode_attention_matches_reference(dtype, paged, split_k):
    err = decode_case(DECODE_LENS, Shape(), paged, dtype, kernel_device(), split_k=split_k, seed=2)
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_prefill_attention_matches_reference(dtype, paged):
    """Includes a chunk over 45 cached tokens (chunked prefill) and a one-token prefill."""
    err = prefill_case(PREFILL_LENS, PREFILL_NEW, Shape(), paged, dtype, kernel_device(), seed=3)
    assert err < TOLERANCE[dtype], err


def test_mha_and_wide_groups():
    """Group sizes 1 (MHA, padded to 16 rows) and 8 (Llama-2-70B's)."""
    for heads, kv_heads in ((4, 4), (16, 2)):
        shape = Shape(heads, kv_heads, 64)
        assert decode_case([5, 40], shape, True, torch.float32, kernel_device(), split_k=False) < 1e-4
        assert prefill_case([70, 9], [70, 4], shape, True, torch.float32, kernel_device()) < 1e-4


def test_a_wrong_block_table_is_caught():
    """The check can fail: a block-table entry pointing at another sequence's block gives a large error.
    (Swapping two of a sequence's own entries would not: attention over a set of keys ignores order.)"""
    from gpu.attention import decode_attention

    dev = kernel_device()
    gen = torch.Generator(device=dev).manual_seed(4)
    shape, lens = Shape(), [40, 70]
    pool = make_pool(lens, shape, True, torch.float32, dev, gen)
    q = torch.randn((2, shape.num_heads, shape.head_dim), generator=gen, device=dev)
    seq_lens, loc = torch.tensor(lens, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    ref = decode_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), seq_lens, loc,
                               block_size=shape.block_size, block_tables=pool.block_tables)
    wrong = pool.block_tables.clone()
    wrong[1, 0] = pool.block_tables[0, 0]
    out = decode_attention(q, pool.k_cache, pool.v_cache, seq_lens, loc, max_seq_len=70,
                           block_size=shape.block_size, block_tables=wrong)
    assert (out.double() - ref).abs().max() / ref.abs().max() > 1e-2


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
def test_batched_torch_decode_matches_reference(paged):
    """The CPU executor's batched decode path is the same computation."""
    gen = torch.Generator().manual_seed(5)
    shape = Shape()
    pool = make_pool(DECODE_LENS, shape, paged, torch.float32, "cpu", gen)
    q = torch.randn((len(DECODE_LENS), shape.num_heads, shape.head_dim), generator=gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    loc = torch.arange(len(DECODE_LENS), dtype=torch.int32)
    out = decode_attention_torch(q, pool.k_cache, pool.v_cache, seq_lens, loc, max_seq_len=max(DECODE_LENS),
                                 block_size=shape.block_size, **pool.layout())
    ref = decode_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), seq_lens, loc,
                               block_size=shape.block_size, **pool.layout())
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_wrappers_check_their_inputs():
    dev = kernel_device()
    from gpu.attention import decode_attention
    from gpu.kv_cache import store_kv

    k = torch.zeros((32, 2, 32))
    with pytest.raises(ValueError, match="exactly one"):
        decode_attention(torch.zeros((1, 8, 32)), k, k, torch.ones(1, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32), max_seq_len=1, block_size=16)
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(torch.zeros((1, 8, 32), dtype=torch.bfloat16), k, k, torch.ones(1, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32), max_seq_len=1, block_size=16,
                         slab_starts=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        store_kv(torch.zeros((2, 2, 32)), torch.zeros((2, 2, 32)), k, k, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        store_kv(torch.zeros((2, 32, 2)).transpose(1, 2), torch.zeros((2, 2, 32)), k, k, torch.zeros(2, dtype=torch.int64))
    assert dev in ("cpu", "cuda")
