"""KVExec page codecs: layouts match the page contract, round-trip error bounds, attention pieces."""

import mlx.core as mx
import numpy as np
import pytest

from justfit.config import KVConfig
from justfit.kvexec import formats, rotation

HEAD_DIMS = [64, 80, 96, 128, 256]
CONFIGS = [KVConfig(bits=16), KVConfig(quantized_kv_start=0, bits=8), KVConfig(quantized_kv_start=0, bits=8, group_size=32), KVConfig(quantized_kv_start=0, bits=4),
           KVConfig(quantized_kv_start=0, bits=4, group_size=32), KVConfig(quantized_kv_start=0, bits=4, format="rotated"),
           KVConfig(quantized_kv_start=0, bits=4, key_format="affine"), KVConfig(quantized_kv_start=0, bits=4, key_format="affine", group_size=32)]
# relative MSE bound per format on Gaussian data (measured ~3e-5, 8e-3, 6.5e-3, 9.3e-3)
BOUND = {"fp16": 0.0, "q8-affine": 1e-4, "q4-affine": 0.012, "q4-rotated": 0.012, "q4-affine-k4-channel": 0.012}


def _wht_np(x):
    """Unnormalized Sylvester-order WHT along the last axis, written independently (recursive)."""
    n = x.shape[-1]
    if n == 1:
        return x
    a, b = _wht_np(x[..., : n // 2]), _wht_np(x[..., n // 2 :])
    return np.concatenate([a + b, a - b], axis=-1)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("kv", CONFIGS, ids=lambda k: f"{k.name}-g{k.group_size}")
def test_round_trip_error_bounds(d, kv):
    x = mx.random.normal((3, 64, d), key=mx.random.key(d))
    ck, cv = formats.make_codecs(kv, d)
    for codec in (ck, cv):
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape
        rel = float(((y - x) ** 2).sum() / (x**2).sum())
        assert rel <= BOUND[kv.name], rel
        if kv.bits == 4:
            assert rel > 1e-4  # really quantized


@pytest.mark.parametrize("d", [64, 128])
def test_affine_is_exactly_mx_quantize(d):
    x = mx.random.normal((2, 32, d))
    parts = formats.AffineCodec(d, 4, 64).encode(x)
    for a, b in zip(parts, mx.quantize(x, group_size=64, bits=4)):
        assert mx.array_equal(a, b)
    assert parts[0].shape == (2, 32, d * 4 // 32) and parts[1].shape == (2, 32, d // 64)


@pytest.mark.parametrize("d", [64, 80, 128])
def test_rotated_matches_contract_reference(d):
    """Encode with an independent numpy implementation of the contract and compare codes and norms."""
    x = np.random.default_rng(d).standard_normal((2, 16, d)).astype(np.float32)
    dp = rotation.padded_dim(d)
    codec = formats.RotatedCodec(d, rotation.KEY_SEED)
    packed, norm = codec.encode(mx.array(x))
    xp = np.concatenate([x, np.zeros((2, 16, dp - d), np.float32)], -1)
    n = np.linalg.norm(xp, axis=-1)
    s = np.array(rotation.signs(rotation.KEY_SEED, dp))
    y = _wht_np(s * xp / n[..., None]) / np.sqrt(dp)
    c = np.array(rotation.codebook(dp))
    ref_codes = np.abs(y[..., None] - c).argmin(-1)
    codes = np.array(formats.unpack4(packed))
    assert (codes == ref_codes).mean() > 0.999  # ties at float rounding only
    np.testing.assert_allclose(np.array(norm.astype(mx.float32)), n, rtol=1e-3)
    words = np.array(packed)
    assert words.dtype == np.uint32 and words.shape == (2, 16, dp // 8)
    assert ((words[..., 0] >> 4) & 15 == codes[..., 1]).all()  # element 1 sits in bits 4..7 of word 0


def test_codebook_and_rotation_properties():
    for dp in (64, 128, 256):
        c = np.array(rotation.codebook(dp))
        assert c.shape == (16,) and np.all(np.diff(c) > 0)
        np.testing.assert_allclose(c, -c[::-1], atol=1e-7)
        assert 2.0 / np.sqrt(dp) < c[-1] < 3.5 / np.sqrt(dp)  # tails of a coordinate with std 1/sqrt(Dp)
    x = mx.random.normal((4, 128))
    s = rotation.signs(7, 128)
    assert mx.allclose(rotation.unrotate(rotation.rotate(x, s), s), x, atol=1e-5)
    assert not mx.array_equal(rotation.signs(rotation.KEY_SEED, 64), rotation.signs(rotation.VALUE_SEED, 64))


def test_pack_unpack_round_trip():
    codes = mx.random.randint(0, 16, (3, 5, 64)).astype(mx.uint32)
    assert mx.array_equal(formats.unpack4(formats.pack4(codes)), codes)


@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("kv", CONFIGS[1:], ids=lambda k: f"{k.name}-g{k.group_size}")
def test_scores_and_mix_equal_dequantized_math(d, kv):
    x = mx.random.normal((2, 64, d))  # one page of 64 tokens (whole token groups for channel keys)
    q = mx.random.normal((2, 6, d))
    ck, cv = formats.make_codecs(kv, d)
    pk, pv = ck.encode(x), cv.encode(x * 0.5)
    s = ck.scores(ck.prepare(q), pk)
    assert mx.allclose(s, q @ ck.decode(pk).swapaxes(-1, -2), atol=1e-3)
    p = mx.softmax(s, axis=-1)
    assert mx.allclose(cv.finish(cv.mix(p, pv)), p @ cv.decode(pv), atol=1e-4)


def test_mixed_key_value_configs_are_named_and_checked():
    from justfit.config import KVConfig
    from justfit.errors import UserError
    from justfit.kvexec.formats import make_codecs

    kv = KVConfig(bits=4, key_format="rotated")
    ck, cv = make_codecs(kv, 64)
    assert (ck.name, cv.name) == ("rotated", "affine") and kv.name == "q4-affine-k4-rotated"
    k8 = KVConfig(bits=4, key_format="affine", key_bits=8)
    ck, cv = make_codecs(k8, 64)
    assert (ck.bits, cv.bits) == (8, 4) and k8.name == "q4-affine-k8-affine"
    assert KVConfig(key_format="affine").name == "q4-affine"  # plain formats keep their fingerprint names
    assert KVConfig(bits=8).name == "q8-affine" and KVConfig(format="rotated").name == "q4-rotated"
    ck, cv = make_codecs(KVConfig(), 64)  # the default: channel 4-bit keys, affine 4-bit values
    assert (ck.name, cv.name, KVConfig().name) == ("channel", "affine", "q4-affine-k4-channel")
    for bad in (dict(bits=16, key_bits=8), dict(key_format="nope"), dict(key_format="rotated", key_bits=8)):
        with pytest.raises(UserError):
            KVConfig(**bad)


@pytest.mark.parametrize("page,group", [(256, 64), (256, 32), (32, 64)])
def test_channel_keys_scores_match_their_decode_and_beat_per_token_on_outlier_channels(page, group):
    """Per-channel keys: scores (quantized matmul and dequantized GEMM paths) equal the decoded math, pages
    concatenate along axis 1, and a few large-offset channels (as in real keys) cost far less than affine."""
    kv = KVConfig(bits=4, key_format="channel", page_size=page, group_size=group, quantized_kv_start=0)
    ck, cv = formats.make_codecs(kv, 64)
    assert (ck.name, cv.name, kv.name) == ("channel", "affine", "q4-affine-k4-channel")
    offset = mx.zeros((64,)).at[mx.array([3, 17, 40])].add(mx.array([30.0, -25.0, 18.0]))
    x = mx.random.normal((2, 2 * page, 64), key=mx.random.key(1)) + offset
    pages = [ck.encode(x[:, i * page:(i + 1) * page]) for i in range(2)]
    run = tuple(mx.concatenate(col, axis=1) for col in zip(*pages))  # how attention concatenates a run
    y = ck.decode(run)
    assert y.shape == x.shape
    for rows in (3, formats.DEQUANT_ROWS):
        q = mx.random.normal((2, rows, 64))
        assert mx.allclose(ck.scores(ck.prepare(q), run), q @ y.swapaxes(-1, -2), atol=1e-2)
    affine = formats.make_codecs(KVConfig(bits=4, key_format="affine", quantized_kv_start=0), 64)[0]
    err = lambda c: float(((c.decode(c.encode(x)) - x) ** 2).mean())  # noqa: E731
    assert err(ck) * 20 < err(affine)


def test_quantized_configs_store_16_bit_floats_for_a_float32_model():
    """On CPU (float32 compute) a default page is exactly 4.5 bits per element (codes + bfloat16 scales and
    biases per 64) and full-precision pages are bfloat16; bits=16 keeps float32 (the lossless reference)."""
    from justfit.kvexec.cache import PagedKVCache
    from justfit.kvexec.pages import PagePool, Sequence

    x = mx.random.normal((1, 3, 512, 64), key=mx.random.key(5))
    for kv, fp_bytes, q_bits in ((KVConfig(), 2, 4.5), (KVConfig(bits=16), 4, None)):
        c = PagedKVCache(Sequence(PagePool(1, kv.page_size)), 0, kv)
        c.update_and_fetch(x, x)
        (_, _, first), (_, _, second) = c.pages()
        assert first.kind == "fp" and first.nbytes == 2 * 3 * 256 * 64 * fp_bytes
        if q_bits is not None:
            assert second.kind == "q" and second.nbytes * 8 == 2 * 3 * 256 * 64 * q_bits
            assert {a.dtype for a in second.k[1:] + second.v[1:]} == {mx.bfloat16}
        assert {a.dtype for a in first.k + first.v} == {formats.storage_dtype(kv, mx.float32)}


def test_open_pages_hold_float32_alone_and_16_bits_when_batched():
    """The page being filled keeps the dtype K/V arrive in (no cast per token), except in batched serving
    (for_batch), where it stays in the 16-bit storage dtype that the scheduler's KV arithmetic counts."""
    from justfit.kvexec.cache import PagedKVCache
    from justfit.kvexec.pages import PagePool, Sequence

    x = mx.random.normal((1, 3, 300, 64), key=mx.random.key(6))
    for batched, want in ((False, mx.float32), (True, mx.bfloat16)):
        c = PagedKVCache(Sequence(PagePool(1, 256)), 0, KVConfig())
        if batched:
            c.for_batch()
        c.update_and_fetch(x, x)
        c.update_and_fetch(x[:, :, :1], x[:, :, :1])
        (_, _, first), (_, n, page) = c.pages()
        assert page.kind == "open" and n == 45 and {a.dtype for a in page.k + page.v} == {want}
        assert first.kind == "fp" and {a.dtype for a in first.k + first.v} == {mx.bfloat16}  # sealed: 16 bits


@pytest.mark.parametrize("kv", [KVConfig(quantized_kv_start=0), KVConfig(quantized_kv_start=0, bits=8)],
                         ids=lambda k: k.name)
def test_16_bit_scales_read_exactly_and_old_float32_pages_still_read(kv):
    """Scores and mixes on 16-bit scales equal float32 math on the decoded page (MLX would compute them in
    16 bits if the scales were not widened), and pages with float32 or float16 scales (written by earlier
    versions) read the same."""
    ck, cv = formats.make_codecs(kv, 64)
    x = mx.random.normal((2, 256, 64), key=mx.random.key(9))
    q = mx.random.normal((2, 6, 64), key=mx.random.key(10))
    for parts in (ck.encode(x), ck.widened(ck.encode(x), mx.float32), ck.widened(ck.encode(x), mx.float16)):
        assert mx.allclose(ck.scores(q, parts), q @ ck.decode(parts).swapaxes(-1, -2), atol=1e-5, rtol=1e-5)
    pv = cv.encode(x)
    p = mx.softmax(q @ x.swapaxes(-1, -2), axis=-1)
    assert mx.allclose(cv.mix(p, pv), p @ cv.decode(pv), atol=1e-5, rtol=1e-5)
