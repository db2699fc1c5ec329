"""The GPU side of block sharing, on the CPU: the batched copy-on-write kernel against its reference,
and replays whose greedy tokens prove that copies, forks and prefix-cache hits keep every sequence's
cache right (a wrong copy or a hit on other tokens would change what the model generates)."""

import pytest

from gpu_helpers import kernel_device, require_backend

torch = require_backend()

from gpu.kv_cache import copy_blocks, copy_blocks_ref  # noqa: E402
from gpu.replay import replay  # noqa: E402
from test_gpu_replay import TINY, tiny_scenario  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_kernel_matches_its_reference(dtype):
    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((2, 2, 12, 4, 2, 8), generator=g).to(dtype).to(dev)
    pairs = torch.tensor([[3, 9], [0, 5], [7, 1], [3, 11]], dtype=torch.int64, device=dev)  # one source twice
    dst = pairs[:, 1]
    kv[:, :, dst] = float("nan")  # poisoned destinations
    want = kv.clone()
    copy_blocks_ref(want, pairs)
    copy_blocks(kv, pairs)
    assert torch.equal(kv, want)
    assert not torch.isnan(kv).any()


def test_copy_blocks_checks_its_inputs():
    kv = torch.zeros((1, 2, 4, 2, 1, 4))
    with pytest.raises(ValueError, match="int64"):
        copy_blocks(kv, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous 6-d pool"):
        copy_blocks(kv[:, :, :, :1], torch.tensor([[0, 1]]))


def generated(result, ex, name, width):
    """Each request's generated tokens, and the tokens of its other samples or beams."""
    out = {}
    e = ex.executors[name]
    forked = {}
    for seq_id, r in e.origin.items():
        if seq_id >= len(result.requests):  # forked ids come after the requests' (a beam move can land on one)
            forked.setdefault(r, []).append(seq_id)
    for i in range(len(result.requests)):
        out[i] = [e.generated(i)] + [e.generated(s) for s in sorted(forked.get(i, []))]
        assert len(out[i]) == width, (name, i, len(out[i]))
    return out


def test_prefix_cache_hits_compute_the_same_tokens():
    """Shared system prompts: requests that hit the prefix cache prefill only their suffix over cached
    blocks, and still generate exactly what a full prefill generates."""
    wl = {"arrival": {"kind": "poisson", "rate": 30.0}, "prompt": {"kind": "uniform", "low": 10, "high": 40},
          "output": {"kind": "uniform", "low": 6, "high": 14}, "num_requests": 10, "seed": 3,
          "shared_prefixes": {"lengths": [48, 80], "popularity": [2, 1]}}
    s = tiny_scenario(900, ["vllm", {"preset": "vllm", "name": "apc", "prefix_caching": True},
                            {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True,
                             "max_num_batched_tokens": 32}], workload=wl)
    result, ex = replay(s, "cpu")
    assert result.policies["apc"].summary["prefix_hit_rate_tokens"] > 0.3
    for name in ("apc", "apc-v1"):
        for i in range(10):
            assert ex.executors[name].generated(i) == ex.executors["vllm"].generated(i), (name, i)


def test_a_request_reads_blocks_another_writes_in_the_same_step():
    """A burst behind shared prefixes under vLLM v1's timing: blocks are cached as they are scheduled, so a
    request admitted later in the same step reads prefix blocks that the step itself writes (each layer
    stores every new token's K/V before any attention reads it). Tokens are still a full prefill's."""
    wl = {"arrival": {"kind": "poisson", "rate": 1e6}, "prompt": {"kind": "uniform", "low": 10, "high": 40},
          "output": {"kind": "uniform", "low": 6, "high": 14}, "num_requests": 10, "seed": 3,
          "shared_prefixes": {"lengths": [48, 80], "popularity": [2, 1]}}
    s = tiny_scenario(900, ["vllm", {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True}], workload=wl)
    result, ex = replay(s, "cpu")
    # 0.55 of prompt tokens hit; 0.35 when blocks were found only from the step after the one computing them
    assert result.policies["apc-v1"].summary["prefix_hit_rate_tokens"] > 0.5
    for i in range(10):
        assert ex.executors["apc-v1"].generated(i) == ex.executors["vllm"].generated(i), i


def test_a_recomputed_request_reads_the_blocks_it_left_in_the_cache():
    """No shared content: a request preempted by recompute finds its own computed blocks, generated tokens
    included, and prefills only the rest over them; it still generates what a full recompute generates."""
    s = tiny_scenario(320, ["vllm", {"preset": "vllm", "name": "apc", "prefix_caching": True},
                            {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True,
                             "max_num_batched_tokens": 48}])
    result, ex = replay(s, "cpu")
    for name in ("apc", "apc-v1"):
        m = result.policies[name].summary
        assert m["num_preemptions"] > 0 and m["prefix_hit_rate_tokens"] == 0  # no request shares another's tokens
        assert m["prefill_tokens_saved"] > 0, name
        for i in range(8):
            assert ex.executors[name].generated(i) == ex.executors["vllm"].generated(i), (name, i)


@pytest.mark.parametrize("sampling", [{"kind": "parallel", "n": 3}, {"kind": "beam", "width": 3, "keep_probability": 0.5}])
def test_samples_and_beams_keep_their_caches_right(sampling):
    """Forked samples and reselected beams have the same history, so under greedy decoding they must
    generate the single-output run's tokens: true only if copy-on-write (paged) and slab copies
    (contiguous) give each sequence the right K/V. Memory is tight enough that groups preempt."""
    single = tiny_scenario(700, ["vllm"], num_requests=6)
    grouped = tiny_scenario(700, ["orca-oracle", "vllm", {"preset": "vllm", "name": "vllm-swap", "swap_space_gib": 0.001}],
                            num_requests=6, sampling=sampling)
    ref_result, ref = replay(single, "cpu")
    result, ex = replay(grouped, "cpu")
    width = sampling.get("n", sampling.get("width"))
    assert result.policies["vllm"].summary["num_cow_copies"] > 0
    for name in ("orca-oracle", "vllm", "vllm-swap"):
        toks = generated(result, ex, name, width)
        for i in range(6):
            for t in toks[i]:
                assert t == ref.executors["vllm"].generated(i), (name, i)


def test_a_block_copied_and_swapped_out_in_one_step_leaves_with_its_copy():
    """Chunked prefill, swap and parallel samples on a tight pool: a step copies a shared block for a
    sample (copy-on-write) and then swaps that sample's group out. Swap-outs run before the step's copies,
    so the copy's destination left with its old content, and two samples generated other tokens than the
    plain run's; now the copy's source leaves in its place."""
    wl = {"arrival": {"kind": "poisson", "rate": 1e6}, "prompt": {"kind": "uniform", "low": 20, "high": 50},
          "output": {"kind": "uniform", "low": 8, "high": 20}, "num_requests": 6, "seed": 5,
          "shared_prefixes": {"lengths": [24, 40], "popularity": [2, 1]}}
    # (max_num_seqs 24, the budget: a sampling run's budget must cover every sequence, as vLLM requires; 18 run
    # here at most, so nothing changes but the logits rows of the activation reserve, which the device follows)
    pol = {"preset": "vllm-v1", "name": "p", "preemption": "swap", "max_num_batched_tokens": 24, "block_size": 4,
           "max_num_seqs": 24}
    _, ref = replay(tiny_scenario(900, ["vllm"], workload=wl), "cpu")
    from gpu.calibrate import resolve_model
    from gpu.replay import memory_gib_for_pool

    device = {"name": "tiny-device", "hbm_gb_per_s": 50, "tflops": 1,
              "memory_gib": memory_gib_for_pool(resolve_model(str(TINY)), 220, max_num_seqs=24)}
    result, ex = replay(tiny_scenario(220, [pol], workload=wl, sampling={"kind": "parallel", "n": 3}, gpu=device),
                        "cpu")
    assert result.policies["p"].summary["num_preemptions"] > 0 and result.policies["p"].summary["num_cow_copies"] > 0
    for i, toks in generated(result, ex, "p", 3).items():
        for t in toks:
            assert t == ref.executors["vllm"].generated(i), i
