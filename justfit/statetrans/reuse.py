"""Plain requests with prefix reuse: attach the longest cached prefix (token-exact), let the caller
prefill the rest and decode, then index (and persist) the pages so the next prompt skips them."""

from contextlib import contextmanager

from .manifest import warn
from .store import StoreWriteError


@contextmanager
def reusing_prefix(index, cache, tokens):
    """`with reusing_prefix(index, cache, tokens) as (cache, reused, out):` cache starts with the
    longest cached prefix of tokens (at least one token is left to compute); append generated ids to
    `out`. On exit the pages of tokens + out are published, sealed ones written to the store, and
    the cache's sequence is released."""
    from ..kvexec import sequence_of
    from .checkpoint import commit

    seq = sequence_of(cache)
    reused = index.extend(seq, tokens, limit=len(tokens) - 1) if len(tokens) > 1 else 0
    out = []
    try:
        yield cache, reused, out
    finally:
        published = index.publish(seq, list(tokens) + out)
        if index.persist:
            try:
                commit(index.store, index.home, None, index.new_pages(published), index.checksums)
            except (StoreWriteError, OSError) as e:
                warn(f"prefix pages stay in memory only: {e}")
                index.persist = False
        seq.release()
