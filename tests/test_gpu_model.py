"""The decoder: catalog shapes, and the same greedy tokens through the KV pool (paged or contiguous,
chunked, mixed, recomputed) as a plain full recomputation without any cache."""

from pathlib import Path

import numpy as np
import pytest

from gpu_helpers import require_backend

torch = require_backend()

from gpu.executor import TorchExecutor  # noqa: E402
from gpu.kv_cache import KvCache, KvGroups  # noqa: E402
from gpu.model import LlamaModel, ModelShape  # noqa: E402
from sim.catalog import MODELS, model_from_hf_config  # noqa: E402
from sim.core import StepPlan  # noqa: E402
from sim.kv import KvPool  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "gpu" / "configs" / "tiny-llama.json"
HYBRID = TINY.with_name("tiny-hybrid.json")


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_have_the_catalog_shapes(name):
    """Parameter counts equal the simulator's (meta tensors: no memory); OPT's learned position table is
    the one documented difference (positions are rotary here). Layouts the backend does not run (MLA, Mamba,
    chunked local attention, mixture of experts) are refused by name."""
    spec = MODELS[name]
    if set(spec.layer_kinds) - {"full", "sliding"} or spec.num_experts:  # MLA, Mamba, chunked local, MoE
        with pytest.raises(ValueError, match="simulator-only"):
            ModelShape.from_spec(spec)
        return
    model = LlamaModel.random(ModelShape.from_spec(spec), "meta", torch.bfloat16)
    missing = spec.max_model_len * spec.hidden_size if spec.learned_positions else 0
    assert model.num_params == spec.num_params - missing
    assert ModelShape.from_spec(spec, num_layers=2).num_layers == 2


def tiny_model() -> LlamaModel:
    spec = model_from_hf_config(TINY)
    model = LlamaModel.random(ModelShape.from_spec(spec), "cpu", torch.float32, seed=3)
    assert model.num_params == spec.num_params  # 2 layers, hidden 256, 8 query heads over 2 KV heads
    return model


def reference_tokens(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(int(model.full_logits(toks).argmax()))
    return toks[len(prompt):]


def run_steps(model: LlamaModel, paged: bool, attention: str) -> TorchExecutor:
    """Two sequences (prompts 21 and 7) on blocks of 4 tokens in shuffled order, or slabs off block edges:
    a prompt chunk, then a mixed step (the rest of that prompt over 13 cached tokens + a whole prompt),
    decodes, a recompute of sequence 1 (prompt + generated tokens), and more decodes."""
    B = 4
    pool = KvPool(num_blocks=40, block_size=B, kv_bytes_per_token=0, budget_bytes=0, weights_bytes=0, activation_bytes=0)
    ex = TorchExecutor(model, KvCache(model.shape, pool, "cpu", torch.float32), {0: 21, 1: 7}, paged=paged,
                       attention=attention, seed=11)
    order = np.random.default_rng(0).permutation(40)
    tables = {0: order[:10].tolist(), 1: order[10:20].tolist()}
    slabs = {0: 3, 1: 61}

    def plan(entries):
        ids = tuple(e[0] for e in entries)
        return StepPlan.from_entries(ids, tuple(e[1] for e in entries), tuple(e[2] for e in entries), 0, B,
                        block_tables=tuple(tables[i] for i in ids) if paged else None,
                        slab_starts=None if paged else tuple(slabs[i] for i in ids))

    ex.run(plan([(0, 13, 0)]))
    ex.run(plan([(0, 8, 13), (1, 7, 0)]))
    for k in range(4):
        ex.run(plan([(0, 1, 21 + k), (1, 1, 7 + k)]))
    ex.run(plan([(0, 1, 25), (1, 12, 0)]))  # sequence 1 recomputed: 7 prompt + 5 generated tokens
    for k in range(3):
        ex.run(plan([(1, 1, 12 + k), (0, 1, 26 + k)]))
    return ex


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_cached_generation_equals_full_recomputation(paged, attention):
    model = tiny_model()
    ex = run_steps(model, paged, attention)
    assert len(ex.generated(0)) == len(ex.generated(1)) == 9
    for seq_id in (0, 1):
        want = reference_tokens(model, ex.prompt_ids(seq_id), len(ex.generated(seq_id)))
        assert ex.generated(seq_id) == want, (seq_id, attention, paged)


def test_the_comparison_can_fail():
    """A cache written at the wrong slots changes the tokens (the equality above is not vacuous)."""
    model = tiny_model()
    ex = run_steps(model, True, "torch")
    # Forget every cached K/V. A seeded generator: the global one's state depends on which tests ran
    # before in this worker, and one token from a tiny vocabulary can match by chance.
    noise = torch.Generator().manual_seed(5)
    ex.cache.kv[:, :, :] = torch.randn(ex.cache.kv.shape, generator=noise, dtype=ex.cache.kv.dtype)
    B = 4
    table = np.random.default_rng(0).permutation(40)[:10].tolist()
    for _ in range(4):  # four decode steps, each reading the corrupted cache
        pos = len(ex.token_ids(0)) - 1
        ex.run(StepPlan.from_entries((0,), (1,), (pos,), 1, B, block_tables=(table,)))
    want = reference_tokens(model, ex.prompt_ids(0), len(ex.generated(0)))
    assert ex.generated(0)[-4:] != want[-4:]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_warmup_leaves_no_token_state(paged):
    """Warmup runs scratch steps up to a 700-token prefill budget over sequences of at most
    max_model_len tokens, then forgets them."""
    model = tiny_model()
    pool = KvPool(num_blocks=200, block_size=16, kv_bytes_per_token=0, budget_bytes=0, weights_bytes=0,
                  activation_bytes=0)
    ex = TorchExecutor(model, KvCache(model.shape, pool, "cpu", torch.float32), {0: 5}, paged=paged,
                       attention="torch")
    ex.warmup(700)
    assert ex.tokens == {} and ex.prompt_tokens == {0: 5} and ex.num_steps == 5


def windowed(model: LlamaModel, windows: tuple[int, ...]) -> LlamaModel:
    """The same weights with other per-layer sliding windows."""
    from dataclasses import replace
    return LlamaModel(replace(model.shape, layer_windows=windows), model.embed, model.layers, model.final_norm,
                      model.lm_head)


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_sliding_window_layers_generate_as_full_recomputation(attention):
    """Layer 0 a sliding window of 6 keys (under two blocks of 4), layer 1 full, each in a KV group of its
    own (pages of one layer); a 21-token prompt in two chunks (the second over 13 cached tokens), then
    decodes. The window group's tables drop the blocks that left the window (-1, as the hybrid allocator
    frees them) and those pages are poisoned with NaN after every step; the cached steps give the greedy
    tokens of a plain windowed recomputation, which differ from full attention's (the window is not vacuous)."""
    model = windowed(tiny_model(), (6, 0))
    B = 4
    pool = KvPool(num_blocks=16, block_size=B, kv_bytes_per_token=0, budget_bytes=0, weights_bytes=0,
                  activation_bytes=0)
    cache = KvCache(model.shape, pool, "cpu", torch.float32, KvGroups((0, 1), (0, 0), 1))
    assert cache.kv.shape[:3] == (1, 2, 16)
    ex = TorchExecutor(model, cache, {0: 21}, paged=True, attention=attention, seed=11)
    order = np.random.default_rng(1).permutation(16).tolist()
    window_pages, full_pages = order[:8], order[8:]
    for n, c in [(13, 0), (8, 13), (1, 21), (1, 22)]:
        blocks, first = -(-(c + n) // B), max(c + 1 - 6, 0) // B
        window = [-1] * first + window_pages[first:blocks]
        ex.run(StepPlan.from_entries((0,), (n,), (c,), 0, B, block_tables=([],),
                                     extra={"group_tables": [[window], [full_pages[:blocks]]]}))
        gone = window_pages[:max(c + n + 1 - 6, 0) // B]  # out of the next step's window: freed
        cache.kv[:, :, gone] = float("nan")
    want = reference_tokens(model, ex.prompt_ids(0), 3)
    assert ex.generated(0) == want
    assert want != reference_tokens(windowed(model, ()), ex.prompt_ids(0), 3)


def test_kv_groups_of_a_hybrid_layout():
    """Layers of one kind fill that kind's groups in layer order, group_size at a time; each layer has a
    place in its group's pages. A layout that does not match the model's layers is refused."""
    from sim.layouts import kv_layout

    spec = model_from_hf_config(HYBRID)  # sliding W = 8, full, sliding, full, sliding
    shape = ModelShape.from_spec(spec)
    assert shape.layer_windows == (8, 0, 8, 0, 8)
    groups = KvGroups.of_layout(shape.layer_windows, 5, kv_layout(spec, 1, 4))
    # groups: sliding (layers 0, 2), sliding (layer 4), full (layers 1, 3); pages of 2 layers
    assert groups.layer_group == (0, 2, 0, 2, 1) and groups.layer_place == (0, 0, 1, 1, 0)
    assert groups.page_layers == 2 and groups.num_groups == 3
    with pytest.raises(ValueError, match="do not match the model's layer windows"):
        KvGroups.of_layout((0,) * 5, 5, kv_layout(spec, 1, 4))
    with pytest.raises(ValueError, match="hold 3 layers, the model has 2"):
        KvGroups.of_layout((8, 0, 8, 0), 4, kv_layout(spec, 1, 4))
    model = windowed(tiny_model(), (6, 0))
    pool = KvPool(num_blocks=4, block_size=4, kv_bytes_per_token=0, budget_bytes=0, weights_bytes=0, activation_bytes=0)
    with pytest.raises(ValueError, match="several KV groups need a paged pool"):
        TorchExecutor(model, KvCache(model.shape, pool, "cpu", torch.float32, KvGroups((0, 1), (0, 0), 1)), {},
                      paged=False, attention="torch")


def test_simulator_only_layer_kinds_are_refused():
    from types import SimpleNamespace

    spec = MODELS["llama-3-8b"] if "llama-3-8b" in MODELS else next(iter(MODELS.values()))
    fields = {k: getattr(spec, k) for k in ("name", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                             "head_dim", "ffn_size", "vocab_size", "max_model_len", "gated_mlp",
                                             "tie_embeddings")}
    kinds = ("sliding", "full") * (spec.num_layers // 2)
    shape = ModelShape.from_spec(SimpleNamespace(**fields, layer_kinds=kinds, sliding_window=512))
    assert shape.layer_windows[:2] == (512, 0) and ModelShape.from_spec(spec).layer_windows == ()
    assert shape.with_layers(2).layer_windows == (512, 0)
    with pytest.raises(ValueError, match="simulator-only"):
        ModelShape.from_spec(SimpleNamespace(**fields, layer_kinds=("mla",) * spec.num_layers, sliding_window=0))
