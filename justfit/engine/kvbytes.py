"""KV memory arithmetic for the scheduler: the bytes of pool pages a sequence of n tokens holds.

Page sizes come from the page codecs themselves (one page of zeros encoded, its parts' `.nbytes` summed;
shapes only, nothing is computed), so every KV format, key format and key width is counted exactly as
kvexec stores it. A sequence's pages: sealed pages before quantized_kv_start stay full precision, later
sealed pages are quantized, and the open last page is a full-precision buffer of a whole page (16-bit like
the sealed ones: the scheduler's caches run `for_batch`, kvexec/cache.py, from the moment two run; a request
alone keeps a float32 open page (in the pool's bytes) and a float window (counted by the KV manager, engine/kv.py): speed
copies the budget drops first).
"""


class KVBytes:
    """Bytes of one model's KV pages under one KVConfig, summed over the paged layers."""

    def __init__(self, model, kv):
        self.page_size = kv.page_size
        self.open, self.quant = _page_bytes(model, kv)  # a full-precision page (open or sealed), a quantized one
        self.fp_pages = None if kv.bits == 16 else -(-kv.quantized_kv_start // kv.page_size)

    def seq(self, n: int) -> int:
        """Bytes of a sequence holding n tokens: its sealed pages plus its open page."""
        if n <= 0:
            return 0
        sealed, partial = divmod(n, self.page_size)
        fp = sealed if self.fp_pages is None else min(sealed, self.fp_pages)
        return (fp + bool(partial)) * self.open + (sealed - fp) * self.quant

    def worst(self, n: int) -> int:
        """Bytes one request of n tokens can reach (an open page past its last sealed one)."""
        return self.seq(n) + (self.open if n % self.page_size == 0 else 0)

    def grow(self, cached: int, n: int) -> int:
        """Bytes a sequence holding `cached` tokens grows by when n more are written."""
        return self.seq(cached + n) - self.seq(cached)


def _page_bytes(model, kv) -> tuple:
    """(full-precision page, quantized page) bytes of one page id across the paged layers."""
    import mlx.core as mx

    from ..kvexec.formats import full_codecs, make_codecs

    a = model.args
    heads = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
    dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    dtype = _dtype(model)
    zeros = mx.zeros((heads, kv.page_size, dim), dtype=dtype)  # lazy: only shapes are read

    def nbytes(codecs):
        return sum(x.nbytes for c in codecs for x in c.encode(zeros))

    layers = _paged_layers(model)
    return layers * nbytes(full_codecs(kv, dim, dim, dtype)), layers * nbytes(make_codecs(kv, dim, dtype))


def _paged_layers(model) -> int:
    """Layers whose cache kvexec pages (KVCache and sliding-window ones, as make_cache maps them)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if not hasattr(model, "make_cache"):
        return len(model.layers)
    return sum(type(c) in (KVCache, RotatingKVCache) for c in model.make_cache())


def _dtype(model):
    """The dtype keys and values arrive in: the model's floating parameters' (float32 on CPU)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    floats = (mx.float32, mx.float16, mx.bfloat16)
    return next((p.dtype for _, p in tree_flatten(model.parameters()) if p.dtype in floats), mx.float32)
