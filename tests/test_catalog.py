import json
from dataclasses import replace
from pathlib import Path

import pytest

from sim.catalog import MODELS, CatalogError, model_from_hf_config
from sim.kv import CapacityError, activation_bytes, kv_pool
from sim.catalog import GPUS


@pytest.mark.parametrize("name,billions", [("opt-13b", 12.85), ("llama-2-7b", 6.74), ("llama-2-13b", 13.02),
                                            ("llama-2-70b", 68.98), ("llama-3-8b", 8.03), ("llama-3-70b", 70.55),
                                            ("mistral-7b", 7.24)])
def test_parameter_counts_match_published_sizes(name, billions):
    assert MODELS[name].num_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_opt13b_kv_bytes_per_token_is_800_kb():
    # references.md: 2 x 5120 hidden x 40 layers x 2 bytes
    assert MODELS["opt-13b"].kv_bytes_per_token() == 2 * 5120 * 40 * 2


def test_tensor_parallel_divides_kv_heads_and_weights():
    m = MODELS["llama-2-70b"]  # 8 KV heads
    assert m.kv_bytes_per_token(8) == m.kv_bytes_per_token(1) // 8
    assert m.kv_bytes_per_token(16) == m.kv_bytes_per_token(8)  # replicated: at least one head per rank
    one = kv_pool(MODELS["opt-66b"], GPUS["a100-80gb"], tp=4, gpu_memory_utilization=0.9, block_size=16,
                  max_num_seqs=256)
    assert one.weights_bytes == MODELS["opt-66b"].num_params * 2 // 4


def test_opt13b_on_a100_40gb_leaves_about_12_gib_for_kv():
    p = kv_pool(MODELS["opt-13b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=16,
                max_num_seqs=256)
    assert 10 < p.kv_bytes / 2**30 < 13
    assert p.num_slots == p.num_blocks * 16


def test_the_activation_reserve_samples_the_policys_max_num_seqs():
    """vLLM's profiling run samples max_num_seqs rows of fp32 logits; it was sized for 256 whatever the policy."""
    from sim.config import parse_scenario
    from sim.policy import resolve_policy

    m = MODELS["llama-3-8b"]
    s = parse_scenario({"name": "a", "model": "llama-3-8b", "gpu": "h100", "policies": [
        "vllm", {"preset": "vllm", "name": "wide", "max_num_seqs": 1024}],
        "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 1}})
    narrow, wide = (resolve_policy(s, m, GPUS["h100"], p).pool for p in s.policies)
    assert wide.activation_bytes - narrow.activation_bytes == (1024 - 256) * m.vocab_size * 4
    assert wide.num_blocks < narrow.num_blocks and wide.budget_bytes == narrow.budget_bytes
    # at most one row per token of the dummy run (vLLM V1: min(num_tokens, max_num_reqs))
    assert activation_bytes(m, 1, 512, 4096) - activation_bytes(m, 1, 512, 256) == (512 - 256) * m.vocab_size * 4


def test_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(CapacityError, match=r"does not fit on a100-40gb x1: weights 128\.48 GiB .* needs at least "
                                            r"128\.97 GiB"):
        kv_pool(MODELS["llama-2-70b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=16,
                max_num_seqs=256)


def test_a_tiny_device_that_does_not_fit_says_its_sizes_in_mib():
    """A made-up test device of 1.6 MiB: the message gives sizes a reader can act on, not '0.0 GiB'."""
    from dataclasses import replace

    model = model_from_hf_config(Path(__file__).parents[1] / "gpu" / "configs" / "tiny-hybrid.json")
    tiny = replace(GPUS["a100-40gb"], name="tiny", memory_bytes=int(0.0016 * 2**30))
    with pytest.raises(CapacityError, match=r"weights 2\.0 MiB \+ activations 0\.\d MiB .* in 1\.5 MiB .* "
                                            r"needs at least 2\.\d MiB"):
        kv_pool(model, tiny, tp=1, gpu_memory_utilization=0.9, block_size=16, max_num_seqs=256, activation_tokens=16,
                runtime_overhead_gib=0)


def test_one_block_bigger_than_the_room_for_kv_names_block_size():
    with pytest.raises(CapacityError, match=r"one KV block of block_size=65536 tokens takes 32\.00 GiB, more than the "
                                            r".* left for KV cache .*: lower block_size"):
        kv_pool(MODELS["llama-2-7b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=65536,
                max_num_seqs=256)


def test_hf_config_llama_and_opt(tmp_path):
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 8192, "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(llama))
    m = model_from_hf_config(p)
    assert m.num_params == MODELS["llama-3-8b"].num_params
    opt = {"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
           "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048}
    p.write_text(json.dumps(opt))
    assert model_from_hf_config(p).num_params == MODELS["opt-13b"].num_params


@pytest.mark.parametrize("text,msg", [("{", "not valid JSON"), ("[1]", "expected a JSON object"),
                                      ('{"hidden_size": 8}', "missing 'num_attention_heads'"),
                                      ('{"num_attention_heads": 0}', "must be a positive integer"),
                                      ('{"num_attention_heads": 2, "hidden_size": 8, "max_position_embeddings": 1}',
                                       "'max_position_embeddings' must be at least 2, got 1")])
def test_bad_hf_config(tmp_path, text, msg):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(CatalogError, match=msg):
        model_from_hf_config(p)


_TINY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 2048, "max_position_embeddings": 1024}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
_JAMBA = {"attn_layer_period": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}


@pytest.mark.parametrize("fields,msg", [
    # were tracebacks: ZeroDivisionError (a period of 0), TypeError (text where a count goes)
    ({**_MOE, "expert_layer_period": 0}, "'expert_layer_period' must be a positive integer, got 0"),
    ({**_MOE, "interleave_moe_layer_step": 0}, "'interleave_moe_layer_step' must be a positive integer, got 0"),
    ({**_MOE, "interleave_moe_layer_step": "x"}, "'interleave_moe_layer_step' must be a positive integer, got 'x'"),
    ({**_MOE, "first_k_dense_replace": "x"}, "'first_k_dense_replace' must be a whole number (0 or more), got 'x'"),
    ({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": "x"},
     "'n_shared_experts' must be a whole number (0 or more), got 'x'"),
    # were accepted: a negative count, more experts per token than experts, 10^12 positions (past 32 bits)
    ({"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": -3},
     "'n_shared_experts' must be a whole number (0 or more), got -3"),
    ({**_MOE, "first_k_dense_replace": -5}, "'first_k_dense_replace' must be a whole number (0 or more), got -5"),
    ({"num_local_experts": 4, "num_experts_per_tok": 8}, "'num_experts_per_tok' 8 is more than the 4 experts"),
    ({"max_position_embeddings": 10**12}, "'max_position_embeddings' must be at most 2,147,483,647"),
    # state kept per layer: an OverflowError (2**63 layers), a MemoryError (2**40), 1.1 GB (2**27)
    ({"num_hidden_layers": 2**63}, "'num_hidden_layers' must be at most 4,096, got 9,223,372,036,854,775,808"),
    ({"num_hidden_layers": 4097}, "'num_hidden_layers' must be at most 4,096, got 4,097"),
    # 2**1100 overflowed a float (OverflowError); its 332 digits are not echoed
    ({"hidden_size": 2**1100}, "'hidden_size' must be at most 2,147,483,647, got a 332-digit number"),
    ({"vocab_size": 2**40}, "'vocab_size' must be at most 2,147,483,647, got 1,099,511,627,776"),
    ({"num_key_value_heads": 2**31}, "'num_key_value_heads' must be at most 2,147,483,647, got 2,147,483,648"),
    ({**_MOE, "num_local_experts": 2**40}, "'num_local_experts' must be at most 2,147,483,647"),
    ({**_MOE, "first_k_dense_replace": 2**63}, "'first_k_dense_replace' must be at most 2,147,483,647"),
    ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false, got 'no'"),  # read as true
    # said "no attention layer" (every layer Mamba) without naming the key
    ({**_JAMBA, "attn_layer_offset": 5}, "'attn_layer_offset' 5 must be below attn_layer_period 2"),
    ({**_JAMBA, "attn_layer_offset": -1}, "'attn_layer_offset' must be a whole number (0 or more), got -1"),
    ({**_JAMBA, "attn_layer_offset": "x"}, "'attn_layer_offset' must be a whole number (0 or more), got 'x'"),
])
def test_bad_hf_config_layout_fields(tmp_path, fields, msg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**_TINY, **fields}))
    with pytest.raises(CatalogError) as e:
        model_from_hf_config(p)
    assert msg in str(e.value) and str(p) in str(e.value)


def test_hf_config_with_a_5000_digit_number_is_a_clear_error(tmp_path):
    """Python refuses to convert more than 4,300 digits: a ValueError traceback before."""
    p = tmp_path / "config.json"
    p.write_text('{"num_hidden_layers": 1' + "0" * 5000 + "}")
    with pytest.raises(CatalogError, match=r"config.json: cannot read a value \(Exceeds the limit"):
        model_from_hf_config(p)


# Mixture-of-experts config.json files as published on Hugging Face (the fields that set the shape), with the
# published total and active parameter counts (billions; None: published under another convention) and KV bytes
# per token at bf16. Llama 4's are the language model's (text_config), without the vision encoder.
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
            "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
            "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32000}
_DEEPSEEK_V2 = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 5120, "intermediate_size": 12288,
                "moe_intermediate_size": 1536, "num_hidden_layers": 60, "num_attention_heads": 128,
                "num_key_value_heads": 128, "n_shared_experts": 2, "n_routed_experts": 160, "num_experts_per_tok": 6,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
                "tie_word_embeddings": False}
_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
                "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
                "moe_layer_freq": 1, "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128,
                "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
                "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
                "tie_word_embeddings": False}
_QWEN2_57B = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "decoder_sparse_step": 1,
              "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
              "moe_intermediate_size": 2560, "num_attention_heads": 28, "num_experts": 64, "num_experts_per_tok": 8,
              "num_hidden_layers": 28, "num_key_value_heads": 4, "shared_expert_intermediate_size": 20480,
              "sliding_window": 65536, "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936}
_GPT_OSS = {"model_type": "gpt_oss", "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880,
            "intermediate_size": 2880, "max_position_embeddings": 131072, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18, "sliding_window": 128,
            "quantization_config": {"quant_method": "mxfp4"}, "tie_word_embeddings": False, "vocab_size": 201088}


def _llama4(experts: int, step: int, max_len: int) -> dict:
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
            "text_config": {"attention_chunk_size": 8192, "head_dim": 128, "hidden_size": 5120,
                            "interleave_moe_layer_step": step, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                            "max_position_embeddings": max_len, "model_type": "llama4_text", "no_rope_layers": [],
                            "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
                            "num_key_value_heads": 8, "num_local_experts": experts, "vocab_size": 202048}}


def _active_params(m) -> float:
    """Parameters a token uses: all but the routed experts it is not sent to."""
    return m.num_params - len(m.moe_layers) * (m.num_experts - m.num_experts_per_tok) * 3 * m.hidden_size * m.moe_ffn_size


@pytest.mark.parametrize("cfg, total, active, kv", [
    (_MIXTRAL, 46.7, 12.9, 2 * 32 * 8 * 128 * 2),
    (_DEEPSEEK_V2, 236, 21, 60 * (512 + 64) * 2),  # MLA: one latent per token and layer
    (_DEEPSEEK_V3, 671, 37, 61 * (512 + 64) * 2),
    (_QWEN2_57B, 57.4, 14, 2 * 28 * 4 * 128 * 2),  # one shared expert of 20480 beside 64 of 2560
    (_GPT_OSS, 116.8, None, 36 * 2 * 8 * 64 * 2),
    (_llama4(16, 1, 10485760), 107.8, 17, 48 * 2 * 8 * 128 * 2),  # Scout
    (_llama4(128, 2, 1048576), 400, 17, 48 * 2 * 8 * 128 * 2),  # Maverick: dense layers' MLP is 16384 wide
], ids=["mixtral-8x7b", "deepseek-v2", "deepseek-v3", "qwen2-57b-a14b", "gpt-oss-120b", "llama-4-scout",
        "llama-4-maverick"])
def test_hf_config_moe_families_match_published_sizes(tmp_path, cfg, total, active, kv):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = model_from_hf_config(p)
    assert m.num_params / 1e9 == pytest.approx(total, rel=0.005)
    if active is not None:
        assert _active_params(m) / 1e9 == pytest.approx(active, rel=0.02)
    assert m.kv_bytes_per_token() == kv


@pytest.mark.parametrize("cfg, name", [(_DEEPSEEK_V3, "deepseek-v3"), (_GPT_OSS, "gpt-oss-120b"),
                                       (_llama4(16, 1, 10485760), "llama-4-scout")])
def test_hf_config_reads_to_the_catalog_entry(tmp_path, cfg, name):
    """The config.json a catalog entry cites reads to that entry, field for field (head_dim 192 of MLA's
    qk_nope_head_dim + qk_rope_head_dim, not hidden / heads = 56; Llama 4's dense MLP width)."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert replace(model_from_hf_config(p), name=name) == MODELS[name]


def test_hf_config_moe_layers_and_widths(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_llama4(128, 2, 1048576)))
    mav = model_from_hf_config(p)
    assert mav.moe_layers == tuple(range(1, 48, 2)) and (mav.ffn_size, mav.moe_ffn_size) == (16384, 8192)
    p.write_text(json.dumps(_QWEN2_57B))
    qwen = model_from_hf_config(p)
    assert (qwen.num_shared_experts, qwen.shared_expert_ffn_size, qwen.moe_ffn_size) == (1, 20480, 2560)
    assert qwen.mlp_params(0) == 64 * 3 * 3584 * 2560 + 3 * 3584 * 20480 + 3584 * 64
    # transformers writes DeepSeek's head_dim as the rotary width (64): MLA's head is still 128 + 64
    p.write_text(json.dumps({**_DEEPSEEK_V3, "head_dim": 64}))
    assert model_from_hf_config(p).head_dim == 192


# google/gemma-3-27b-it's config.json as published: text_config lists only the fields off Gemma3TextConfig's
# defaults (no vocab_size, max_position_embeddings or sliding_window_pattern)
_GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
               "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
                               "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
                               "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                               "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
               "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27}}


def test_hf_config_gemma3_as_published_is_the_catalog_entry(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_GEMMA3_27B))
    m = model_from_hf_config(p)
    assert m.kinds.count("full") == 10 and m.kinds.count("sliding") == 52 and m.sliding_window == 1024
    assert [i for i, k in enumerate(m.kinds) if k == "full"] == list(range(5, 62, 6))
    assert replace(m, name="gemma-3-27b") == MODELS["gemma-3-27b"]


def test_hf_config_gemma3_text_defaults_and_layer_types(tmp_path):
    """A gemma3_text config takes transformers' defaults for what it omits (window 4096, every 6th layer
    full, 262208 tokens, tied embeddings, head_dim 256); a layer_types list, when given, wins."""
    p = tmp_path / "config.json"
    cfg = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 12,
           "num_attention_heads": 4, "num_key_value_heads": 1}
    p.write_text(json.dumps(cfg))
    m = model_from_hf_config(p)
    assert m.layer_kinds == tuple("full" if i in (5, 11) else "sliding" for i in range(12))
    assert (m.sliding_window, m.vocab_size, m.max_model_len, m.tie_embeddings, m.head_dim) == (4096, 262208, 131072,
                                                                                               True, 256)
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    p.write_text(json.dumps({**cfg, "layer_types": kinds * 3, "sliding_window": 512}))
    assert model_from_hf_config(p).layer_kinds == ("sliding",) * 3 + ("full",) + ("sliding",) * 3 + ("full",) + (
        "sliding",) * 3 + ("full",)


@pytest.mark.parametrize("model_type", ["cohere2", "gpt_oss"])
def test_hf_config_mixed_window_model_without_its_layer_kinds_is_an_error(tmp_path, model_type):
    """A model type known to mix sliding and full layers never reads as every layer sliding."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": model_type, "num_hidden_layers": 4, "hidden_size": 256,
                             "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000,
                             "max_position_embeddings": 2048, "sliding_window": 64}))
    with pytest.raises(CatalogError, match=f"model_type '{model_type}' mixes sliding and full attention layers: "
                                           "give 'layer_types' or 'sliding_window_pattern'"):
        model_from_hf_config(p)


def test_a_model_folder_without_config_json_says_so(tmp_path):
    """It listed the catalog's models "or a path to a config.json", for a folder it had been given."""
    from sim.catalog import CatalogError, resolve_model

    with pytest.raises(CatalogError, match=f"{tmp_path}: a folder without a config.json"):
        resolve_model(str(tmp_path))
