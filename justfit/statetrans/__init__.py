"""StateTrans: named sessions over KVExec pages, a block-hash prefix index and an on-disk page store.

`Runtime.session(name)` -> `Session` (session.py); the index (index.py) lets any prompt reuse the
longest cached prefix; pages and manifests persist under $JUSTFIT_HOME (FORMAT.md).
"""


def __getattr__(name):
    # Lazy: the sessions CLI and the crash tests import submodules without loading MLX.
    if name == "Session":
        from .session import Session

        return Session
    if name == "PrefixIndex":
        from .index import PrefixIndex

        return PrefixIndex
    raise AttributeError(f"module 'justfit.statetrans' has no attribute {name!r}")


__all__ = ["Session", "PrefixIndex"]
