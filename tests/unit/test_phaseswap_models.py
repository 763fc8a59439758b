"""Weight components on tiny random models: tied handling, exact reload; speculative == plain greedy."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from justfit.kvexec import make_cache
from justfit.config import KVConfig
from justfit.phaseswap import Budget, Residency
from justfit.phaseswap.components import model_components, tied_embeddings
from justfit.engine import Engine
from justfit.phaseswap.drafting import DraftModel, Gate, PromptLookup


def tiny_args(tied=True, seed=0):
    return llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           head_dim=16, tie_word_embeddings=tied)


def tiny_model(seed=0, tied=True):
    mx.random.seed(seed)
    m = llama.Model(tiny_args(tied))
    mx.eval(m.parameters())
    return m


def saved_quantized(tmp_path, tied):
    """A 4-bit mlx-lm folder, then the model as justfit.models.load makes it (dequantized fp32)."""
    from mlx_lm.utils import dequantize_model

    m = tiny_model(1, tied)
    nn.quantize(m, group_size=32, bits=4)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(m.parameters())))
    cfg = dict(vars(tiny_args(tied)), quantization={"group_size": 32, "bits": 4, "mode": "affine"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = llama.Model(tiny_args(tied))
    nn.quantize(loaded, group_size=32, bits=4)
    loaded.load_weights(str(tmp_path / "model.safetensors"))
    dequantize_model(loaded)
    mx.eval(loaded.parameters())
    loaded.justfit_path = str(tmp_path)
    return loaded


@pytest.mark.parametrize("tied,spill", [(True, False), (False, False), (True, True)])
def test_components_split_and_reload_bit_identical(tmp_path, tied, spill):
    m = saved_quantized(tmp_path, tied)
    before = {k: mx.array(v) for k, v in tree_flatten(m.parameters())}
    root = tmp_path / "spill" if spill else None
    comps = {c.name: c for c in model_components(m, layers_per_group=2, spill_root=root)}
    assert tied_embeddings(m) == tied
    if tied:  # one tensor, two roles, counted once
        assert set(comps["embed"].roles) == {"input-embedding", "lm-head"} and "lm_head" not in comps
    else:
        assert comps["embed"].roles == ("input-embedding",) and comps["lm_head"].roles == ("lm-head",)
    assert set(comps) >= {"layers.0-1", "layers.2-3", "norm"}
    assert sum(c.nbytes for c in comps.values()) == sum(v.nbytes for v in before.values())
    assert all(c.releasable for c in comps.values())
    x = mx.array([[3, 1, 4, 1, 5]])
    ref = m(x)
    r = Residency(Budget(reserve=0))
    r.add_all(comps.values())
    r.enter("tool")
    assert r.release() == sum(v.nbytes for v in before.values())
    assert all(v.size == 0 for _, v in tree_flatten(m.parameters()))
    r.enter("prefill")  # the head is not needed for intermediate prefill chunks
    assert comps["embed"].resident and (tied or not comps["lm_head"].resident)
    r.enter("decode")
    if spill:  # released weights were kept as loaded: reload reads them, no dequantize
        assert len(list((tmp_path / "spill" / "weights").glob("*/*.safetensors"))) == len(comps)
    after = dict(tree_flatten(m.parameters()))
    for k, v in before.items():
        assert after[k].dtype == v.dtype and mx.array_equal(after[k], v).item(), k
    assert mx.array_equal(m(x), ref).item()


class IdTokenizer:
    """Text of a token id is its number: enough for an engine over a tiny random model."""

    class Detokenizer:
        def __init__(self):
            self.last_segment = ""

        def reset(self):
            self.last_segment = ""

        def add_token(self, t):
            self.last_segment = f"{t} "

        def finalize(self):
            self.last_segment = ""

    @property
    def detokenizer(self):
        return self.Detokenizer()


def run(model, prompt, max_tokens, drafter=None, kv=None, counts=None, gate=None):
    """Greedy tokens of one turn through the engine core, on caches the caller owns."""
    cache = make_cache(model, kv) if kv else model.make_cache() if hasattr(model, "make_cache") else None
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    eng = Engine(model, IdTokenizer(), lambda: None, eos=set(), drafter=drafter, gate=gate)
    req = eng.submit(prompt, max_tokens, caches=cache)
    toks = [c.token for c in req if c.token >= 0]
    if counts is not None:
        counts.update(req.counts)
    assert cache[0].offset == len(prompt) + len(toks)  # cache = prompt + every emitted token
    return toks


def mlx_lm_greedy(model, prompt, n):
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return [t for t, _ in steps]


PROMPT = [5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8, 5, 17]


def test_plain_phased_decode_equals_mlx_lm():
    m = tiny_model(2)
    assert run(m, PROMPT, 24) == mlx_lm_greedy(m, PROMPT, 24)


@pytest.mark.parametrize("kv", [None, KVConfig(bits=16, page_size=32), KVConfig(quantized_kv_start=0, bits=4, page_size=32)])
def test_speculative_greedy_equals_plain(kv):
    m = tiny_model(3)
    plain = run(m, PROMPT, 40, kv=kv)
    stats = {}
    for name, drafter in [("self-draft", DraftModel(m)), ("other-draft", DraftModel(tiny_model(4))),
                          ("prompt-lookup", PromptLookup(min_ngram=1))]:
        counts = {}
        assert run(m, PROMPT, 40, drafter=drafter, kv=kv, counts=counts) == plain, name
        stats[name] = counts
    print(f"\nacceptance (kv={kv and kv.name}):", {k: (v["accepted_tokens"], v["drafted_tokens"]) for k, v in stats.items()})
    assert stats["self-draft"]["drafted_tokens"] > 0
    assert stats["self-draft"]["accepted_tokens"] >= 0.8 * stats["self-draft"]["drafted_tokens"]


def test_prompt_lookup_proposes_continuation_of_latest_match():
    d = PromptLookup(max_ngram=3, min_ngram=2)
    d.reset([1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert d.propose(3) == [7, 8, 1]  # the most recent earlier "1 2 3" was followed by 7 8 1
    d.reset([1, 2, 3, 4])
    assert d.propose(4) == []


def test_gate_switches_off_when_drafting_loses():
    g = Gate(min_passes=2)
    g.plain(0.1)
    for _ in range(3):
        g.spec(0.5, 4, 0)  # one token per 0.5 s pass vs 0.1 s plain: slower
    assert not g.open() and g.off_for > 0
    g2 = Gate(min_passes=2)
    g2.plain(0.1)
    for _ in range(3):
        g2.spec(0.15, 4, 4)  # five tokens per 0.15 s: faster
    assert g2.open() and g2.k == 8
