"""The scheduler's KV arithmetic (engine/kvbytes.KVBytes) against a real page pool: for every KV layout,
the bytes it predicts for n tokens are the bytes the pool holds after n tokens were written through real
caches on the default model (a partial page, whole pages, sealed full-precision and quantized pages)."""

import mlx.core as mx
import pytest

from justfit.config import KVConfig
from justfit.kvexec import make_cache
from justfit.kvexec.pages import PagePool
from justfit.engine.kvbytes import KVBytes

LAYOUTS = {"fp16": KVConfig(bits=16, page_size=32),
           "q4-affine": KVConfig(bits=4, page_size=32, quantized_kv_start=64),
           "q4-rotated": KVConfig(bits=4, format="rotated", page_size=32, quantized_kv_start=64),
           "q4-channel-keys": KVConfig(bits=4, key_format="channel", page_size=32, quantized_kv_start=32),
           "q4-k8": KVConfig(bits=4, key_bits=8, page_size=32, quantized_kv_start=64)}
TOKENS = (1, 31, 32, 64, 77, 130)  # one token, a partial page, page boundaries, past quantized_kv_start


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_bytes_equal_the_pool_after_writing(shallow, name):
    model, kv = shallow.model, LAYOUTS[name]  # 6 layers (conftest.shallow): the bytes scale per layer
    predict = KVBytes(model, kv)
    for n in TOKENS:
        pool = PagePool(len(model.layers), kv.page_size)
        caches = make_cache(model, kv, pool=pool)
        for c in caches:
            c.for_batch()  # as the scheduler runs its sequences: 16-bit open pages
        ids = [(1000 + 13 * i) % 40000 for i in range(n)]
        for a, b in ((0, n // 2 + 1), (n // 2 + 1, n - 1), (n - 1, n)):  # prefill chunks, then a decode token
            if a < b:
                model(mx.array([ids[a:b]]), cache=caches)
        mx.eval([c.state for c in caches])
        assert pool.nbytes == predict.seq(n), (name, n)
        assert predict.worst(n) >= predict.seq(n) and predict.grow(n, 5) == predict.seq(n + 5) - predict.seq(n)
