"""Token ids checked against the model's vocabulary before they reach an embedding lookup: an id out
of range reads past the table (a segfault, or silently wrong logits) instead of failing."""

import operator
from typing import Optional, Sequence

from ..errors import UserError

MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32 (block hashes, pages, mx.array)


def vocab_size(model) -> Optional[int]:
    """Rows of the model's token embedding (mlx-lm models carry it in `args.vocab_size`); None if unknown."""
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    for name in ("embed_tokens", "wte", "tok_embeddings", "embedding"):
        for owner in (model, getattr(model, "model", None)):
            emb = getattr(owner, name, None) if owner is not None else None
            w = getattr(emb, "weight", None)
            if w is not None and len(getattr(w, "shape", ())) == 2:  # a row-major table is [dims, rows]
                from .layout import RowMajorEmbedding

                return int(w.shape[-1] if isinstance(emb, RowMajorEmbedding) else w.shape[0])
    return None


def check_token_ids(ids: Sequence[int], vocab_size: Optional[int], what: str = "token ids") -> list:
    """`ids` as a list of ints, each in [0, vocab_size); UserError naming the first bad id otherwise.
    vocab_size None checks only that ids are non-negative int32 values."""
    import numpy as np

    limit = MAX_TOKEN_ID + 1 if vocab_size is None else int(vocab_size)
    try:
        arr = np.asarray(ids)
        if arr.ndim == 1 and arr.dtype.kind in "iu" and (arr.size == 0 or (arr.min() >= 0 and arr.max() < limit)):
            return arr.tolist()  # the common case, vectorized; anything else is explained item by item
    except (ValueError, TypeError, OverflowError):
        pass
    out = []
    for i, t in enumerate(ids):
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise UserError(f"{what}: item {i} is {t!r}, not an integer token id") from None
        if not 0 <= t < limit:
            raise UserError(f"{what}: token id {t} at position {i} is outside the vocabulary (0..{limit - 1})")
        out.append(t)
    return out

