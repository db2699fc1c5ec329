"""Today's KV layouts (issue 16): layer groups from the shapes, the hybrid allocators' accounting
(hypothesis), capacity by hand, bad input, and exact-vs-fast equivalence with window freeing, MLA and Mamba."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import run
from sim.catalog import GIB, GPUS, MODELS, CatalogError, model_from_hf_config
from sim.config import ScenarioError, parse_scenario
from sim.core import Sequence
from sim.hybrid import HybridContiguousKv, HybridPagedKv, _CrossingPool
from sim.kv import BuddyAllocator, FifoBlockPool, Reservation, activation_bytes, breakdown, kv_pool
from sim.layouts import KvGroup, capacity_tokens, first_kept, head_sum, kv_layout, window_runs
from sim.policy import resolve_policy
from sim.schema import MEMORY_CLASSES
from sim.sharing import SharedBlockPool
from sim.steptime import distinct_experts

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------ shapes


def test_catalog_models_match_their_published_sizes():
    """Parameter counts from the config.json shapes land on the published sizes (all experts counted)."""
    billions = {"gemma-3-27b": 27.0, "gpt-oss-120b": 116.8, "llama-4-scout": 107.8, "deepseek-v3": 671.0,
                "jamba-v0.1": 51.6}
    for name, b in billions.items():
        assert MODELS[name].num_params / 1e9 == pytest.approx(b, abs=0.1), name
    assert MODELS["deepseek-v3"].weights_bytes_total == MODELS["deepseek-v3"].num_params  # fp8: a byte a weight


def test_gemma3_groups_by_hand():
    """62 layers, every 6th full: 10 full + 52 sliding; vLLM's group size is the smaller count (10), so one
    full group and six sliding groups (the last one 2 layers + 8 of padding); a slot is one token of 10 layers
    of 2 * 16 KV heads * 128 * 2 bytes."""
    lay = kv_layout(MODELS["gemma-3-27b"], tp=1, block_size=16)
    assert lay.group_size == 10 and lay.layer_bytes == 2 * 16 * 128 * 2 == 8192
    assert sorted((g.kind, g.layers, g.window) for g in lay.groups) == [
        ("full", 10, 0)] + [("sliding", 2, 1024)] + [("sliding", 10, 1024)] * 5
    assert lay.slot_bytes == 81920
    # a 32k-token sequence: 2048 blocks in the full group, W/B + 1 = 65 in each sliding group
    assert lay.pages_held(32768) == 2048 + 6 * 65
    off = kv_layout(MODELS["gemma-3-27b"], tp=1, block_size=16, hybrid=False)
    assert off.single and off.slot_bytes == 62 * 8192 == MODELS["gemma-3-27b"].kv_bytes_per_token(1)
    fp8 = kv_layout(MODELS["gemma-3-27b"], tp=1, block_size=16, kv_dtype_bytes=1)
    assert fp8.slot_bytes == 40960


def test_mla_and_mamba_bytes_by_hand():
    ds = kv_layout(MODELS["deepseek-v3"], tp=8, block_size=16)
    assert ds.single and ds.slot_bytes == 61 * (512 + 64) * 2 == 70272  # the latent, not split over ranks
    assert kv_layout(MODELS["deepseek-v3"], tp=8, block_size=16, kv_dtype_bytes=1).slot_bytes == 35136
    jam = kv_layout(MODELS["jamba-v0.1"], tp=2, block_size=16)
    # 4 attention layers (4 KV heads per rank at tp 2), 28 Mamba layers: groups of 4 layers
    assert jam.group_size == 4 and jam.layer_bytes == 2 * 4 * 128 * 2 == 2048
    state = (3 * 4096 + 4096 * 16) * 2  # conv (d_conv - 1) * d_inner + SSM d_inner * d_state, d_inner 8192 / 2
    assert MODELS["jamba-v0.1"].mamba_state_bytes(2) == state == 155648
    mamba = [g for g in jam.groups if g.kind == "mamba"]
    assert len(mamba) == 7 and all(g.state_pages == -(-state // (16 * 2048)) == 5 for g in mamba)
    with pytest.raises(ValueError, match="hybrid_allocator: false"):
        kv_layout(MODELS["jamba-v0.1"], tp=2, block_size=16, hybrid=False)


def test_window_rules():
    B = 16
    s, c = KvGroup("sliding", 1, 64), KvGroup("chunked", 1, 64)
    assert first_kept(s, 63, B) == 0 and first_kept(s, 80, B) == 1  # position 17.. needed: block 1 onwards
    assert first_kept(c, 63, B) == 0 and first_kept(c, 64, B) == 4 and first_kept(c, 127, B) == 4
    assert first_kept(KvGroup("full", 1), 10**6, B) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=12), st.integers(0, 200), st.integers(1, 400), st.integers(1, 300))
def test_window_runs_are_the_window_sums(offs, d, window, k):
    """The runs a window group's span is priced from give sum(min(o + d + j, W)) at every step j, and cover
    the steps 0 .. k - 1 once each, in order."""
    offs = sorted(offs)
    runs = window_runs(offs, sum(offs), d, window, k)
    assert [j for j0, j1, _, _ in runs for j in range(j0, j1)] == list(range(k))
    for j0, j1, base, slope in runs:
        assert j0 < j1
        for j in range(j0, j1):
            assert base + j * slope == sum(min(o + d + j, window) for o in offs)


@given(st.lists(st.integers(0, 10**6), max_size=12), st.data())
def test_head_sum_is_the_sum_below_from_either_end(offs, data):
    i = data.draw(st.integers(0, len(offs)))
    assert head_sum(offs, sum(offs), i) == sum(offs[:i])


def test_capacity_per_gpu_by_hand():
    """Gemma-3-27B on one H100 (0.9 x 80 GiB - 0.5 GiB, bf16 weights, the activation estimate): the same
    bytes hold 5.2x more tokens of 32k-token sequences with the hybrid allocator, and fp8 doubles both."""
    m, gpu = MODELS["gemma-3-27b"], GPUS["h100"]
    free = int(0.9 * 80 * GIB - 0.5 * GIB) - m.num_params * 2 - activation_bytes(m, 1, 2048, 256)
    for fp8 in (False, True):
        w = 1 if fp8 else 2
        per_token_full = 62 * 2 * 16 * 128 * w
        page_hybrid = 16 * 10 * 2 * 16 * 128 * w
        lay = kv_layout(m, 1, 16, w if fp8 else None)
        pool = kv_pool(m, gpu, tp=1, gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
                       slot_bytes=lay.slot_bytes)
        assert pool.num_blocks == free // page_hybrid
        off = kv_pool(m, gpu, tp=1, gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256,
                      slot_bytes=kv_layout(m, 1, 16, w if fp8 else None, hybrid=False).slot_bytes)
        assert off.num_blocks == free // (16 * per_token_full)
        hybrid_tokens = capacity_tokens(lay, pool.num_blocks, 32768)
        assert hybrid_tokens == pool.num_blocks * 32768 // (2048 + 6 * 65)
        # bytes a 32k-token sequence holds: 62 whole layers vs 2438 pages of 10 layers
        assert per_token_full * 32768 / ((2048 + 6 * 65) * page_hybrid) == pytest.approx(5.208, abs=1e-3)


@pytest.mark.parametrize("name, tp, layer_bytes, group_size, slots_off, pages_32k", [
    # gpt-oss-120b: 8 KV heads x 64 x K,V x 2 bytes; 18 sliding (128) + 18 full layers: 2 groups of 18;
    # a 32k sequence holds 2048 full blocks + 128/16 + 1 sliding ones
    ("gpt-oss-120b", 1, 2 * 8 * 64 * 2, 18, 36 * 2048, 2048 + 9),
    # Llama-4-Scout at tp 4: 2 KV heads per rank; 36 chunked (8192) + 12 full: 4 groups of 12; at 32k the
    # chunked groups hold only the current chunk's 8192 / 16 blocks
    ("llama-4-scout", 4, 2 * 2 * 128 * 2, 12, 48 * 1024, 2048 + 3 * 512),
    # Jamba at tp 2: 4 attention layers (one group), 7 Mamba groups of 5 state pages each
    ("jamba-v0.1", 2, 2 * 4 * 128 * 2, 4, None, 2048 + 7 * 5),
])
def test_capacity_table_shapes_by_hand(name, tp, layer_bytes, group_size, slots_off, pages_32k):
    """The capacity table's inputs (benchmarks/bench_layouts.py capacity) from the shapes by hand."""
    m = MODELS[name]
    lay = kv_layout(m, tp, 16)
    assert (lay.layer_bytes, lay.group_size, lay.pages_held(32768)) == (layer_bytes, group_size, pages_32k)
    assert kv_layout(m, tp, 16, kv_dtype_bytes=1).slot_bytes * 2 == lay.slot_bytes  # fp8 halves a page
    if slots_off is not None:
        assert kv_layout(m, tp, 16, hybrid=False).slot_bytes == slots_off


def test_distinct_experts_formula():
    assert distinct_experts(256, 8, 1) == pytest.approx(8)
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert distinct_experts(16, 2, 2) == pytest.approx(16 * (1 - (14 / 16) ** 2))


def _tiny_hybrid(memory_gib: float, policies: list, **workload):
    """The tiny hybrid model (2 sliding groups of W = 8, 1 full group) on a made-up device: at 0.0029 GiB
    a pool of 73 pages of 4 tokens."""
    # (less the 240 rows of fp32 logits over its 512 words that the activation reserve no longer counts: one row
    # per token of its 16, not 256, so that the pools stay as these tests were written for)
    memory_gib -= (256 - 16) * 512 * 4 / 0.9 / 2**30
    return parse_scenario({"name": "t", "model": "gpu/configs/tiny-hybrid.json",
                           "gpu": {"name": "tiny", "memory_gib": memory_gib, "hbm_gb_per_s": 50, "tflops": 1},
                           "runtime_overhead_gib": 0, "activation_reserve_tokens": 16,
                           "workload": {"arrival": {"kind": "poisson", "rate": 50}, "num_requests": 40, "seed": 0,
                                        **workload}, "policies": policies}, base_dir=str(ROOT))


def test_never_fits_bounds_a_recomputed_prefill_by_hand():
    """A request of 10 + 118 tokens (its KV: 127 tokens, 32 pages per group): preempted by recompute, it
    prefills all 127 at once and the window groups hold all 32 (3 x 32 = 96 > 73 pages); swapped too, since
    a full swap space falls back to recompute (sized for swapping alone, a window group held at most
    (10 + 8 - 2) // 4 + 2 = 6 of the prompt's pages, and a request that fell back stalled the scheduler);
    chunked at 16 tokens, (16 + 6) // 4 + 2 = 7 (46). 10 + 60 tokens: 18 pages per group, 54, fit either way."""
    s = _tiny_hybrid(0.0029, [{"preset": "vllm", "block_size": 4},
                              {"preset": "vllm", "name": "swap", "preemption": "swap", "block_size": 4},
                              {"preset": "vllm-v1", "name": "v1", "block_size": 4, "max_num_batched_tokens": 16}],
                     lengths="alpaca")
    from sim.policy import make_kv

    prompt, output = np.array([10, 10]), np.array([118, 60])
    fits = {}
    for p in s.policies:
        kv = make_kv(resolve_policy(s, s.model_spec(), s.gpu_spec(), p))
        assert kv.blocks.num_blocks == 73 and [(g.window, n) for g, n in kv.classes] == [(8, 2), (0, 1)]
        fits[p.name] = kv.never_fits(prompt, output).tolist()
    assert fits == {"vllm": [True, False], "swap": [True, False], "v1": [False, False]}


@pytest.mark.parametrize("policy", [{"preset": "vllm"}, {"preset": "vllm-v1"},
                                    {"preset": "vllm", "preemption": "swap", "swap_space_gib": 0}])
def test_a_request_whose_recompute_cannot_fit_is_rejected_up_front(policy):
    """Short prompts and long outputs on 73 pages: before, a preempted request whose re-prefill needed
    every group's pages for all its tokens waited forever ("scheduler stalled ... a bug"); now the requests
    that could not come back are rejected up front and the rest finish. Under swap too: with no room in
    its swap space, a victim falls back to recompute."""
    s = _tiny_hybrid(0.0029, [{**policy, "name": "p", "block_size": 4}], prompt={"kind": "uniform", "low": 8, "high": 12},
                     output={"kind": "uniform", "low": 100, "high": 300})
    m = run(s).policies["p"].summary
    assert m["num_rejected"] > 0 and m["num_finished"] + m["num_rejected"] == 40


def test_an_fp8_checkpoint_reads_its_dense_weights_at_a_byte():
    """DeepSeek-V3's fp8 checkpoint: at one token (each GEMM memory-bound on the datasheet roofline) the
    MLA projections of 61 layers, the 3 dense MLPs and the 58 shared experts read K x N bytes, not 2 K x N
    (by hand, per rank at tp 8); the router and the LM head stay bf16."""
    from dataclasses import replace

    from sim.config import RooflineConfig
    from sim.steptime import RooflineStepTime

    m, tp = MODELS["deepseek-v3"], 8
    h, heads, cfg = m.hidden_size, m.num_heads // tp, RooflineConfig(operators="datasheet")
    fp8, bf16 = (RooflineStepTime(x, GPUS["h200"], tp, cfg, paged=True) for x in (m, replace(m, dense_weight_bytes=0)))
    mla = [(m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim, h),
           (heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank),
           (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), (h, heads * m.v_head_dim)]
    f, fs = m.ffn_size // tp, m.num_shared_experts * m.moe_ffn_size // tp
    weights = 61 * sum(n * k for n, k in mla) + 3 * (2 * f * h + h * f) + 58 * (2 * fs * h + h * fs)
    assert bf16._modern_layers_s(1) - fp8._modern_layers_s(1) == pytest.approx(weights / fp8.ops._bw, rel=1e-9)


def test_mla_attention_is_priced_at_its_own_widths():
    """MLA prefill runs decompressed (vLLM): per query-key pair and head 2 * 192 FLOPs for QK^T and 2 * 128
    (v_head_dim) for PV, not 4 * 192. Decode runs absorbed: 2 * (512 + 64) + 2 * 512 FLOPs per key and head,
    which outweighs reading the 1,152-byte latent with 128 heads on a rank (tp 1), not with 16 (tp 8).
    Other models keep 4 * head_dim; with several groups an MLA group reads at the same per-key cost."""
    from sim.catalog import ModelSpec
    from sim.config import RooflineConfig
    from sim.steptime import RooflineStepTime

    m, gpu, cfg = MODELS["deepseek-v3"], GPUS["h200"], RooflineConfig()
    flops, bw = gpu.flops_per_s * cfg.attention_efficiency, gpu.hbm_bytes_per_s * cfg.bandwidth_efficiency
    for layout in (None, kv_layout(m, 8, 16)):
        st = RooflineStepTime(m, gpu, 8, cfg, paged=True, layout=layout)
        assert st._pair_s == pytest.approx((2 * 192 + 2 * 128) * 16 * 61 / flops, rel=1e-12)
        assert st._key_s == pytest.approx(61 * 1152 / bw, rel=1e-12)  # 16 heads: the latent's bytes
    for layout in (None, kv_layout(m, 1, 16)):
        st = RooflineStepTime(m, gpu, 1, cfg, paged=True, layout=layout)
        assert st._key_s == pytest.approx(61 * (2 * 576 + 2 * 512) * 128 / flops, rel=1e-12)  # 128 heads: FLOPs
    llama = RooflineStepTime(MODELS["llama-3-8b"], gpu, 1, cfg, paged=True)
    assert llama._pair_s == pytest.approx(4 * 128 * 32 * 32 / flops, rel=1e-12)
    hybrid = ModelSpec("t", 2, 2048, 128, 128, 4096, 1000, 4096, True, False, head_dim=192, layer_kinds=("mla", "mamba"),
                       kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, mamba_d_inner=4096,
                       mamba_d_state=16, mamba_d_conv=4, mamba_dt_rank=128)
    st = RooflineStepTime(hybrid, gpu, 1, cfg, paged=True, layout=kv_layout(hybrid, 1, 16))
    assert [(k, key_s, pair_s) for k, _, key_s, pair_s in st._groups] == [
        ("mla", pytest.approx((2 * 576 + 2 * 512) * 128 / flops, rel=1e-12), pytest.approx(640 * 128 / flops, rel=1e-12))]


def test_a_wide_shared_expert_is_priced_at_its_width():
    """Qwen2-MoE's shared expert is shared_expert_ffn_size (20480) wide, not an expert's 2560."""
    from dataclasses import replace

    from sim.catalog import ModelSpec
    from sim.config import RooflineConfig
    from sim.steptime import RooflineStepTime

    qwen = ModelSpec("qwen2-57b-a14b", 28, 3584, 28, 4, 18944, 151936, 32768, True, False, num_experts=64,
                     num_experts_per_tok=8, moe_ffn_size=2560, num_shared_experts=1, shared_expert_ffn_size=20480,
                     moe_layers=tuple(range(28)))
    assert qwen.num_params / 1e9 == pytest.approx(57.4, abs=0.05)
    cfg = RooflineConfig(operators="datasheet")
    wide, narrow = (RooflineStepTime(x, GPUS["h100"], 1, cfg, paged=True)
                    for x in (qwen, replace(qwen, shared_expert_ffn_size=0)))
    g = wide.ops.gemm_s
    for t in (1, 4096):
        extra = 28 * (g(t, 2 * 20480, 3584) + g(t, 3584, 20480) - g(t, 2 * 2560, 3584) - g(t, 3584, 2560))
        assert wide._modern_layers_s(t) - narrow._modern_layers_s(t) == pytest.approx(extra, rel=1e-9)


# ------------------------------------------------------------------------------------------ bad input


def _config(tmp_path, **over):
    cfg = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 2048,
           "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
           "sliding_window": 64}
    cfg.update(over)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_config_json_quantization_sets_the_weights_bytes(tmp_path):
    """fp8 (DeepSeek-V3): every linear layer at a byte; MXFP4 (gpt-oss): only the experts are packed."""
    fp8 = model_from_hf_config(_config(tmp_path, quantization_config={"quant_method": "fp8", "fmt": "e4m3"}))
    assert (fp8.weight_bytes, fp8.dense_weight_bytes) == (1, 1)
    mx = model_from_hf_config(_config(tmp_path, quantization_config={"quant_method": "mxfp4"}))
    assert (mx.weight_bytes, mx.dense_weight_bytes) == (0.56, 0)
    plain = model_from_hf_config(_config(tmp_path))
    assert (plain.weight_bytes, plain.dense_weight_bytes) == (0, 0)


def test_config_json_layer_kinds(tmp_path):
    m = model_from_hf_config(_config(tmp_path))
    assert m.layer_kinds == ("sliding",) * 3 + ("full",) and m.sliding_window == 64
    g = model_from_hf_config(_config(tmp_path, layer_types=None, sliding_window_pattern=2))
    assert g.layer_kinds == ("sliding", "full", "sliding", "full")
    g2 = model_from_hf_config(_config(tmp_path, layer_types=None, model_type="gemma2"))  # implied: alternating
    assert g2.layer_kinds == ("sliding", "full", "sliding", "full")
    mla = model_from_hf_config(_config(tmp_path, layer_types=None, sliding_window=None, kv_lora_rank=64,
                                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32))
    assert mla.layer_kinds == ("mla",) * 4 and mla.kv_bytes_per_token(1) == 4 * 80 * 2


@pytest.mark.parametrize("over, key", [
    ({"layer_types": ["sliding_attention", "global_linear", "full_attention", "full_attention"]}, "layer_types\\[1\\]"),
    ({"layer_types": ["full_attention"] * 3}, "'layer_types' has 3 entries but num_hidden_layers is 4"),
    ({"sliding_window": 4096}, "'sliding_window' 4096 is larger than max_position_embeddings 2048"),
])
def test_bad_layouts_name_the_key(tmp_path, over, key):
    with pytest.raises(CatalogError, match=key):
        model_from_hf_config(_config(tmp_path, **over))


def test_fp8_kv_on_a_gpu_without_fp8_names_the_key():
    s = parse_scenario({"name": "t", "model": "llama-3-8b", "gpu": "a100-80gb", "policies": [
        {"preset": "vllm", "kv_cache_dtype": "fp8"}], "workload": {"arrival": {"kind": "poisson", "rate": 1},
                                                                   "lengths": "sharegpt", "num_requests": 5}})
    with pytest.raises(ScenarioError, match="kv_cache_dtype: fp8 needs a GPU with fp8 support; a100-80gb has none "
                                            "in the catalog"):
        resolve_policy(s, s.model_spec(), s.gpu_spec(), s.policies[0])
    inline = replace(s.gpu_spec(), name="mine")  # an inline gpu: {name: mine, ...}, fp8 not given
    with pytest.raises(ScenarioError, match=r"mine has none \(an inline gpu gets it with fp8: true\)"):
        resolve_policy(s, s.model_spec(), inline, s.policies[0])


# ------------------------------------------------------------------------------------------ allocators (hypothesis)


def _paged(kinds=("sliding", "sliding", "full", "mamba"), window=40, blocks=400, caching=False):
    from sim.catalog import ModelSpec
    m = ModelSpec("t", len(kinds), 256, 4, 2, 512, 1000, 4096, True, False, layer_kinds=tuple(kinds),
                  sliding_window=window, attention_chunk_size=window, mamba_d_inner=256, mamba_d_state=4,
                  mamba_d_conv=4, mamba_dt_rank=16)
    lay = kv_layout(m, 1, 8)
    return HybridPagedKv(lay, (SharedBlockPool if caching else FifoBlockPool)(blocks, 8), caching), lay


def _check_paged(kv: HybridPagedKv, seqs):
    held = [b for s in seqs for b in kv.table(s)]
    assert len(held) == len(set(held)), "a page has two owners"
    assert len(held) + kv.blocks.num_free == kv.blocks.num_blocks, "a page leaked"
    assert kv.alloc == len(held) * kv.block_size
    B = kv.block_size
    filled = 0
    for s in seqs:
        p = kv._st[s]
        end, firsts, tables, state = p.end, p.firsts, p.tables, p.state
        c = s.num_computed_tokens
        assert end * B >= c
        for (g, n), f, t in zip(kv.classes, firsts, tables):
            assert len(t) == n * (end - f)
            assert f <= first_kept(g, max(c - 1, 0), B) or f == first_kept(g, c, B)  # freed only out of the window
            assert f * B <= c
            filled += n * (c - f * B)
        assert len(state) == kv.state_pages
        filled += len(state) * B
    logical = sum(s.num_computed_tokens for s in seqs)
    assert logical * kv.fill_rate - kv.shared_filled == filled
    # the memory figure by layer group: each class's pages, then the Mamba states; they add up to alloc
    per_class = [sum(len(kv._st[s].tables[i]) for s in seqs) * B for i in range(len(kv.classes))]
    states = [len(seqs) * kv.state_pages * B] if kv.state_pages else []
    assert kv.group_slots() == per_class + states and len(kv.group_labels()) == len(kv.group_slots())
    assert sum(kv.group_slots()) == kv.alloc
    # the GPU replay's view: each attention group's pages by token block (-1: freed), the seq's pages once each
    tables = kv.group_tables([s.seq_id for s in seqs])
    assert len(tables) == kv.layout.num_attention_groups
    for j, s in enumerate(seqs):
        end, firsts, state = kv._st[s].end, kv._st[s].firsts, kv._st[s].state
        rows = [t[j] for t in tables]
        assert all(len(r) == end for r in rows)
        kept = [b for r in rows for b in r if b >= 0]
        assert sorted(kept + state) == sorted(kv.table(s))
        assert sorted(r.count(-1) for r in rows) == sorted(f for f, (_, n) in zip(firsts, kv.classes) for _ in range(n))
    classes = breakdown(kv.capacity, filled, kv.alloc, kv.capped, kv.rounding, kv.held, False)
    assert sum(classes) == kv.capacity and min(classes) >= 0
    # the address-space picture: numpy over all pages, the same runs as a page-by-page loop; covers the pool
    captured = kv.capture(seqs)
    for blocked in (False, True):
        segs = kv.segments(captured, blocked)
        assert np.array_equal(segs, _segments_page_by_page(kv, captured, blocked))
        assert segs[:, 1].sum() == kv.blocks.num_blocks * B and (segs[1:, 0] == segs[:-1, 0] + segs[:-1, 1]).all()


def _segments_page_by_page(kv, captured, blocked):
    """``HybridPagedKv.segments`` as it was, a Python loop over the pages: the reference for its numpy form."""
    from sim.kv import SLOT_EXTERNAL, SLOT_FREE, SLOT_TOKEN, _fill_runs, _merge_segments

    B = kv.block_size
    seqs, (free, fresh) = captured
    segs: list = []
    seen = set() if kv.caching else None
    for firsts, tables, state, filled, cap in seqs:
        for (_, n), f, table in zip(kv.classes, firsts, tables):
            for j, b in enumerate(table):
                if seen is not None:
                    if b in seen:
                        continue
                    seen.add(b)
                lo = (f + j // n) * B
                if lo + B <= filled:
                    segs.append((b * B, B, SLOT_TOKEN))
                else:
                    _fill_runs(b * B, min(max(filled - lo, 0), B), min(max(cap - lo, 0), B), B, segs)
        for b in state:
            _fill_runs(b * B, B, B, B, segs)
    idle = SLOT_EXTERNAL if blocked else SLOT_FREE
    segs.extend((b * B, B, idle) for b in free)
    segs.append((fresh * B, (kv.blocks.num_blocks - fresh) * B, idle))
    return _merge_segments(segs)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([("sliding", "sliding", "full", "mamba"), ("chunked", "full"), ("sliding",)]),
       st.lists(st.tuples(st.integers(1, 120), st.integers(1, 150), st.integers(1, 64)), min_size=1, max_size=8),
       st.integers(0, 400))
def test_hybrid_paged_accounting(kinds, reqs, steps):
    """Admit requests (prompt, output, prefill chunk), decode them a token at a time and finish them: pages
    are owned once, never leak, window groups hold nothing out of their window beyond the last crossing,
    and the memory classes add up to the pool."""
    kv, lay = _paged(kinds)
    live = []
    waiting = [Sequence(i, 0.0, p, o) for i, (p, o, _) in enumerate(reqs)]
    chunk = {i: ch for i, (_, _, ch) in enumerate(reqs)}
    for _ in range(steps):
        if waiting and kv.can_admit(waiting[0], min(chunk[waiting[0].seq_id], waiting[0].prompt_tokens)):
            s = waiting.pop(0)
            kv.admit(s, min(chunk[s.seq_id], s.prompt_tokens))
            s.num_computed_tokens = min(chunk[s.seq_id], s.prompt_tokens)
            live.append(s)
        for s in list(live):
            left = s.prompt_tokens + s.output_tokens - 1 - s.num_computed_tokens
            if left <= 0:
                kv.free(s)
                live.remove(s)
                continue
            n = min(left, chunk[s.seq_id]) if s.num_computed_tokens < s.prompt_tokens else 1
            if not kv.can_grow(s, n):
                kv.free(s)  # preempted
                s.num_computed_tokens = 0
                live.remove(s)
                continue
            kv.grow(s, n)
            s.num_computed_tokens += n
        _check_paged(kv, live)
    for s in live:
        kv.free(s)
    assert kv.blocks.num_free == kv.blocks.num_blocks and kv.alloc == 0 and kv.capped == 0 and kv._first_sum == 0


def test_window_blocks_are_freed_as_they_leave():
    kv, lay = _paged(("sliding", "full"), window=32, blocks=1000)
    s = Sequence(0, 0.0, 8, 500)
    kv.admit(s, 8)
    s.num_computed_tokens = 8
    for _ in range(300):
        kv.grow(s, 1)
        s.num_computed_tokens += 1
    end, firsts, tables = kv._st[s].end, kv._st[s].firsts, kv._st[s].tables
    assert len(tables[1]) == end and len(tables[0]) <= 32 // 8 + 1  # full keeps all, sliding W/B + 1
    assert kv.blocks.num_free == 1000 - len(tables[0]) - len(tables[1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=10))
def test_hybrid_contiguous_accounting(reqs):
    _, lay = _paged(("sliding", "sliding", "full", "mamba"))
    kv = HybridContiguousKv(lay, BuddyAllocator(4000), Reservation("oracle", 4096))
    live = []
    for i, (p, o) in enumerate(reqs):
        s = Sequence(i, 0.0, p, o)
        if kv.can_admit(s, p):
            kv.admit(s, p)
            s.num_computed_tokens = p
            live.append(s)
            # a window group reserves at most W: 2 groups x min(p + o, 40), the full group p + o, Mamba its state
            assert s.slab_tokens == 2 * min(p + o, 40) + (p + o) + lay.groups[-1].state_pages * 8
    filled = sum(kv._slots(s.num_computed_tokens) for s in live)
    assert sum(s.num_computed_tokens for s in live) - kv.shared_filled == filled
    assert sum(kv.group_slots()) == kv.alloc  # the memory figure by layer group: the slabs' shares
    assert [k for k, _, _ in kv.group_labels()] == ["full", "sliding", "mamba"]
    if live:  # a decode span: shared_filled after each of the next k steps, in closed form
        span = kv.span_shared_filled(60)
        assert span[0] == kv.shared_filled
        span = span[1:]
        for j in range(60):
            for s in live:
                s.num_computed_tokens += 1
            assert span[j] == kv.shared_filled
    classes = breakdown(kv.capacity, filled, kv.alloc, kv.capped, kv.rounding, kv.held, False)
    assert sum(classes) == kv.capacity and min(classes) >= 0
    for s in live:
        kv.free(s)
    assert kv.alloc == kv.capped == kv.rounding == 0 and kv.group_slots() == [0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([("sliding", "sliding", "full", "mamba"), ("chunked", "full"), ("sliding", "full")]),
       st.lists(st.tuples(st.integers(1, 120), st.integers(20, 300)), min_size=1, max_size=6),
       st.integers(1, 400))
def test_add_blocks_is_grow_at_crossings(kinds, reqs, blocks):
    """The decode fast path (``add_blocks``: every crossing sequence's pages in one call) leaves the same
    tables, counters and free queue as growing each sequence by one token at its crossing."""
    pair = [_paged(kinds, window=24, blocks=blocks)[0] for _ in range(2)]
    seqs = [[Sequence(i, 0.0, p, o) for i, (p, o) in enumerate(reqs)] for _ in range(2)]
    for kv, ss in zip(pair, seqs):
        for s in ss:
            if kv.can_admit(s, s.prompt_tokens):
                kv.admit(s, s.prompt_tokens)
                s.num_computed_tokens = s.prompt_tokens
    for _ in range(300):
        cross = [[s for s in ss if s in kv._st and s.num_computed_tokens % kv.block_size == 0
                  and s.num_computed_tokens < s.prompt_tokens + s.output_tokens - 1] for kv, ss in zip(pair, seqs)]
        if not pair[0].pool.can_allocate(len(cross[0])):
            break
        if cross[0]:
            pair[0].add_blocks(cross[0])
        for s in cross[1]:
            pair[1].grow(s, 1)
        for kv, ss in zip(pair, seqs):
            for s in ss:
                if s in kv._st and s.num_computed_tokens < s.prompt_tokens + s.output_tokens - 1:
                    s.num_computed_tokens += 1
    a, b = pair
    assert a._st.keys() == b._st.keys() or [s.seq_id for s in a._st] == [s.seq_id for s in b._st]
    assert [(p.end, p.firsts, p.tables) for p in a._st.values()] == [(p.end, p.firsts, p.tables) for p in b._st.values()]
    assert (a.alloc, a.capped, a._first_sum, a.group_slots()) == (b.alloc, b.capped, b._first_sum, b.group_slots())
    assert a.blocks.free_blocks == b.blocks.free_blocks


# ------------------------------------------------------------------------------------------ whole runs


def _tiny(tmp_path, **over):
    cfg = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
           "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 2048}
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


TINY = {"window": {"layer_types": ["sliding_attention"] * 3 + ["full_attention"], "sliding_window": 64},
        "sliding_only": {"sliding_window": 64},  # one group, which frees pages as its window slides
        "chunked": {"attention_chunk_size": 128, "no_rope_layers": [1, 1, 1, 0]},
        "mamba": {"layer_types": ["mamba", "mamba", "mamba", "full_attention"], "mamba_d_state": 8,
                  "mamba_d_conv": 4, "mamba_expand": 2},
        "mla": {"kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}}
POLICIES = ["orca-oracle", "vllm-v1",
            {"preset": "vllm", "name": "mixed-paged", "prefill": "mixed"},
            {"preset": "vllm-v1", "name": "swap", "preemption": "swap", "swap_space_gib": 0.002},
            {"preset": "vllm", "name": "full", "hybrid_allocator": False}]


def _scenario(path, kind, exact=False, **over):
    pols = [p for p in POLICIES if not (kind == "mamba" and isinstance(p, dict) and p["name"] == "full")]
    data = {
        "name": kind, "model": path, "exact": exact, "runtime_overhead_gib": 0, "decompose": False,
        "gpu": {"name": "tiny", "memory_gib": {"mla": 0.0472, "mamba": 0.057}.get(kind, 0.06),
                "hbm_gb_per_s": 100, "tflops": 10,
                "fp8": True},
        "workload": {"arrival": {"kind": "poisson", "rate": 300 if kind == "mla" else 30}, "num_requests": 30, "seed": 3,
                     "prompt": {"kind": "uniform", "low": 1, "high": 400},
                     "output": {"kind": "uniform", "low": 1, "high": 150}},
        "policies": pols}
    data.update(over)
    return parse_scenario(data)


@pytest.mark.parametrize("kind", list(TINY))
def test_exact_and_fast_stepping_agree(tmp_path, monkeypatch, kind):
    """Window freeing, chunked freeing, Mamba state and MLA: stepping every iteration (exact) and skipping
    quiet decode spans give the same answers (paged and contiguous policies take spans). For the window
    model, the scheduler's per-sequence path, forced at every step, also gives what its fast decode path
    gives: pages leave a window at the same moment on both."""
    from test_engine import assert_same_requests

    path = _tiny(tmp_path, **TINY[kind])
    fast = run(_scenario(path, kind))
    others = [run(_scenario(path, kind, exact=True))]
    for name in ("vllm-v1", "orca-oracle"):  # spans were taken, paged and contiguous
        assert len(fast.policies[name].steps) < len(others[0].policies[name].steps), name
    if kind == "window":
        monkeypatch.setattr(_CrossingPool, "can_allocate", lambda self, n, admission=False: n == 0)
        others.append(run(_scenario(path, kind)))
    preempted = 0
    for name, res in fast.policies.items():
        for other in others:
            assert_same_requests(res.requests, other.policies[name].requests)
            for c in MEMORY_CLASSES:
                assert res.summary[f"memory.{c}"] == pytest.approx(other.policies[name].summary[f"memory.{c}"],
                                                                     rel=1e-6, abs=1e-12), (name, c)
        assert res.summary["num_finished"] == 30, name
        st_ = res.steps
        total = st_[[f"mem_{c}" for c in MEMORY_CLASSES]].sum(axis=1)
        assert np.allclose(total, res.summary["kv_capacity_tokens"])
        assert (st_[[f"mem_{c}" for c in MEMORY_CLASSES]] >= -1e-9).all().all()
        preempted += res.summary["num_preemptions"]
    assert preempted > 0  # memory is what limits these runs


def test_hybrid_allocator_and_fp8_serve_more(tmp_path):
    """On the tiny window model, the hybrid allocator (window groups keep 64 tokens) serves the same
    requests faster than keeping every layer whole, and fp8 halves the page bytes."""
    path = _tiny(tmp_path, **TINY["window"])
    r = run(_scenario(path, "window", policies=[
        {"preset": "vllm", "name": "hybrid"}, {"preset": "vllm", "name": "full", "hybrid_allocator": False},
        {"preset": "vllm", "name": "hybrid-fp8", "kv_cache_dtype": "fp8"}]))
    m = {n: res.summary for n, res in r.policies.items()}
    assert m["hybrid"]["request_throughput"] > m["full"]["request_throughput"]
    assert m["hybrid"]["num_preemptions"] < m["full"]["num_preemptions"]
    assert r.policies["hybrid-fp8"].pool.num_blocks >= 2 * r.policies["hybrid"].pool.num_blocks - 1


def test_memory_by_layer_group_table(tmp_path):
    """kv_groups.parquet: one series per group class for the multi-group policies only (paged and contiguous),
    labelled by kind and window, within the pool; a run of single-group policies writes no such file."""
    import pandas as pd

    from sim.run import write_results

    path = _tiny(tmp_path, **TINY["window"])
    r = run(_scenario(path, "window", policies=[
        {"preset": "vllm", "name": "hybrid"}, {"preset": "orca-oracle", "name": "slabs"},
        {"preset": "vllm", "name": "full", "hybrid_allocator": False}]))
    write_results(r, tmp_path / "out")
    g = pd.read_parquet(tmp_path / "out" / "kv_groups.parquet")
    assert set(g["policy"].astype(str)) == {"hybrid", "slabs"}  # the single-group policy writes nothing here
    assert set(g["group"]) == {"full (1 group)", "sliding W=64 (3 groups)"}
    cap = r.policies["hybrid"].summary["kv_capacity_tokens"]
    assert (g["slots"] >= 0).all() and (g["slots"] <= cap).all()
    assert (g[g["policy"] == "hybrid"].groupby("bin_start_s")["slots"].sum() <= cap + 1e-6).all()
    only_full = run(_scenario(path, "window", policies=[{"preset": "vllm", "name": "full", "hybrid_allocator": False}]))
    write_results(only_full, tmp_path / "full")
    assert not (tmp_path / "full" / "kv_groups.parquet").exists()


def test_memory_by_layer_group_splits_a_record_across_the_bins_it_covers():
    """A step, span or idle gap that crosses bin edges counts in each bin by the time it spends there (it was
    charged whole to the bin where it starts: bin 1 below had no row, bin 2 read 30 slots)."""
    from sim.hybrid import GroupTimeline

    class Kv:
        slots = (0.0,)

        def group_labels(self):
            return [("full", 0, 1)]

        def group_slots(self):
            return self.slots

    kv = Kv()
    g = GroupTimeline(kv)
    kv.slots = (10.0,)
    g.add(0.5, 2.0)  # 0.5 s in bin 0, 1 s in bin 1, 0.5 s in bin 2
    kv.slots = (30.0,)
    g.add(2.5, 0.5)
    t = g.table(1.0)
    assert t["bin_start_s"].tolist() == [0.0, 1.0, 2.0]
    assert t["slots"].tolist() == pytest.approx([10.0, 10.0, 20.0])


# ------------------------------------------------------------------------------------------ prefix caching


def _prefilled(kv, seq, chunk: int) -> None:
    """Prefill ``seq`` in chunks as the scheduler does (grow, compute, register), then decode one token."""
    while seq.num_computed_tokens < seq.prompt_tokens:
        n = min(chunk, seq.prompt_tokens - seq.num_computed_tokens)
        if seq.num_computed_tokens:
            kv.grow(seq, n)
        else:
            kv.admit(seq, n)
        seq.num_computed_tokens += n
        kv.register(seq)
    kv.grow(seq, 1)
    seq.num_computed_tokens += 1


def test_window_prefix_hit_rule_by_hand():
    """Blocks of 8, a sliding group (W = 24) and a full group, one page per block each. A prompt of 64
    tokens (ids 1..8, one per block) prefilled in chunks of 8: its sliding pages of blocks 0..4 leave the
    window one per chunk (at 32, 40, 48, 56 cached tokens, and 64 when it decodes), so they reach the free
    queue first, oldest first; then the request finishes (each table freed tail first). A second request
    of the same 64 tokens may hit 7 blocks (one token left to compute): the full group needs blocks 0..6,
    the sliding group only those covering the 23 tokens before 56, blocks 4, 5, 6."""
    kv, _ = _paged(("sliding", "full"), window=24, blocks=18, caching=True)
    assert [g.kind for g, _ in kv.classes] == ["sliding", "full"]
    ids = np.arange(1, 9)
    a = Sequence(0, 0.0, 64, 10, prefix_ids=ids, hash_block=8)
    _prefilled(kv, a, 8)
    kv.free(a)
    pool = kv.blocks
    # pages in fresh order: block i's sliding page is 2i, its full page 2i + 1 (18 pages: all used)
    assert pool.free_blocks[:5] == [0, 2, 4, 6, 8] and pool.num_free == 18 and kv.alloc == 0

    def hit_after_evicting(n_pages):
        k2, _ = _paged(("sliding", "full"), window=24, blocks=18, caching=True)
        a2 = Sequence(0, 0.0, 64, 10, prefix_ids=ids, hash_block=8)
        _prefilled(k2, a2, 8)
        k2.free(a2)
        for j in range(n_pages // 2):  # unrelated one-token prompts: a sliding and a full page each
            other = Sequence(10 + j, 0.0, 1, 5, prefix_ids=np.array([100 + j]), hash_block=8)
            k2.admit(other, 1)
        b = Sequence(1, 0.0, 64, 10, prefix_ids=ids, hash_block=8)
        return k2.match_prefix(b)

    hits = hit_after_evicting(0)
    assert len(hits) == 7
    assert [row[0] is None for row in hits] == [True] * 4 + [False] * 3  # sliding: blocks 4..6 only
    assert [row[1] for row in hits] == [[2 * i + 1] for i in range(7)]  # full: blocks 0..6
    assert [row[0] for row in hits[4:]] == [[8], [10], [12]]
    # sliding pages of blocks 0..3 evicted: the full group still has 0..6, the window needs only 4..6
    assert len(hit_after_evicting(4)) == 7
    # then block 4's sliding page too: a hit at h needs sliding blocks [(8h + 1 - 24) // 8, h), and every
    # h from 1 to 7 needs one of blocks 0..4 -- no hit, though the full group alone would give 7
    assert hit_after_evicting(6) == []


def test_chunked_and_full_hit_rule_by_hand():
    """A chunked group (C = 32) needs the blocks of the current chunk before the hit: a 64-token prompt's
    hit of 7 blocks (56 tokens) needs blocks 4..6 (chunk 32..63); at 4 blocks (32 tokens) none."""
    kv, _ = _paged(("chunked", "full"), window=32, blocks=400, caching=True)
    ids = np.arange(1, 9)
    a = Sequence(0, 0.0, 64, 10, prefix_ids=ids, hash_block=8)
    _prefilled(kv, a, 64)
    hits = kv.match_prefix(Sequence(1, 0.0, 64, 10, prefix_ids=ids, hash_block=8))
    assert len(hits) == 7 and [row[0] is None for row in hits] == [True] * 4 + [False] * 3
    # a prompt sharing only the first 5 blocks: hit 5 blocks, the chunked group needs block 4 only
    other = np.array([1, 2, 3, 4, 5, 60, 70, 80])
    hits = kv.match_prefix(Sequence(2, 0.0, 64, 10, prefix_ids=other, hash_block=8))
    assert len(hits) == 5 and [row[0] is None for row in hits] == [True] * 4 + [False]


def _check_shared(kv: HybridPagedKv, seqs):
    """Pages may have several holders: each holder's tables as without sharing, the pool's reference
    counts equal to the holders, the counters physical, and the memory classes adding up to the pool."""
    from collections import Counter

    B = kv.block_size
    held = Counter(b for s in seqs for b in kv.table(s))
    pool = kv.blocks
    assert all(pool.ref_cnt[b] == n for b, n in held.items()), "reference counts != holders"
    assert len(held) + pool.num_free == pool.num_blocks, "a page leaked"
    assert kv.alloc == len(held) * B and kv.shared_blocks == sum(held.values()) - len(held)
    filled = capped = 0
    seen = set()
    for s in seqs:
        end, firsts, tables = kv._st[s].end, kv._st[s].firsts, kv._st[s].tables
        c = s.num_computed_tokens
        for (g, n), f, t in zip(kv.classes, firsts, tables):
            assert len(t) == n * (end - f) and f * B <= c
            for j, b in enumerate(t):
                lo = (f + j // n) * B
                if b not in seen:  # a shared page counts once: a full prompt block for every holder
                    seen.add(b)
                    filled += min(max(c - lo, 0), B)
                    capped += min(max(s.max_kv_tokens - lo, 0), B)
                else:
                    assert c >= lo + B and s.max_kv_tokens >= lo + B
    logical = sum(s.num_computed_tokens for s in seqs)
    assert logical * kv.fill_rate - kv.shared_filled == filled and kv.capped == capped
    per_class = [len({b for s in seqs for b in kv._st[s].tables[i]}) * B for i in range(len(kv.classes))]
    assert kv.group_slots() == per_class and sum(per_class) == kv.alloc
    classes = breakdown(kv.capacity, filled, kv.alloc, kv.capped, kv.rounding, kv.held, False)
    assert sum(classes) == kv.capacity and min(classes) >= 0
    # the address-space picture: numpy over all pages, the same runs as a page-by-page loop; covers the pool
    captured = kv.capture(seqs)
    for blocked in (False, True):
        segs = kv.segments(captured, blocked)
        assert np.array_equal(segs, _segments_page_by_page(kv, captured, blocked))
        assert segs[:, 1].sum() == kv.blocks.num_blocks * B and (segs[1:, 0] == segs[:-1, 0] + segs[:-1, 1]).all()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([("sliding", "sliding", "full"), ("chunked", "full"), ("sliding",), ("sliding", "chunked")]),
       st.lists(st.tuples(st.integers(1, 120), st.integers(1, 80), st.integers(1, 64), st.integers(0, 3)),
                min_size=1, max_size=10),
       st.integers(0, 300), st.integers(30, 200))
def test_hybrid_prefix_caching_accounting(kinds, reqs, steps, blocks):
    """Requests of a few shared prefixes (ids per block: the prefix's, then their own) admitted with their
    hits, prefilled in chunks, decoded and finished or preempted (keeping every full block it computed
    findable, generated ones too): pages are held by exactly their holders,
    nothing leaks, the counters stay physical and the memory classes add up, with every group's hit rule."""
    kv, lay = _paged(kinds, window=24, blocks=blocks, caching=True)
    live, waiting = [], []
    for i, (p, o, ch, pre) in enumerate(reqs):
        ids = np.array([pre * 1000 + j for j in range(10)] + [10_000 * (i + 1) + j for j in range(20)])
        waiting.append((Sequence(i, 0.0, p, o, prefix_ids=ids, hash_block=8), ch))
    chunk = {s: ch for s, ch in waiting}
    hit_blocks = 0
    for _ in range(steps):
        if waiting:
            s = waiting[0][0]
            hits = kv.match_prefix(s)
            n = min(chunk[s], s.num_tokens - len(hits) * 8)  # (a recomputed one: its generated tokens too)
            if kv.can_admit(s, n, hits):
                waiting.pop(0)
                kv.admit(s, n, hits)
                hit_blocks += len(hits)
                assert s.num_computed_tokens == len(hits) * 8
                s.num_computed_tokens += n
                kv.register(s)
                live.append(s)
        for s in list(live):
            left = s.prompt_tokens + s.output_tokens - 1 - s.num_computed_tokens
            if left <= 0:
                kv.free(s)
                live.remove(s)
                continue
            n = min(left, chunk[s]) if s.num_computed_tokens < s.prompt_tokens else 1
            if not kv.can_grow(s, n):  # preempted: recomputed later, finding what it computed and is not evicted
                s.num_output_tokens = max(0, s.num_computed_tokens - s.prompt_tokens + 1)
                kv.keep(s)
                kv.free(s)
                s.num_computed_tokens = 0
                s.num_registered = 0
                live.remove(s)
                waiting.append((s, chunk[s]))
                continue
            kv.grow(s, n)
            s.num_computed_tokens += n
            kv.register(s)
        _check_shared(kv, live)
    for s in live:
        kv.free(s)
    assert kv.blocks.num_free == kv.blocks.num_blocks and kv.alloc == 0 and kv.capped == 0
    assert kv.shared_blocks == 0 and kv._first_sum == 0


SHARED_WORKLOAD = {"arrival": {"kind": "poisson", "rate": 30}, "num_requests": 60, "seed": 3,
                   "prompt": {"kind": "uniform", "low": 1, "high": 300},
                   "output": {"kind": "uniform", "low": 1, "high": 150},
                   "shared_prefixes": {"lengths": [64, 200], "popularity": [3, 1]}}
CACHING_POLICIES = [{"preset": "vllm", "name": "apc", "prefix_caching": True},
                    {"preset": "vllm-v1", "name": "apc-v1", "prefix_caching": True},
                    {"preset": "vllm-v1", "name": "apc-swap", "prefix_caching": True, "preemption": "swap",
                     "swap_space_gib": 0.002}]


@pytest.mark.parametrize("kind", ["window", "chunked", "sliding_only"])
def test_prefix_caching_exact_and_fast_agree(tmp_path, monkeypatch, kind):
    """Prefix caching with window freeing: stepping every iteration, skipping decode spans (cached pages
    leave windows inside spans, and stop being shared there) and, for the window model, the scheduler's
    per-sequence path forced at every step give the same requests, memory classes and sharing figures."""
    from test_engine import assert_same_requests

    path = _tiny(tmp_path, **TINY[kind])
    make = lambda exact: _scenario(path, kind, exact, policies=CACHING_POLICIES, workload=SHARED_WORKLOAD)  # noqa: E731
    fast = run(make(False))
    others = [run(make(True))]
    if kind == "window":
        monkeypatch.setattr(_CrossingPool, "can_allocate", lambda self, n, admission=False: n == 0)
        others.append(run(make(False)))
    for name, res in fast.policies.items():
        assert len(res.steps) < len(others[0].policies[name].steps)
        for other in others:
            o = other.policies[name]
            assert_same_requests(res.requests, o.requests)
            for key in [f"memory.{c}" for c in MEMORY_CLASSES] + ["memory_saved_by_sharing"]:
                assert res.summary[key] == pytest.approx(o.summary[key], rel=1e-6, abs=1e-12), (name, key)
            for key in ("prefix_hit_rate_tokens", "prefill_tokens_saved", "num_evicted_blocks"):
                assert res.summary[key] == o.summary[key], (name, key)
        assert res.summary["num_finished"] == 60 and res.summary["prefix_hit_rate_tokens"] > 0.1
        total = res.steps[[f"mem_{c}" for c in MEMORY_CLASSES]].sum(axis=1)
        assert np.allclose(total, res.summary["kv_capacity_tokens"])
        assert (res.steps[[f"mem_{c}" for c in MEMORY_CLASSES]] >= -1e-9).all().all()


def test_prefix_caching_refusals_name_the_key(tmp_path):
    """Mamba state is not cached by prefix; samples, beams and a CPU tier are not simulated with several
    groups: each refused up front, naming the key."""
    cases = [("mamba", {"preset": "vllm", "prefix_caching": True}, {}, "prefix_caching: .* Mamba layers"),
             ("window", {"preset": "vllm", "prefix_caching": True, "kv_offload": {"cpu_gib": 1}}, {},
              r"kv_offload .* sliding-window, chunked or Mamba KV groups yet \(.* has \d+ KV groups \(full, sliding\)\)"),
             ("window", {"preset": "vllm"}, {"sampling": {"kind": "parallel", "n": 2}},
              "parallel sampling and beam search .* or drop sampling$"),
             # one group, sliding: not "several groups ... has 1", as it read
             ("sliding_only", {"preset": "vllm"}, {"sampling": {"kind": "beam", "width": 2}},
              r"beam search .* yet \(.*'s one KV group is sliding\)")]
    for kind, pol, over, match in cases:
        s = _scenario(_tiny(tmp_path, **TINY[kind]), kind, policies=[pol], **over)
        with pytest.raises(ScenarioError, match=match):
            resolve_policy(s, s.model_spec(), s.gpu_spec(), s.policies[0])


def test_prefix_hit_rate_hybrid_on_and_off(tmp_path):
    """Shared prefixes of 64 and 200 tokens. With memory to spare, the hybrid allocator finds every hit the
    single group finds, whether the window (64) is shorter than the prefixes -- their window pages left the
    window and were freed, yet stay cached -- or longer than any prompt (windows do not matter). Under
    memory pressure too when windows do not matter; with the short window the hybrid rate is lower: a
    window group's pages of a prefix are freed as soon as they leave a holder's window, so they are
    evicted first."""
    rates = {}
    for win in (64, 2048):
        path = _tiny(tmp_path, layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=win)
        for mem in (0.2, 0.065):
            s = _scenario(path, "window", policies=[
                {"preset": "vllm-v1", "name": "on", "prefix_caching": True},
                {"preset": "vllm-v1", "name": "off", "prefix_caching": True, "hybrid_allocator": False}],
                workload=SHARED_WORKLOAD)
            s = s.model_copy(update={"gpu": s.gpu.model_copy(update={"memory_gib": mem})})
            r = run(s)
            for name, res in r.policies.items():
                rates[(win, mem, name)] = res.summary["prefix_hit_rate_tokens"]
                assert res.summary["num_evicted_blocks"] == 0 or mem < 0.2
    ample = rates[(64, 0.2, "off")]
    assert ample > 0.3 and all(rates[(w, 0.2, n)] == ample for w in (64, 2048) for n in ("on", "off"))
    assert all(rates[(w, 0.065, n)] <= ample for w in (64, 2048) for n in ("on", "off"))
    # with a window longer than any prompt the two agree under pressure too; with a short one the window
    # pages of the shared prefixes were evicted first (README: Prefix caching with several groups)
    assert rates[(2048, 0.065, "on")] == rates[(2048, 0.065, "off")] > rates[(64, 0.065, "on")]


def test_spans_wait_for_a_window_to_free_what_admits_a_waiting_request():
    """Gemma-3 under memory pressure: its window groups free pages as it decodes, which can admit a waiting
    request mid-span. Spans took 5 steps where stepping admitted after 1 (request 7 first scheduled at 1.66 s
    against 0.99 s); with requests waiting, such a manager now steps one step at a time."""
    s = parse_scenario({"name": "g", "decompose": False, "model": "gemma-3-27b", "gpu": "h100",
                        "gpu_memory_utilization": 0.72, "policies": [{"preset": "vllm", "name": "p", "block_size": 32}],
                        "workload": {"num_requests": 8, "seed": 1, "arrival": {"kind": "poisson", "rate": 20},
                                     "prompt": {"kind": "fixed", "tokens": 1500},
                                     "output": {"kind": "fixed", "tokens": 1200}}})
    fast = run(s).policies["p"].requests
    exact = run(s.model_copy(update={"exact": True})).policies["p"].requests
    assert np.allclose(fast.first_scheduled_s, exact.first_scheduled_s, rtol=0, atol=1e-9)
    assert np.allclose(fast.finish_s, exact.finish_s, rtol=0, atol=1e-9)


@pytest.mark.parametrize("model, extra, says, not_says", [
    ("jamba-v0.1", {"sampling": {"kind": "parallel", "n": 2}}, "drop sampling", "hybrid_allocator"),
    ("gemma-3-27b", {"sampling": {"kind": "parallel", "n": 2}}, "set hybrid_allocator: false or drop sampling", None),
    ("jamba-v0.1", {"cluster": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": "nvlink"}},
     "its Mamba layers have no other form: run it colocated", "hybrid_allocator"),
    ("gemma-3-27b", {"cluster": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": "nvlink"}},
     "(set hybrid_allocator: false)", None),
])
def test_what_several_kv_groups_cannot_do_says_a_way_out_that_exists(tmp_path, model, extra, says, not_says):
    """A Mamba model was told to set hybrid_allocator: false, itself an error for Mamba layers."""
    import yaml

    from sim.config import ScenarioError
    from sim.run import check_scenario

    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({"name": "s", "model": model, "gpu": "h100", "tensor_parallel": 2, "policies": ["vllm"],
                                 "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "alpaca",
                                              "num_requests": 5}, **extra}))
    with pytest.raises(ScenarioError) as e:
        check_scenario(p)
    assert says in str(e.value) and (not_says is None or not_says not in str(e.value)), str(e.value)
