"""Plain `Runtime.stream`/`generate` with prefix reuse: attach the longest cached prefix, prefill the
rest, then index (and persist) the sealed pages so the next prompt sharing them skips their prefill."""

from .manifest import warn
from .store import StoreWriteError


def stream_reusing_prefix(rt, tokens, max_tokens, temperature, seed, top_p):
    """Yield rt.stream_tokens' chunks over a cache that starts with the longest cached prefix of tokens."""
    from ..kvexec import sequence_of
    from .checkpoint import commit

    index = rt.prefix_index()
    cache = rt.make_cache()
    seq = sequence_of(cache)
    reused = index.extend(seq, tokens, limit=len(tokens) - 1) if len(tokens) > 1 else 0
    out = []
    try:
        for chunk in rt.stream_tokens(tokens, cache, max_tokens, temperature, seed, top_p, reused_tokens=reused):
            if chunk.token >= 0:
                out.append(chunk.token)
            yield chunk
    finally:
        published = index.publish(seq, list(tokens) + out)
        if getattr(index, "persist", True):
            try:
                commit(index.store, rt.home, None, index.new_pages(published), index.checksums)
            except (StoreWriteError, OSError) as e:
                warn(f"prefix pages stay in memory only: {e}")
                index.persist = False
        seq.release()
