import json
from pathlib import Path

import pytest

from sim.catalog import MODELS, CatalogError, model_from_hf_config
from sim.kv import CapacityError, kv_pool
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
    one = kv_pool(MODELS["opt-66b"], GPUS["a100-80gb"], tp=4, gpu_memory_utilization=0.9, block_size=16)
    assert one.weights_bytes == MODELS["opt-66b"].num_params * 2 // 4


def test_opt13b_on_a100_40gb_leaves_about_12_gib_for_kv():
    p = kv_pool(MODELS["opt-13b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=16)
    assert 10 < p.kv_bytes / 2**30 < 13
    assert p.num_slots == p.num_blocks * 16


def test_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(CapacityError, match=r"does not fit on a100-40gb x1: weights 128\.48 GiB .* needs at least "
                                            r"128\.97 GiB"):
        kv_pool(MODELS["llama-2-70b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=16)


def test_a_tiny_device_that_does_not_fit_says_its_sizes_in_mib():
    """A made-up test device of 1.6 MiB: the message gives sizes a reader can act on, not '0.0 GiB'."""
    from dataclasses import replace

    model = model_from_hf_config(Path(__file__).parents[1] / "gpu" / "configs" / "tiny-hybrid.json")
    tiny = replace(GPUS["a100-40gb"], name="tiny", memory_bytes=int(0.0016 * 2**30))
    with pytest.raises(CapacityError, match=r"weights 2\.0 MiB \+ activations 0\.\d MiB .* in 1\.5 MiB .* "
                                            r"needs at least 2\.\d MiB"):
        kv_pool(model, tiny, tp=1, gpu_memory_utilization=0.9, block_size=16, activation_tokens=16,
                runtime_overhead_gib=0)


def test_one_block_bigger_than_the_room_for_kv_names_block_size():
    with pytest.raises(CapacityError, match=r"one KV block of block_size=65536 tokens takes 32\.00 GiB, more than the "
                                            r".* left for KV cache .*: lower block_size"):
        kv_pool(MODELS["llama-2-7b"], GPUS["a100-40gb"], tp=1, gpu_memory_utilization=0.9, block_size=65536)


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
