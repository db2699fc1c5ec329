"""Each Triton kernel against its PyTorch reference (fp64) on fresh random inputs, output poisoned
with NaN: shuffled block tables, lengths off block edges, a single-token sequence, GQA ratio 4. The
error is per sequence (RMS relative to that sequence's own output), and a broken launch must fail."""

import pytest

from gpu_helpers import kernel_device, require_backend

torch = require_backend()

from gpu.attention import decode_attention_ref, decode_attention_torch, prefill_partitions  # noqa: E402
from gpu.kernel_cases import (DECODE_LENS, GPU_ONLY_REASON, LONG_DECODE_LENS, LONG_PREFILL_LENS,  # noqa: E402
                              LONG_PREFILL_NEW, PREFILL_LENS, PREFILL_NEW, SPLIT_PARTITION, SPLIT_PREFILL_LENS,
                              SPLIT_PREFILL_NEW, TOLERANCE, Shape, batch_max_error, broken_case, case_error,
                              decode_case, high_pool_cases, make_pool, prefill_case, store_case, window_case)

DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = [True, False]  # paged, contiguous
ids = {"dtype": ["fp32", "bf16"], "paged": ["paged", "contiguous"]}


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_store_kv_writes_exactly_the_mapped_slots(dtype, paged):
    """Padded tokens (slot -1) included: they must write nothing."""
    assert store_case([1, 37, 16, 40], Shape(), paged, dtype, kernel_device(), seed=1).worst == 0.0


@pytest.mark.parametrize("split_k", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_decode_attention_matches_reference(dtype, paged, split_k):
    err = decode_case(DECODE_LENS, Shape(), paged, dtype, kernel_device(), split_k=split_k, seed=2)
    assert len(err.per_sequence) == len(DECODE_LENS) and err.worst < TOLERANCE[dtype], err


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_prefill_attention_matches_reference(dtype, paged):
    """Includes a chunk over 45 cached tokens (chunked prefill) and a one-token prefill."""
    err = prefill_case(PREFILL_LENS, PREFILL_NEW, Shape(), paged, dtype, kernel_device(), seed=3)
    assert len(err.per_sequence) == len(PREFILL_LENS) and err.worst < TOLERANCE[dtype], err


def test_mha_and_wide_groups():
    """Group sizes 1 (MHA, padded to 16 rows) and 8 (Llama-2-70B's)."""
    for heads, kv_heads in ((4, 4), (16, 2)):
        shape = Shape(heads, kv_heads, 64)
        assert decode_case([5, 40], shape, True, torch.float32, kernel_device(), split_k=False).worst < 1e-4
        assert prefill_case([70, 9], [70, 4], shape, True, torch.float32, kernel_device()).worst < 1e-4


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


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids["dtype"])
def test_prefill_split_over_keys_matches_reference(dtype, paged):
    """Chunks over longer cached contexts, keys split into partitions of 48 (the last partial), merged."""
    err = prefill_case(SPLIT_PREFILL_LENS, SPLIT_PREFILL_NEW, Shape(), paged, dtype, kernel_device(), seed=6,
                       split_k=True, partition_size=SPLIT_PARTITION)
    assert err.worst < TOLERANCE[dtype], err


def test_prefill_partitions_split_only_a_short_chunk_over_a_long_context():
    cpu = torch.device("cpu")
    assert prefill_partitions(64, 16384, 64, cpu) == (1, 0)  # enough programs: no split
    assert prefill_partitions(2, 300, 64, cpu) == (1, 0)  # short context: no split
    parts, size = prefill_partitions(2, 16384, 64, cpu)
    assert parts > 1 and size % 64 == 0 and parts * size >= 16384 and (parts - 1) * size < 16384


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes(block_size):
    """Blocks of 8 and 32 (16 is every other test's): paged decode, prefill (one over cached context), store."""
    shape, dev = Shape(block_size=block_size), kernel_device()
    assert decode_case([1, 37, 130], shape, True, torch.bfloat16, dev, split_k=False, seed=7).worst < 5e-3
    assert prefill_case([1, 37, 70], [1, 37, 30], shape, True, torch.bfloat16, dev, seed=8).worst < 5e-3
    assert store_case([1, 37], shape, True, torch.bfloat16, dev, seed=9).worst == 0.0


def test_decode_without_prefetching_block_ids_is_the_same_function():
    err = decode_case([3, 200], Shape(), True, torch.float32, kernel_device(), split_k=False, prefetch=False)
    assert err.worst < 1e-4


def test_the_per_sequence_error_sees_a_23_percent_error_on_one_long_sequence():
    """Llama-3-8B heads, the device check's lengths: scale the longest sequence's (small, averaged) output
    by 1.23. Against the batch's largest output the error is under the old bf16 tolerance (1e-2); per
    sequence it is 0.23, far over 5e-3."""
    gen = torch.Generator().manual_seed(0)
    shape, lens = Shape(32, 8, 128), [1, 37, 16, 2100]
    pool = make_pool(lens, shape, True, torch.bfloat16, "cpu", gen)
    q = torch.randn((len(lens), shape.num_heads, shape.head_dim), generator=gen).to(torch.bfloat16)
    loc = torch.arange(len(lens), dtype=torch.int32)
    ref = decode_attention_ref(q.double(), pool.k_cache, pool.v_cache, torch.tensor(lens, dtype=torch.int32), loc,
                               block_size=16, block_tables=pool.block_tables, dtype=torch.float64)
    out = ref.clone()
    out[3] *= 1.23
    assert batch_max_error(out, ref) < 1e-2  # the old metric passes it
    err = case_error(out, ref, [loc[s:s + 1].long() for s in range(len(lens))])
    assert err.per_sequence[:3] == [0.0, 0.0, 0.0] and err.worst == pytest.approx(0.23)


def test_a_nan_is_an_infinite_error():
    ref = torch.ones((2, 4, 8), dtype=torch.float64)
    out = ref.clone()
    out[1, 0, 0] = float("nan")
    err = case_error(out, ref, [torch.tensor([0]), torch.tensor([1])])
    assert err.per_sequence[0] == 0.0 and err.per_sequence[1] == float("inf")


def test_the_broken_case_fails():
    """The device check's deliberately broken launch (one wrong block-table entry on the longest sequence)
    must exceed the tolerance, and only on that sequence."""
    err = broken_case([1, 37, 16, 600], Shape(), torch.bfloat16, kernel_device(), seed=10)
    assert err.worst > 10 * TOLERANCE[torch.bfloat16], err
    assert max(err.per_sequence[:3]) < TOLERANCE[torch.bfloat16], err


def test_a_block_table_too_narrow_for_the_context_is_refused():
    from gpu.attention import decode_attention, prefill_attention

    dev = kernel_device()
    k = torch.zeros((64, 2, 32), device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    table = torch.zeros((1, 2), dtype=torch.int32, device=dev)  # 2 blocks of 16: 32 slots
    with pytest.raises(ValueError, match="2 columns.*32 slots, fewer than max_seq_len 40"):
        decode_attention(torch.zeros((1, 8, 32), device=dev), k, k, one, one - 1, max_seq_len=40, block_size=16,
                         block_tables=table)
    with pytest.raises(ValueError, match="fewer than max_seq_len 33"):
        prefill_attention(torch.zeros((1, 8, 32), device=dev), k, k, one - 1, one, one * 33, max_num_new=1,
                          block_size=16, block_tables=table)


def test_a_bound_below_the_values_it_bounds_is_refused():
    """A kernel sized by max_seq_len / max_num_new would skip the keys or queries past it: wrong output,
    no error. Where checking costs no device sync (CPU tensors), a bound below a value is refused."""
    from gpu.attention import decode_attention, prefill_attention

    if kernel_device() != "cpu":
        pytest.skip("checked on CPU tensors only (on a GPU the bound is the caller's, unchecked: no sync)")
    k = torch.zeros((64, 2, 32))
    one = torch.ones(1, dtype=torch.int32)
    table = torch.zeros((1, 4), dtype=torch.int32)  # 64 slots: wide enough for every bound here
    with pytest.raises(ValueError, match="decode_attention: max_seq_len 20 is below the largest value it bounds, 40"):
        decode_attention(torch.zeros((1, 8, 32)), k, k, one * 40, one - 1, max_seq_len=20, block_size=16,
                         block_tables=table)
    with pytest.raises(ValueError, match="prefill_attention: max_seq_len 20 is below .* 33"):
        prefill_attention(torch.zeros((1, 8, 32)), k, k, one - 1, one, one * 33, max_num_new=1, max_seq_len=20,
                          block_size=16, block_tables=table)
    with pytest.raises(ValueError, match="prefill_attention: max_num_new 2 is below the largest value it bounds, 3"):
        prefill_attention(torch.zeros((3, 8, 32)), k, k, one - 1, one * 3, one * 33, max_num_new=2,
                          block_size=16, block_tables=table)


gpu_only = pytest.mark.skipif(kernel_device() != "cuda", reason=GPU_ONLY_REASON)


@gpu_only
@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
def test_long_contexts_on_a_gpu(paged):  # pragma: no cover - needs a GPU
    shape = Shape(32, 8, 128)
    for split in (None, True):
        assert decode_case(LONG_DECODE_LENS, shape, paged, torch.bfloat16, "cuda", split_k=split).worst < 5e-3
    assert prefill_case(LONG_PREFILL_LENS, LONG_PREFILL_NEW, shape, paged, torch.bfloat16, "cuda").worst < 5e-3


@gpu_only
def test_block_ids_near_the_top_of_a_pool_over_2_31_elements():  # pragma: no cover - needs a GPU
    for name, err in high_pool_cases(torch.bfloat16, "cuda"):
        assert err.worst < 5e-3, (name, err)


# Sliding window: W under a block (5), not a multiple of the block size (23), of a whole block (16), at
# least every length (2000: the same as full attention). GQA 4 (the default shape) and MHA. Keys no
# query may see are NaN and blocks wholly before the window are dropped from the table (pointing at a
# NaN block): a finite output equal to the reference shows they were never read.
WINDOW_DECODE_LENS = [1, 37, 16, 700]  # 700: two split-K partitions, the first wholly before small windows
WINDOW_PREFILL_LENS, WINDOW_PREFILL_NEW = [1, 45, 100], [1, 25, 6]  # chunks over 20 and 94 cached tokens


@pytest.mark.parametrize("window", [5, 23, 2000])
@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
def test_sliding_window_decode_never_reads_keys_before_the_window(paged, window):
    for split_k in (False, True):
        err = window_case(WINDOW_DECODE_LENS, None, window, Shape(), paged, torch.float32, kernel_device(),
                          split_k=split_k, seed=20)
        assert err.worst < TOLERANCE[torch.float32], (split_k, err)


@pytest.mark.parametrize("window", [5, 23, 2000])
@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
def test_sliding_window_prefill_never_reads_keys_before_the_window(paged, window):
    err = window_case(WINDOW_PREFILL_LENS, WINDOW_PREFILL_NEW, window, Shape(), paged, torch.float32, kernel_device(),
                      seed=21)
    assert err.worst < TOLERANCE[torch.float32], err


@pytest.mark.parametrize("window", [5, 23])
def test_sliding_window_prefill_split_over_keys(window):
    """Partitions of 48 keys: some wholly before a row's window (max -1e30, sum 0 in the merge)."""
    err = window_case([100], [6], window, Shape(), True, torch.float32, kernel_device(), seed=22, split_k=True,
                      partition_size=SPLIT_PARTITION)
    assert err.worst < TOLERANCE[torch.float32], err


def test_sliding_window_bf16_mha_and_whole_block_window():
    dev = kernel_device()
    assert window_case([37, 130], None, 16, Shape(4, 4, 64), True, torch.bfloat16, dev, seed=23).worst < 5e-3
    assert window_case([70, 130], [70, 9], 16, Shape(4, 4, 64), True, torch.bfloat16, dev, seed=24).worst < 5e-3


def test_the_window_check_can_fail():
    """The poisoned keys are there: a kernel launched without the window reads them (NaN: error inf),
    and the windowed reference differs from full attention."""
    dev = kernel_device()
    assert window_case([37, 100], None, 23, Shape(), True, torch.float32, dev, launch_window=0).worst == float("inf")
    assert window_case([75], [30], 23, Shape(), False, torch.float32, dev, launch_window=0).worst == float("inf")


def test_window_must_be_a_non_negative_int():
    from gpu.attention import decode_attention

    k = torch.zeros((32, 2, 32))
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        decode_attention(torch.zeros((1, 8, 32)), k, k, torch.ones(1, dtype=torch.int32),
                         torch.zeros(1, dtype=torch.int32), max_seq_len=1, block_size=16,
                         slab_starts=torch.zeros(1, dtype=torch.int64), window=-1)


@pytest.mark.parametrize("paged", LAYOUTS, ids=ids["paged"])
def test_batched_torch_decode_with_a_window_matches_reference(paged):
    gen = torch.Generator().manual_seed(25)
    shape, lens = Shape(), [1, 37, 16, 300]
    pool = make_pool(lens, shape, paged, torch.float32, "cpu", gen)
    q = torch.randn((len(lens), shape.num_heads, shape.head_dim), generator=gen)
    seq_lens, loc = torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens), dtype=torch.int32)
    out = decode_attention_torch(q, pool.k_cache, pool.v_cache, seq_lens, loc, max_seq_len=max(lens),
                                 block_size=shape.block_size, window=23, **pool.layout())
    ref = decode_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), seq_lens, loc,
                               block_size=shape.block_size, window=23, **pool.layout())
    full = decode_attention_ref(q.double(), pool.k_cache.double(), pool.v_cache.double(), seq_lens, loc,
                                block_size=shape.block_size, **pool.layout())
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert (full - ref).abs().max() > 1e-2  # the window changed the answer
