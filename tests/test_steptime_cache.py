"""Step pricing caches the layers' GPU time per token count (apart from the sequence and sample counts):
a warm cache must price every (tokens, sequences, sampled) shape exactly as a cold pricer does."""

import pytest

from sim.catalog import GPUS, MODELS
from sim.config import RooflineConfig
from sim.steptime import RooflineStepTime


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3-8b", "gpt-oss-120b"])  # classic, modern, MoE
def test_layer_cache_prices_like_a_cold_pricer(model):
    def pricer():
        return RooflineStepTime(MODELS[model], GPUS["a100-80gb"], 1, RooflineConfig(), paged=True)

    warm = pricer()
    shapes = [(tokens, seqs, sampled) for tokens in (1, 17, 512, 2048) for seqs, sampled in ((1, 1), (8, 3), (16, 16))
              if seqs <= tokens and sampled <= seqs]
    for shape in shapes:  # every shape after others of the same token count: the layer part comes cached
        warm._fixed_parts(*shape)
    for shape in shapes:
        assert warm._fixed_parts(*shape) == pricer()._fixed_parts(*shape), shape
    # the MoE layers depend on how many distinct experts the tokens route to: tokens only, never sequences
    assert len(warm._layers) == 4
