"""Channel 4-bit keys with affine 4-bit values on the Metal kernels (through the CPU emulator here).

Two levels: the kernel against the MLX-ops reference (metal_kernels), and KVExec's kernel path against
KVExec's own MLX-ops path on random pages and on a tiny llama (the combination the default KVConfig is
planned to use). Real-Metal twins are marked `metal` and skip without Apple hardware.
"""

import mlx.core as mx
import numpy as np
import pytest

import metal_kernels as mk
from justfit.config import KVConfig
from justfit.kvexec import attention, kernels, make_cache
from metal_kernels import emulator
from metal_kernels import reference as ref
from metal_kernels.testing import NO_GXX, case

from tests.kernels_support import kernel_logits, tiny_llama

needs_emulator = pytest.mark.skipif(not emulator.available(), reason=NO_GXX)
PAGE = 64  # two key groups of 32 tokens per page


def f32(x):
    return np.array(x.astype(mx.float32))


def tol(dtype):
    return {mx.float16: 3e-3, mx.bfloat16: 2e-2, mx.float32: 1e-5}[dtype]


# ---- the kernel against the reference ------------------------------------------------------------
KERNEL_CASES = [
    # dtype, d, h, hq, nq, value group, key group, q_len (None: 3 pages + 5 tokens)
    (mx.float16, 64, 2, 2, 1, 32, 32, None),  # decode, partial last page inside its first key group
    (mx.float32, 64, 1, 3, 1, 64, 32, 3 * PAGE + 40),  # partial last page in its second key group
    (mx.bfloat16, 128, 1, 4, 1, 64, 64, None),  # one key group per page
    (mx.float16, 256, 2, 2, 1, 32, 32, 4 * PAGE),  # full pages only
    (mx.float32, 64, 1, 3, 2, 32, 32, 3 * PAGE + 40),  # verify: 2 queries
    (mx.float16, 128, 2, 4, 4, 64, 32, None),  # verify: 4 queries, GQA 2
    (mx.float32, 64, 1, 8, 8, 32, 64, 3 * PAGE + 17),  # verify: 8 queries, GQA 8
]


@needs_emulator
@pytest.mark.parametrize("dtype,d,h,hq,nq,group,key_group,q_len", KERNEL_CASES)
def test_channel_attention_matches_reference(dtype, d, h, hq, nq, group, key_group, q_len):
    *arrays, kw = case("channel", dtype, d, h, hq, nq, group, q_len=q_len, page=PAGE, key_group=key_group)
    got = mk.paged_attention(*arrays, backend="emulator", pages_per_split=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    assert got.shape == (hq, nq, d) and got.dtype == dtype
    np.testing.assert_allclose(f32(got), f32(want), atol=tol(dtype), rtol=tol(dtype))


@needs_emulator
@pytest.mark.parametrize("edge", [{"recent": 0}, {"table": (), "q_len": 0}, {"table": (3,), "q_len": 1}])
def test_channel_attention_edges(edge):
    *arrays, kw = case("channel", mx.float32, 64, 2, 2, 1, 32, page=PAGE, **edge)
    got = mk.paged_attention(*arrays, backend="emulator", pages_per_split=2, **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(f32(got), f32(want), atol=1e-5, rtol=1e-5)


def test_reference_channel_keys_are_kvexec_channel_codec():
    # The reference's seal / dequant are KVExec's ChannelCodec encode / decode, page by page.
    from justfit.kvexec.formats import ChannelCodec

    x = mx.random.normal((3, 2, PAGE, 64), key=mx.random.key(5))
    codec, table = ChannelCodec(64, 4, 32), mx.array([2, 0], dtype=mx.int32)
    pages = ref.seal_channel(x, 32, 4)
    for i in range(3):
        assert all(mx.array_equal(a, b[i]) for a, b in zip(codec.encode(x[i]), pages))
    want = mx.concatenate([codec.decode(tuple(p[int(i)] for p in pages)) for i in table], axis=1)
    assert mx.array_equal(ref.dequant_channel(*pages, table, 32, mx.float32), want)


@pytest.mark.parametrize("bad", [{"bits": 8}, {"key_group": None}, {"key_format": "rotated"},
                                 {"rotation": (mx.zeros((16,)), mx.ones((64,)), mx.ones((64,)))}])
def test_channel_keys_need_4_bit_affine_values_and_a_group(bad):
    *arrays, kw = case("channel", mx.float32, 64, 1, 3, 1, 32, page=PAGE)
    with pytest.raises(ValueError, match="key_format"):
        mk.paged_attention(*arrays, backend="reference", **{**kw, **bad})


# ---- KVExec: kernel path against its own MLX-ops path ---------------------------------------------
CHANNEL = KVConfig(float_pages=0, bits=4, format="affine", key_format="channel", group_size=32, page_size=PAGE,
                   quantized_kv_start=PAGE)  # channel keys in groups of 32 tokens, values g32
CHANNEL_G64 = KVConfig(float_pages=0, bits=4, format="affine", key_format="channel", group_size=64, page_size=128,
                       quantized_kv_start=128)
# Values in groups of 128, keys in groups of 64 (the largest group dividing the page): two group sizes.
CHANNEL_G128 = KVConfig(float_pages=0, bits=4, format="affine", key_format="channel", group_size=128, page_size=PAGE,
                        quantized_kv_start=PAGE)


def _filled(kv, tokens, head_dim=64, seed=0):
    """Layer 0 of a fresh cache holding `tokens` random keys (with a few loud channels) and values."""
    cache = make_cache(tiny_llama(head_dim), kv)[0]
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    loud = 1 + 9 * (mx.random.uniform(shape=(head_dim,), key=k3) > 0.9)  # what channel keys are for
    keys = mx.random.normal((1, 2, tokens, head_dim), key=k1) * loud
    cache.update_and_fetch(keys, mx.random.normal((1, 2, tokens, head_dim), key=k2))
    return cache


def _both(cache, L, monkeypatch, head_dim=64):
    """(kernel path, MLX-ops path) attention of L random queries (the cache's last L tokens)."""
    q = mx.random.normal((1, 4, L, head_dim), key=mx.random.key(L))
    mask = cache.make_mask(L)
    monkeypatch.setenv("JUSTFIT_KERNELS", "reference")
    want = attention.paged_attention(q, cache, head_dim ** -0.5, mask)
    monkeypatch.setenv("JUSTFIT_KERNELS", "emulator")
    kernels.CALLS.clear()
    got = attention.paged_attention(q, cache, head_dim ** -0.5, mask)
    return got, want


@needs_emulator
@pytest.mark.parametrize("kv,head_dim", [(CHANNEL, 64), (CHANNEL_G64, 64), (CHANNEL_G128, 128)],
                         ids=["g32", "g64", "v128-k64"])
@pytest.mark.parametrize("L", [1, 2, 5, 8])
def test_kvexec_channel_decode_and_verify_use_the_kernels(kv, head_dim, L, monkeypatch):
    # fp first page, two quantized pages, an open page holding the L queries.
    P = kv.page_size
    cache = _filled(kv, 3 * P + 11, head_dim)
    assert [p.kind for _, _, p in cache.pages()] == ["fp", "q", "q", "open"]
    got, want = _both(cache, L, monkeypatch, head_dim)
    assert kernels.CALLS == {"attention": 1}
    np.testing.assert_allclose(f32(got), f32(want), rtol=1e-4, atol=1e-4)


@needs_emulator
@pytest.mark.parametrize("cut", [3 * PAGE - 50, 3 * PAGE - 30, 2 * PAGE + 1])
def test_kvexec_channel_partial_last_page(cut, monkeypatch):
    # A trim into a sealed page leaves it quantized and partial: cut inside its first key group, inside
    # its second, or after its first token; the kernel reads only the valid tokens of the cut group.
    cache = _filled(CHANNEL, 3 * PAGE + 11)
    cache.trim(cache.offset - cut)
    assert [p.kind for _, _, p in cache.pages()] == ["fp", "q", "q"]
    got, want = _both(cache, 1, monkeypatch)
    assert kernels.CALLS == {"attention": 1}
    np.testing.assert_allclose(f32(got), f32(want), rtol=1e-4, atol=1e-4)


@needs_emulator
def test_default_kvconfig_with_channel_keys_uses_the_kernels(monkeypatch):
    # The default layout: page 256, group 64, channel keys (g64), affine 4-bit values.
    kv = KVConfig(float_pages=0, key_format="channel")
    cache = _filled(kv, 2 * 256 + 40, head_dim=128)
    for L in (1, 4):
        got, want = _both(cache, L, monkeypatch, head_dim=128)
        assert kernels.CALLS == {"attention": 1}
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-4, atol=1e-4)


# Pages of 64 tokens: fp [0, 64), q [64, 128), open from 128. The prompt (170) is prefill (falls back);
# then 5 decodes, a verify of 3, a decode and a verify of 4 (up to 183), all in the open page.
PROMPT = [(7 * i + 3) % 256 for i in range(170)]
STEPS = [[5], [9], [11], [13], [17], [1, 2, 3], [21], [4, 6, 8, 10]]


def _logits(model, kv, monkeypatch, env):
    return kernel_logits(model, kv, monkeypatch, env, PROMPT, STEPS)


@needs_emulator
def test_kvexec_channel_logits_match_reference(monkeypatch):
    model = tiny_llama()
    want, _ = _logits(model, CHANNEL, monkeypatch, "reference")
    kernels.CALLS.clear()
    got, caches = _logits(model, CHANNEL, monkeypatch, "emulator")
    assert kernels.CALLS["attention"] == 2 * len(STEPS) and kernels.CALLS["fallback"] == 2
    # Channel keys are sealed by ChannelCodec.encode (MLX ops); only values go through the seal kernel.
    assert kernels.CALLS["seal"] == 2 * 1
    assert [p.kind for _, _, p in caches[0].pages()] == ["fp", "q", "open"]
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4), float(mx.abs(got - want).max())


@needs_emulator
@pytest.mark.parametrize("kv", [
    KVConfig(float_pages=0, bits=4, format="affine", key_format="channel", key_bits=8, group_size=32, page_size=PAGE,
             quantized_kv_start=PAGE),
    KVConfig(float_pages=0, bits=4, format="rotated", key_format="channel", group_size=32, page_size=PAGE,
             quantized_kv_start=PAGE),
], ids=["8-bit-channel-keys", "rotated-values"])
def test_other_channel_mixes_fall_back(kv, monkeypatch):
    cache = _filled(kv, 3 * PAGE + 11)
    got, want = _both(cache, 1, monkeypatch)
    assert kernels.CALLS == {"fallback": 1}
    assert mx.array_equal(got, want)


# ---- real Metal ------------------------------------------------------------------------------------
@pytest.mark.parametrize("nq", [1, 4])
@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Metal hardware")
def test_channel_attention_on_metal_matches_reference(nq):
    *arrays, kw = case("channel", mx.float16, 128, 2, 8, nq, 64, page=PAGE, q_len=3 * PAGE + 40)
    got = mk.paged_attention(*arrays, backend="metal", **kw)
    want = mk.paged_attention(*arrays, backend="reference", **kw)
    np.testing.assert_allclose(f32(got), f32(want), atol=3e-3, rtol=3e-3)
