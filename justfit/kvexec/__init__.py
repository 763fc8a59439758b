"""KVExec: the KV cache. Placeholder until the paged cache lands: plain mlx-lm caches."""


def make_cache(model, kv):
    """Per-layer caches for any mlx-lm model: full precision for bits=16, mlx-lm quantized otherwise."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    if kv.bits == 16:
        return caches
    return [QuantizedKVCache(group_size=kv.group_size, bits=kv.bits) if isinstance(c, KVCache) else c
            for c in caches]
