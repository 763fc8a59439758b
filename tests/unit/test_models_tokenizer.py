"""Tokenizers built from GGUF metadata give the same ids as transformers' own GGUF conversion."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from justfit.errors import UserError
from justfit.models.gguf_reader import read_header
from justfit.models.tokenizer import build_tokenizer, spm_merges, write_tokenizer
from tests.gguf_writer import CHATML, smollm_gguf_path, spm_vocab, write_tiny_llama_gguf

TEXTS = [
    "Hello world",
    "12345 + 67 = 9.5e10, pi is 3.14159",
    "  two leading spaces",
    " one leading space",
    "def f(x):\n\treturn x**2  # square\n",
    "for item in items: total += item",
    "café, élève, naïve, Straße",
    "中文字符 日本語 한국어",
    "emoji 😀🎉 and 👍🏽 ok",
    "line1\r\nline2\r\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>end",
    "x  y   z\t\tw",
    "\u00a0nbsp and ‘quotes’",
    "",
]

# transformers cannot import its GGUF reader without PyTorch, although reading a tokenizer needs none of
# it; a stand-in `torch` package lets its real GGUF tokenizer path run in a subprocess.
_TORCH_STUB = '''
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, name): return _Any()
    def __getitem__(self, k): return _Any()
    def __or__(self, o): return _Any()
    __ror__ = __or__
def __getattr__(name): return _Any()
'''

_REFERENCE = '''
import json, sys
from pathlib import Path
from transformers import PreTrainedTokenizerFast
texts = json.loads(sys.argv[2])
out = {}
for p in map(Path, json.loads(sys.argv[1])):
    t = PreTrainedTokenizerFast.from_pretrained(str(p.parent), gguf_file=p.name)
    ids = [t.encode(s) for s in texts]
    out[str(p)] = {"ids": ids, "decoded": [t.decode(t.encode(s, add_special_tokens=False)) for s in texts]}
print(json.dumps(out))
'''


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory) -> dict:
    """name -> GGUF path: tiny synthetic files for each vocab kind, and the real SmolLM2 when available."""
    d = tmp_path_factory.mktemp("tok_gguf")
    files = {
        "gpt2-smollm": write_tiny_llama_gguf(d / "gpt2.gguf", "Q8_0", tokenizer="gpt2").path,
        "gpt2-llama-bpe": write_tiny_llama_gguf(d / "l3.gguf", "Q8_0", pre="llama-bpe").path,
        "gpt2-qwen2": write_tiny_llama_gguf(d / "q2.gguf", "Q8_0", pre="qwen2").path,
        "llama-spm": write_tiny_llama_gguf(d / "spm.gguf", "Q8_0", tokenizer="llama").path,
    }
    try:
        files["smollm2"] = smollm_gguf_path()
    except RuntimeError as e:
        logging.getLogger(__name__).warning("real SmolLM2 GGUF unavailable: %s", e)
    return files


@pytest.fixture(scope="session")
def reference(ggufs, tmp_path_factory) -> dict:
    """transformers' own GGUF tokenizer conversion, run once for all files: path -> ids/decoded."""
    stub = tmp_path_factory.mktemp("torch_stub")
    (stub / "torch").mkdir()
    (stub / "torch" / "__init__.py").write_text(_TORCH_STUB)
    env = dict(os.environ, PYTHONPATH=str(stub))
    paths = json.dumps([str(p) for p in ggufs.values()])
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE, paths, json.dumps(TEXTS)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="session")
def built(ggufs, tmp_path_factory) -> dict:
    """name -> folder written by write_tokenizer from mx.load's metadata (as the converter calls it)."""
    import mlx.core as mx

    out = {}
    for name, path in ggufs.items():
        _, metadata = mx.load(str(path), return_metadata=True)
        out[name] = tmp_path_factory.mktemp(f"tok_{name}")
        write_tokenizer(metadata, out[name])
    return out


_LOADED = {}


def _auto(folder):
    """AutoTokenizer for a written folder, loaded once per session (SmolLM2's takes ~1 s)."""
    from transformers import AutoTokenizer

    if str(folder) not in _LOADED:
        _LOADED[str(folder)] = AutoTokenizer.from_pretrained(str(folder))
    return _LOADED[str(folder)]


@pytest.mark.parametrize("name", ["gpt2-smollm", "gpt2-llama-bpe", "gpt2-qwen2", "llama-spm", "smollm2"])
def test_ids_match_transformers_gguf_conversion(name, ggufs, built, reference):
    if name not in ggufs:
        pytest.skip("real SmolLM2 GGUF unavailable (no network and JUSTFIT_TEST_GGUF unset)")
    tok = _auto(built[name])
    want = reference[str(ggufs[name])]["ids"]
    for text, ids in zip(TEXTS, want):
        assert tok.encode(text) == ids, f"{name}: ids differ for {text!r}"


def test_smollm2_known_ids(ggufs, built):
    """Fixed facts about SmolLM2's vocab: digits split one by one, <|im_start|> is id 1, no BOS added."""
    if "smollm2" not in ggufs:
        pytest.skip("real SmolLM2 GGUF unavailable")
    tok = _auto(built["smollm2"])
    assert tok.encode("<|im_start|>") == [1]
    assert len(tok.encode("12345")) == 5
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert len(tok) == 49152


@pytest.mark.parametrize("name", ["gpt2-smollm", "llama-spm", "smollm2"])
def test_decode_round_trips(name, ggufs, built, reference):
    if name not in ggufs:
        pytest.skip("real SmolLM2 GGUF unavailable")
    tok = _auto(built[name])
    want = reference[str(ggufs[name])]["decoded"]
    for text, ref in zip(TEXTS, want):
        got = tok.decode(tok.encode(text, add_special_tokens=False))
        assert got == ref, f"{name}: decode differs from transformers for {text!r}"
        # SentencePiece drops the one space it prepends, so a leading space does not survive there
        if name != "llama-spm" or not text.startswith(" "):
            assert got == text, f"{name}: {text!r} did not round-trip"


@pytest.mark.parametrize("name", ["gpt2-smollm", "llama-spm", "smollm2"])
def test_chat_template_renders_chatml(name, ggufs, built):
    if name not in ggufs:
        pytest.skip("real SmolLM2 GGUF unavailable")
    tok = _auto(built[name])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert text == expected
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_special_token_config(built):
    gpt2 = json.loads((built["gpt2-smollm"] / "tokenizer_config.json").read_text())
    spm = json.loads((built["llama-spm"] / "tokenizer_config.json").read_text())
    assert gpt2["tokenizer_class"] == spm["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (gpt2["bos_token"], gpt2["eos_token"], gpt2["pad_token"], gpt2["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert (spm["bos_token"], spm["eos_token"], spm["pad_token"], spm["unk_token"]) == (
        "<s>", "<|im_end|>", None, "<unk>")
    assert gpt2["add_bos_token"] is False and spm["add_bos_token"] is True
    assert gpt2["chat_template"] == spm["chat_template"] == CHATML
    assert _auto(built["llama-spm"]).encode("hi")[0] == 1  # BOS added for a SentencePiece vocab
    assert _auto(built["gpt2-smollm"]).encode("hi")[0] != 1


def test_mx_and_pure_reader_metadata_give_same_tokenizer(ggufs, built, tmp_path):
    """mx.array metadata values are converted like the plain ones from read_header."""
    for name in ("gpt2-smollm", "llama-spm"):
        write_tokenizer(read_header(ggufs[name], array_limit=None).metadata, tmp_path / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / name / f).read_text() == (built[name] / f).read_text()


def test_spm_merges_match_transformers_order():
    from transformers.tokenization_utils_base import generate_merges

    vocab = spm_vocab()
    tokens, scores = vocab["tokens"], vocab["scores"]
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert spm_merges(tokens, scores) == expected
    assert len(expected) > 20
    # ties: equal scores order merges by longer left piece, then longer right piece
    tied = ["a", "b", "c", "d", "ab", "bc", "cd", "abc", "bcd", "abcd", "da"]
    flat = [0.0] * len(tied)
    assert spm_merges(tied, flat) == generate_merges({t: i for i, t in enumerate(tied)}, dict(zip(tied, flat)))


@pytest.mark.parametrize("name", ["gpt2-smollm", "llama-spm"])
def test_mlx_lm_load_and_stream_detokenize(name, built):
    from mlx_lm.tokenizer_utils import load

    wrapper = load(Path(built[name]))
    kind = "BPEStreamingDetokenizer" if name.startswith("gpt2") else "SPMStreamingDetokenizer"
    assert type(wrapper._detokenizer).__name__ == kind
    assert wrapper.eos_token_ids == {wrapper.convert_tokens_to_ids("<|im_end|>")}
    text = "café 😀 the item  x\ny"
    det = wrapper.detokenizer
    det.reset()
    for i in wrapper.encode(text, add_special_tokens=False):
        det.add_token(i)
    det.finalize()
    assert det.text == text


def test_unknown_tokenizer_model_is_a_user_error():
    with pytest.raises(UserError, match="'bert'"):
        build_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_missing_vocab_is_a_user_error():
    with pytest.raises(UserError, match="tokenizer.ggml.tokens"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2"})


def test_unknown_pre_tokenizer_warns_and_falls_back(ggufs, caplog):
    metadata = dict(read_header(ggufs["gpt2-smollm"], array_limit=None).metadata)
    metadata["tokenizer.ggml.pre"] = "something-new"
    with caplog.at_level(logging.WARNING, logger="justfit.models.tokenizer"):
        tk, _ = build_tokenizer(metadata)
    assert "something-new" in caplog.text
    assert tk.decode(tk.encode("the item 42").ids) == "the item 42"


@pytest.mark.parametrize("pre, pieces", [("smollm", 2), ("default", 1), ("llama-bpe", 1), ("qwen2", 2)])
def test_pre_tokenizer_decides_digit_splitting(pre, pieces):
    """With a merge "1 2" in the vocab, SmolLM's and Qwen2's splitting keep digits apart, GPT-2's and
    Llama 3's do not (llama.cpp's per-`tokenizer.ggml.pre` regexes)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "12"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["1 2"],
    }
    tk, _ = build_tokenizer(metadata)
    assert len(tk.encode("12").ids) == pieces


def test_spm_without_space_prefix(tmp_path):
    """tokenizer.ggml.add_space_prefix = false (llama.cpp): no ▁ is prepended and decode keeps the text."""
    g = write_tiny_llama_gguf(tmp_path / "m.gguf", "Q8_0", tokenizer="llama", add_space_prefix=False)
    tk, _ = build_tokenizer(read_header(g.path, array_limit=None).metadata)
    with_prefix, _ = build_tokenizer(read_header(g.path, array_limit=None).metadata | {
        "tokenizer.ggml.add_space_prefix": True})
    assert tk.encode("the item", add_special_tokens=False).tokens[0] != "▁the"
    assert with_prefix.encode("the item", add_special_tokens=False).tokens[0] == "▁the"
    for text in ["the item", " the item", "  x"]:
        assert tk.decode(tk.encode(text, add_special_tokens=False).ids) == text
