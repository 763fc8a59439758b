"""KVExec as a drop-in cache for unmodified mlx-lm models (random weights, several shapes)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

import justfit.kvexec as kvexec
from justfit.config import KVConfig
from justfit.kvexec import PagedKVCache, make_cache

SHAPES = [(64, 4, 4), (64, 6, 2), (128, 8, 1), (128, 3, 1)]  # head_dim, heads, kv heads: GQA 1, 3, 8, 3


def _model(family, head_dim, heads, kv_heads, **extra):
    mx.random.seed(head_dim * 100 + heads * 10 + kv_heads)
    common = dict(hidden_size=96, num_hidden_layers=2, intermediate_size=128, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=128, head_dim=head_dim,
                  tie_word_embeddings=True, **extra)
    if family == "llama":
        return llama.Model(llama.ModelArgs(model_type="llama", **common))
    if family == "qwen2":
        common.pop("head_dim")
        common["hidden_size"] = head_dim * heads
        return qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
    return qwen3.Model(qwen3.ModelArgs(model_type="qwen3", max_position_embeddings=4096, rope_theta=10000, **common))


def greedy(model, caches, prompt, n=24, chunk=13):
    x = mx.array(prompt)[None]
    for i in range(0, len(prompt), chunk):  # chunked prefill, like mlx-lm's prefill_step_size
        logits = model(x[:, i : i + chunk], cache=caches)
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]))
        out.append(t)
        logits = model(mx.array([[t]]), cache=caches)
    return out, logits


PROMPT = [(7 * i + 3) % 128 for i in range(70)]


def _tokenizer():
    """A real (word-level) tokenizer over the 128 ids, as mlx_lm.generate expects."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=t, eos_token="t127"))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}")
def test_fp16_pages_give_mlx_lm_greedy_tokens(family, shape):
    model = _model(family, *shape)
    ref, ref_logits = greedy(model, [KVCache() for _ in model.layers], PROMPT)
    caches = make_cache(model, KVConfig(bits=16, page_size=32))
    got, logits = greedy(model, caches, PROMPT)
    assert got == ref
    assert mx.allclose(logits, ref_logits, atol=1e-4)
    assert all(isinstance(c, PagedKVCache) for c in caches) and caches[0].offset == len(PROMPT) + 24


def test_qwen2_and_quantized_formats_run_close_to_fp():
    model = _model("qwen2", 64, 4, 2)
    ref, ref_logits = greedy(model, [KVCache() for _ in model.layers], PROMPT, n=8)
    for kv in (KVConfig(bits=16, page_size=32), KVConfig(quantized_kv_start=0, bits=8, page_size=32)):
        got, logits = greedy(model, make_cache(model, kv), PROMPT, n=8)
        assert got == ref, kv.name
    for fmt in ("affine", "rotated"):
        _, logits = greedy(model, make_cache(model, KVConfig(quantized_kv_start=0, bits=4, format=fmt, page_size=32)), PROMPT, n=8)
        p, r = mx.softmax(logits[0, -1]), mx.softmax(ref_logits[0, -1])
        assert float((r * (mx.log(r) - mx.log(p))).sum()) < 0.05  # KL of the last step: close, not equal


def test_sliding_window_layers_match_mlx_lm_rotating_cache():
    model = _model("llama", 64, 4, 2, layer_types=["sliding_attention", "full_attention"], sliding_window=20)
    ref, ref_logits = greedy(model, make_prompt_cache(model), PROMPT)
    caches = make_cache(model, KVConfig(bits=16, page_size=32))
    assert caches[0].window == 20 and caches[1].window is None
    got, logits = greedy(model, caches, PROMPT)
    assert got == ref
    assert mx.allclose(logits, ref_logits, atol=1e-4)


def test_mlx_lm_generate_with_prompt_cache_and_trim():
    model = _model("llama", 64, 4, 2)

    tok = _tokenizer()
    expected = generate(model, tok, PROMPT, max_tokens=12)
    caches = make_cache(model, KVConfig(bits=16, page_size=32))
    assert generate(model, tok, PROMPT, max_tokens=12, prompt_cache=caches) == expected
    n = caches[0].offset
    assert n >= len(PROMPT) + 11  # every generated token went through the paged cache
    from mlx_lm.models.cache import trim_prompt_cache

    assert trim_prompt_cache(caches, 30) == 30 and caches[1].offset == n - 30
    # mlx-lm's own caches still work in the same process after routing
    assert generate(model, tok, PROMPT, max_tokens=12, prompt_cache=[KVCache() for _ in model.layers]) == expected


def test_unroutable_attention_falls_back_to_dense(monkeypatch):
    model = _model("llama", 64, 4, 2)
    ref, _ = greedy(model, [KVCache() for _ in model.layers], PROMPT, n=10)
    monkeypatch.setattr(kvexec, "route", lambda m: False)
    caches = make_cache(model, KVConfig(bits=16, page_size=32))
    assert caches[0].dense
    got, _ = greedy(model, caches, PROMPT, n=10)
    assert got == ref
