"""Token ids at the boundary: every id that reaches a model must be inside its vocabulary."""

from typing import Iterable

from ..errors import UserError


def vocab_size(model) -> int:
    """Rows of the model's input embedding (its vocabulary size)."""
    args = getattr(model, "args", None)
    n = getattr(args, "vocab_size", None)
    return int(n) if n else int(model.model.embed_tokens.weight.shape[0])


def check_tokens(tokens: Iterable[int], size: int):
    """Token ids must be integers in [0, size): an out-of-range id would read outside the embedding."""
    bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size), None)
    if bad is not None:
        raise UserError(f"token id {bad!r} is outside the vocabulary (0..{size - 1})")
