"""Row-major weights on the CPU (models/layout.py): same outputs, reversible, only modules the model's code
reaches through __call__ / as_linear, and everything that reads weights by name still finds them."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama, seed_oss
from mlx_lm.models.cache import make_prompt_cache

import justfit
from justfit.bench.baseline import mlx_lm_layout
from justfit.models import layout, vocab_size
from justfit.phaseswap.components import WeightSource

from tests.kvexec_families import SPECIAL, build, families, greedy

IDS = mx.array([[3, 17, 99, 5, 42, 7]])


@pytest.fixture(autouse=True)
def _float32_row_major(monkeypatch):
    """These tests are about the float32 weights' row-major layout: that path, whatever this machine measured
    (models/tuning.py picks the default weights and layout)."""
    from justfit.models import tuning

    monkeypatch.setenv("JUSTFIT_WEIGHTS", "fp32")
    monkeypatch.setitem(tuning.choices(), "row_major", True)


def _tiny_llama(tied: bool):
    mx.random.seed(1)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=160,
                           tie_word_embeddings=tied, attention_bias=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _kinds(model):
    return {type(m).__name__ for _, m in model.named_modules()}


@pytest.mark.parametrize("tied", [True, False])
def test_row_major_same_logits_and_reversible(tied):
    model = _tiny_llama(tied)
    ref = model(IDS)
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    n = layout.row_major(model)
    assert n == linears + tied  # every Linear, plus the table only when it is the head
    assert "Linear" not in _kinds(model) and "RowMajorLinear" in _kinds(model)
    assert ("RowMajorEmbedding" in _kinds(model)) == tied
    assert mx.allclose(model(IDS), ref, atol=1e-5).item()
    assert layout.row_major(model) == 0  # idempotent
    assert vocab_size(model) == 160
    assert layout.standard(model) == n
    assert not _kinds(model) & {"RowMajorLinear", "RowMajorEmbedding"}
    assert model.model.embed_tokens.weight.shape == (160, 64)
    assert mx.allclose(model(IDS), ref, atol=1e-5).item()


def test_biases_survive_both_ways():
    model = _tiny_llama(True)
    bias = model.layers[0].self_attn.q_proj.bias
    layout.row_major(model)
    assert model.layers[0].self_attn.q_proj.bias is bias
    layout.standard(model)
    assert mx.array_equal(model.layers[0].self_attn.q_proj.bias, bias).item()


def test_a_weight_the_model_reads_itself_stays_as_loaded():
    """seed_oss's tied head multiplies `embed_tokens.weight.T` in its own code: its table is not swapped."""
    mx.random.seed(2)
    args = seed_oss.ModelArgs(model_type="seed_oss", hidden_size=64, num_hidden_layers=1, intermediate_size=96,
                              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                              head_dim=16, tie_word_embeddings=True)
    model = seed_oss.Model(args)
    mx.eval(model.parameters())
    ref = model(IDS)
    assert layout.row_major(model) > 0
    assert type(model.model.embed_tokens) is nn.Embedding
    assert mx.allclose(model(IDS), ref, atol=1e-5).item()


def test_default_model_loads_row_major_with_identical_tokens(default_model_dir):
    model, _ = justfit.load(str(default_model_dir))
    assert isinstance(model.layers[0].mlp.up_proj, layout.RowMajorLinear)
    assert isinstance(model.model.embed_tokens, layout.RowMajorEmbedding)
    logits = model(IDS)
    with mlx_lm_layout(model):
        assert type(model.layers[0].mlp.up_proj) is nn.Linear
        ref = model(IDS)
    assert isinstance(model.layers[0].mlp.up_proj, layout.RowMajorLinear)
    assert mx.array_equal(mx.argmax(logits, -1), mx.argmax(ref, -1)).item()
    assert mx.allclose(logits, ref, atol=1e-4).item()


def test_weight_source_reloads_in_the_layout_held(default_model_dir):
    """PhaseSwap re-reads released weights from the folder ([out, in]) into the row-major layout held."""
    model, _ = justfit.load(str(default_model_dir))
    source = WeightSource(model)
    names = ["model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert {names[0], names[1]} <= source.transposed and names[2] not in source.transposed
    held = dict(zip(names, [model.layers[3].mlp.down_proj.weight, model.model.embed_tokens.weight, model.model.norm.weight]))
    for name, arr in source.fetch(names):
        assert mx.array_equal(arr, held[name]).item(), name


def test_switched_off_by_environment(default_model_dir, monkeypatch):
    monkeypatch.setenv("JUSTFIT_ROW_MAJOR", "0")
    model, _ = justfit.load(str(default_model_dir))
    assert type(model.layers[0].mlp.up_proj) is nn.Linear


def test_switching_holds_one_extra_weight_at_a_time(default_model_dir):
    """Each module is converted and its old array freed before the next: never both layouts of the model."""
    model, _ = justfit.load(str(default_model_dir))
    largest = max(m.weight.nbytes for _, m in model.named_modules()
                  if isinstance(m, (layout.RowMajorLinear, layout.RowMajorEmbedding)))
    for switch in (layout.standard, layout.row_major):
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        assert switch(model) > 0
        assert mx.get_peak_memory() - before <= 1.25 * largest, switch.__name__


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_every_family_keeps_its_tokens(family):
    """Every family the installed mlx-lm ships (tiny random config): row-major, then back, same greedy tokens."""
    if family in SPECIAL:
        pytest.skip(SPECIAL[family])
    mx.random.seed(0)
    try:
        model, reason = build(family)
        if model is None:
            pytest.skip(reason)
        ref = greedy(model, make_prompt_cache(model))
    except Exception as e:  # noqa: BLE001 - the generic tiny config does not fit this family (or needs Metal)
        pytest.skip(f"no tiny random config runs: {type(e).__name__}: {str(e)[:80]}")
    assert layout.row_major(model) > 0
    assert greedy(model, make_prompt_cache(model)) == ref
    layout.standard(model)
    assert greedy(model, make_prompt_cache(model)) == ref
