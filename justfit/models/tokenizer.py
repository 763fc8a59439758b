"""Build a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF tokenizer metadata.

A GGUF carries its vocabulary as llama.cpp metadata keys, not as tokenizer.json. We rebuild the tokenizer
with the `tokenizers` library so `AutoTokenizer.from_pretrained(folder)` and `mlx_lm.load` work offline,
with the same ids as transformers' own GGUF conversion. Two vocab types: byte-level BPE ("gpt2") and
SentencePiece ("llama").
"""

import json
import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from justfit.errors import UserError

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values -> the split regex their merges were learned with
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_PLAIN_BYTE_LEVEL = ("default", "gpt2", "gpt-2")


def _plain(value):
    """MLX/numpy arrays and scalars from `mx.load(..., return_metadata=True)` -> Python values."""
    return value.tolist() if hasattr(value, "tolist") else value


def _meta(metadata: dict, key: str, default=None):
    value = metadata.get(key)
    return default if value is None else _plain(value)


def _byte_alphabet() -> dict:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level_pre_tokenizer(pre: str | None):
    """The pre-tokenizer a byte-level vocab was trained with, chosen by tokenizer.ggml.pre."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _PLAIN_BYTE_LEVEL:
        log.warning("GGUF pre-tokenizer %r is not known here; using GPT-2 byte-level splitting", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _byte_level_tokenizer(md: dict) -> Tokenizer:
    """Byte-level BPE ("gpt2") from tokens + merges; tokens outside the byte alphabet get respelled."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(md["tokens"]):
        if not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[tok] = i
    merges = [tuple(m.split(" ")) for m in md.get("merges", [])]
    tk = Tokenizer(
        models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tk.pre_tokenizer = _byte_level_pre_tokenizer(md.get("pre"))
    tk.decoder = decoders.ByteLevel()
    return tk


def spm_merges(tokens: list, scores: list) -> list:
    """BPE merges implied by a SentencePiece vocab: every split of a token into two vocab pieces,
    best score first (ties: longer left, then longer right piece; then vocab order), like transformers."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    candidates = []
    for tok, s in score.items():
        pairs = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates.extend((left, right, s) for left, right in pairs)
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))
    return [(left, right) for left, right, _ in candidates]


def _spm_tokenizer(md: dict) -> Tokenizer:
    """SentencePiece ("llama") vocab as BPE with byte fallback <0xNN> and the ▁ space marker."""
    tokens = md["tokens"]
    scores = md.get("scores") or [0.0] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = md.get("unk_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    # a file may list merges (converted from an HF BPE tokenizer); otherwise they follow from the scores
    merges = [tuple(m.split(" ")) for m in md["merges"]] if md.get("merges") else spm_merges(tokens, scores)
    tk = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = md.get("add_space_prefix", True)
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def _add_special_tokens(tk: Tokenizer, md: dict, byte_level: bool, special_ids: list):
    """Control tokens (and bos/eos/unk/pad) stay whole as special tokens; user-defined ones as added tokens.

    In a byte-level vocab a control token spelled outside the byte alphabet is a llama.cpp mislabel; it
    is skipped, as transformers does.
    """
    tokens, types = md["tokens"], md.get("token_type") or []
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        tokens[i] for i, t in enumerate(types) if t == CONTROL and (alphabet is None or set(tokens[i]) <= alphabet)
    ]
    named = [tokens[i] for i in special_ids if i is not None and i < len(tokens) and tokens[i] not in control]
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control + named])
    vocab = tk.get_vocab()
    user = [tokens[i] for i, t in enumerate(types) if t == USER_DEFINED and tokens[i] in vocab]
    tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(bos: str | None, bos_id, eos: str | None, eos_id, add_bos: bool, add_eos: bool):
    """Template adding bos/eos around each sequence when the GGUF asks for them."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None

    def template(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if add_bos else []
        parts.append(f"{seq}:{type_id}")
        return " ".join(parts + ([f"{eos}:{type_id}"] if add_eos else []))

    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    return processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + " " + template("$B", 1), special_tokens=special
    )


def _gguf_tokenizer_fields(metadata: dict) -> dict:
    """The tokenizer.* metadata keys, as plain Python values under short names."""
    keys = {
        "model": "tokenizer.ggml.model",
        "pre": "tokenizer.ggml.pre",
        "tokens": "tokenizer.ggml.tokens",
        "scores": "tokenizer.ggml.scores",
        "token_type": "tokenizer.ggml.token_type",
        "merges": "tokenizer.ggml.merges",
        "bos_id": "tokenizer.ggml.bos_token_id",
        "eos_id": "tokenizer.ggml.eos_token_id",
        "unk_id": "tokenizer.ggml.unknown_token_id",
        "pad_id": "tokenizer.ggml.padding_token_id",
        "add_bos": "tokenizer.ggml.add_bos_token",
        "add_eos": "tokenizer.ggml.add_eos_token",
        "add_space_prefix": "tokenizer.ggml.add_space_prefix",
        "chat_template": "tokenizer.chat_template",
    }
    return {name: _meta(metadata, key) for name, key in keys.items()}


def build_tokenizer(metadata: dict) -> tuple[Tokenizer, dict]:
    """(tokenizers.Tokenizer, tokenizer_config dict) for the vocabulary described by GGUF metadata."""
    md = _gguf_tokenizer_fields(metadata)
    kind = md["model"]
    if kind not in ("gpt2", "llama"):
        raise UserError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
    if not md["tokens"] or not isinstance(md["tokens"], list):
        raise UserError("GGUF metadata has no tokenizer.ggml.tokens list")
    tokens = md["tokens"]
    tk = _byte_level_tokenizer(md) if kind == "gpt2" else _spm_tokenizer(md)
    ids = {name: md[f"{name}_id"] for name in ("bos", "eos", "unk", "pad")}
    names = {name: tokens[i] if i is not None and 0 <= i < len(tokens) else None for name, i in ids.items()}
    _add_special_tokens(tk, md, kind == "gpt2", list(ids.values()))
    add_bos = bool(md["add_bos"]) if md["add_bos"] is not None else kind == "llama"
    add_eos = bool(md["add_eos"])
    tk.post_processor = _post_processor(names["bos"], ids["bos"], names["eos"], ids["eos"], add_bos, add_eos)
    arch = _meta(metadata, "general.architecture")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names["bos"],
        "eos_token": names["eos"],
        "unk_token": names["unk"],
        "pad_token": names["pad"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(metadata, f"{arch}.context_length", 8192)),
    }
    if md["chat_template"]:
        config["chat_template"] = md["chat_template"]
    return tk, config


def write_tokenizer(metadata: dict, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF's vocabulary into out_dir."""
    tk, config = build_tokenizer(metadata)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
