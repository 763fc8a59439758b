"""JustFit: local LLM agents that fit in memory and answer fast, on MLX."""

__version__ = "0.1.0"

from .blas import use_fast_blas  # noqa: E402

use_fast_blas()  # before anything imports MLX: OpenBLAS on Linux CPU (see blas.py)

from .config import KVConfig  # noqa: E402
from .errors import MemoryBudgetError, UserError  # noqa: E402


def __getattr__(name):
    # Lazy so that `import justfit` stays cheap and loads OpenBLAS before MLX is imported.
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    if name in ("Generation", "Chunk", "TurnStats"):
        from . import turns

        return getattr(turns, name)
    if name in ("load", "vocab_size"):
        from . import models

        return getattr(models, name)
    if name == "make_cache":
        from .kvexec import make_cache

        return make_cache
    if name == "Session":
        from .statetrans import Session

        return Session
    raise AttributeError(f"module 'justfit' has no attribute {name!r}")


__all__ = ["KVConfig", "UserError", "MemoryBudgetError", "Runtime", "load", "vocab_size", "make_cache", "Session",
           "Generation", "Chunk", "TurnStats"]
