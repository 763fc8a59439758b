"""Fingerprints and page-aligned chained block hashes: the keys of the prefix index and the page store.

Page i's K/V depends on every token before its end (causal attention), on the model's weights, on how the
tokenizer maps text to ids and on the KV format, so its key chains all of them:
`h_0 = H(salt), h_{i+1} = H(h_i || tokens of page i as little-endian int32)`.
"""

import hashlib
import json
from pathlib import Path
from typing import List, Sequence

KV_PAGE_FORMAT = 1  # kvexec/FORMAT.md version of the arrays inside a page


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def model_fingerprint(model) -> str:
    """Short stable id of a model's weights: config + weight files (size, head, tail) when loaded from a
    folder, else a hash of every parameter (tiny in-memory models). Cached on the model object."""
    cached = getattr(model, "justfit_fingerprint", None)
    if cached:
        return cached
    h = hashlib.sha256()
    path = getattr(model, "justfit_path", None)
    if path and Path(path).is_dir():
        folder = Path(path)
        h.update((folder / "config.json").read_bytes())
        for f in sorted(folder.glob("*.safetensors")):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(1 << 20)
                fh.seek(max(0, size - (1 << 20)))
                tail = fh.read(1 << 20)
            h.update(f"{f.name}:{size}".encode() + head + tail)
    else:
        import mlx.core as mx
        import numpy as np
        from mlx.utils import tree_flatten

        for name, p in tree_flatten(model.parameters()):
            h.update(name.encode())
            h.update(np.array(p.astype(mx.float32) if p.dtype == mx.bfloat16 else p).tobytes())
    h.update(str(getattr(model, "justfit_weights", "")).encode())  # fp32-dequantized vs quantized compute
    fp = h.hexdigest()[:16]
    try:
        model.justfit_fingerprint = fp
    except AttributeError:
        pass
    return fp


def tokenizer_fingerprint(tokenizer) -> str:
    """Short stable id of a tokenizer: its vocabulary, special tokens and chat template."""
    cached = getattr(tokenizer, "justfit_fingerprint", None)
    if cached:
        return cached
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    doc = {
        "vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
        "eos": sorted(getattr(tokenizer, "eos_token_ids", []) or []),
        "bos": getattr(tokenizer, "bos_token", None),
        "template": getattr(tokenizer, "chat_template", None),
    }
    fp = _sha(json.dumps(doc, sort_keys=True, default=str).encode())[:16]
    try:
        tokenizer.justfit_fingerprint = fp
    except AttributeError:
        pass
    return fp


def kv_format(kv) -> dict:
    """The KV format fields that change what a page holds (FORMAT.md, manifest `kv`)."""
    return {"name": kv.name, "bits": kv.bits, "format": kv.format, "group_size": kv.group_size,
            "page_size": kv.page_size, "quantized_kv_start": kv.quantized_kv_start,
            "page_format_version": KV_PAGE_FORMAT}


def salt(model_fp: str, tokenizer_fp: str, kv: dict) -> str:
    """h_0 of every chain: model, tokenizer and KV format together."""
    return _sha(json.dumps({"model": model_fp, "tokenizer": tokenizer_fp, "kv": kv}, sort_keys=True).encode())


def block_hashes(tokens: Sequence[int], page_size: int, salt_hex: str, start: int = 0,
                 prev: str = None) -> List[str]:
    """Chained hashes of the full pages of `tokens` (page `start` onward, chaining from `prev`)."""
    import numpy as np

    out, h = [], prev if prev is not None else salt_hex
    for i in range(start, len(tokens) // page_size):
        page = np.asarray(tokens[i * page_size:(i + 1) * page_size], dtype="<i4").tobytes()
        h = _sha(bytes.fromhex(h), page)
        out.append(h)
    return out


def partial_hash(tokens: Sequence[int], page_size: int, salt_hex: str) -> str:
    """Key of the open (partial) last page of `tokens`: the chain up to it, then its own tokens."""
    import numpy as np

    n = len(tokens) // page_size
    prev = block_hashes(tokens[:n * page_size], page_size, salt_hex)[-1] if n else salt_hex
    tail = np.asarray(tokens[n * page_size:], dtype="<i4").tobytes()
    return _sha(b"open", bytes.fromhex(prev), tail)
