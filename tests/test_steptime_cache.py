"""Step pricing caches the layers' GPU time per token count (apart from the sequence and sample counts):
a warm cache must price every (tokens, sequences, sampled) shape exactly as a cold pricer does."""

import pytest

from sim.catalog import GPUS, MODELS
from sim.config import RooflineConfig
from sim.steptime import _PRICING_CACHES, RooflineStepTime


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b", "gpt-oss-120b"])  # classic, modern, MoE
def test_layer_cache_prices_like_a_cold_pricer(model):
    def pricer():
        return RooflineStepTime(MODELS[model], GPUS["a100-80gb"], 1, RooflineConfig(), paged=True)

    _PRICING_CACHES.clear()
    warm = pricer()
    shapes = [(tokens, seqs, sampled) for tokens in (1, 17, 512, 2048) for seqs, sampled in ((1, 1), (8, 3), (16, 16))
              if seqs <= tokens and sampled <= seqs]
    for shape in shapes:  # every shape after others of the same token count: the layer part comes cached
        warm._fixed_parts(*shape)
    for shape in shapes:
        _PRICING_CACHES.clear()  # a cold pricer (pricers of the same inputs share their caches)
        assert warm._fixed_parts(*shape) == pricer()._fixed_parts(*shape), shape
    # the MoE layers depend on how many distinct experts the tokens route to: tokens only, never sequences
    assert len(warm._layers) == 4


def test_pricers_share_caches_only_with_the_same_inputs():
    """A fleet's replicas and a scenario's policies on the same model, GPU, TP and config price each shape
    once; any other input (here the GPU overhead per step, or TP) gets caches of its own."""
    model, gpu = MODELS["llama-3-8b"], GPUS["h100"]
    a = RooflineStepTime(model, gpu, 1, RooflineConfig(), paged=True)
    b = RooflineStepTime(model, gpu, 1, RooflineConfig(), paged=False)  # the allocator is priced elsewhere
    slow = RooflineStepTime(model, gpu, 1, RooflineConfig(gpu_overhead_s=1e-3), paged=True)
    tp2 = RooflineStepTime(model, gpu, 2, RooflineConfig(), paged=True)
    assert a._fixed is b._fixed and a._layers is b._layers
    assert len({id(x._fixed) for x in (a, slow, tp2)}) == 3
    assert slow._fixed_parts(64, 4, 4)[0] > a._fixed_parts(64, 4, 4)[0]
    assert tp2._fixed_parts(64, 4, 4)[0] < a._fixed_parts(64, 4, 4)[0]
