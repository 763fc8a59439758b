"""KVExec on the Metal kernels (through the emulator here) gives the same logits as its MLX-ops path."""

import mlx.core as mx
import pytest

from justfit.config import KVConfig
from justfit.errors import UserError
from justfit.kvexec import attention, kernels
from metal_kernels.emulator import available as emulator_available

from tests.kernels_support import kernel_logits, tiny_llama

NO_EMULATOR = "g++ not found: the Metal emulator compiles kernels with g++"
CONFIGS = [
    KVConfig(float_pages=0, bits=4, format="affine", key_format="affine", group_size=32, page_size=32, quantized_kv_start=32),
    KVConfig(float_pages=0, bits=4, format="affine", key_format="affine", group_size=64, page_size=32, quantized_kv_start=32),
    KVConfig(float_pages=0, bits=4, format="rotated", page_size=32, quantized_kv_start=32),
]
PROMPT = [(7 * i + 3) % 256 for i in range(90)]
# Decode steps and verify blocks after the prompt (offset 90): decodes up to 95, a verify block of 3
# that crosses the seal at 96 (falls back: a query in a quantized page), a decode, a verify of 4.
STEPS = [[5], [9], [11], [13], [17], [1, 2, 3], [21], [4, 6, 8, 10]]


def _logits(model, kv, monkeypatch, env):
    return kernel_logits(model, kv, monkeypatch, env, PROMPT, STEPS)


@pytest.fixture
def emulator():
    if not emulator_available():
        pytest.skip(NO_EMULATOR)
    return "emulator"


CASES = [(kv, 64) for kv in CONFIGS] + [(CONFIGS[1], 80), (CONFIGS[2], 80)]  # 80 pads to 128


@pytest.mark.parametrize("kv,head_dim", CASES, ids=[f"{kv.format}-g{kv.group_size}-d{d}" for kv, d in CASES])
def test_kernel_path_gives_reference_logits(kv, head_dim, monkeypatch, emulator):
    model = tiny_llama(head_dim)
    kernels.CALLS.clear()
    want, ref_caches = _logits(model, kv, monkeypatch, "reference")
    assert not kernels.CALLS  # the reference path never touches the kernels
    got, caches = _logits(model, kv, monkeypatch, emulator)
    # 2 layers x (6 decode steps + 1 verify of 4); prefill and the seal-crossing verify fall back.
    assert kernels.CALLS["attention"] == 2 * 7 and kernels.CALLS["fallback"] == 2 * 2
    assert kernels.CALLS["seal"] == 2 * 2 * 2  # pages 1 and 2 sealed quantized, K and V, 2 layers
    assert [p.kind for _, _, p in caches[0].pages()] == ["fp", "q", "q", "open"]
    atol = 1e-4
    if kv.format == "rotated":  # the seal kernel rotates with a butterfly, the reference with a matmul: a value
        # within rounding of a codebook boundary may take the neighbouring code (1 of 8,192 in layer 1 here)
        assert _codes_differing(ref_caches, caches) <= 0.001, "kernel and reference seals disagree beyond rounding"
        atol = 5e-3
    assert mx.allclose(got, want, rtol=1e-5, atol=atol), float(mx.abs(got - want).max())


def _codes_differing(a, b) -> float:
    """Fraction of 4-bit codes that differ between two caches' quantized pages (same layout)."""
    from justfit.kvexec.formats import unpack4

    n = same = 0
    for ca, cb in zip(a, b):
        for (_, _, p), (_, _, q) in zip(ca.pages(), cb.pages()):
            if p.kind == "q":
                for x, y in ((p.k[0], q.k[0]), (p.v[0], q.v[0])):
                    n += unpack4(x).size
                    same += int((unpack4(x) == unpack4(y)).sum())
    return 1 - same / n


def test_partial_last_quantized_page_and_fp_window(monkeypatch, emulator):
    # A trim that cuts into a sealed page leaves it quantized and partial until the next write:
    # the kernels get a partial last page (q_len not a multiple of P) plus the fp first page.
    model, kv = tiny_llama(), CONFIGS[0]
    _, caches = _logits(model, kv, monkeypatch, "reference")
    cache = caches[1]
    cache.trim(cache.offset - 93)  # pages: fp [0, 32), q [32, 64), q [64, 93) partial
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1))
    want = attention.paged_attention(q, cache, 0.125)
    monkeypatch.setenv("JUSTFIT_KERNELS", emulator)
    kernels.CALLS.clear()
    got = attention.paged_attention(q, cache, 0.125)
    assert kernels.CALLS["attention"] == 1
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unsupported_shapes_and_masks_fall_back(monkeypatch, emulator):
    # head_dim 96 with group 32 stays 96 wide: no kernel, so KVExec's own path runs it.
    model = tiny_llama(head_dim=96)
    kernels.CALLS.clear()
    want, _ = _logits(model, CONFIGS[0], monkeypatch, "reference")
    got, _ = _logits(model, CONFIGS[0], monkeypatch, emulator)
    assert kernels.CALLS["attention"] == 0 and kernels.CALLS["seal"] == 0
    assert kernels.CALLS["fallback"] == 2 * (1 + len(STEPS))
    assert mx.array_equal(got, want)


def test_dispatch_resolves_per_machine_and_env(monkeypatch):
    monkeypatch.delenv("JUSTFIT_KERNELS", raising=False)
    assert kernels.backend() == ("metal" if mx.metal.is_available() else "reference")
    monkeypatch.setenv("JUSTFIT_KERNELS", "reference")
    assert kernels.backend() == "reference"
    monkeypatch.setenv("JUSTFIT_KERNELS", "cuda")
    with pytest.raises(UserError, match="JUSTFIT_KERNELS"):
        kernels.backend()
    monkeypatch.setenv("JUSTFIT_KERNELS", "metal")
    if mx.metal.is_available():
        assert kernels.backend() == "metal"
    else:
        with pytest.raises(UserError, match="Metal is not available"):
            kernels.backend()


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Metal (forced JUSTFIT_KERNELS=metal)")
@pytest.mark.parametrize("kv", CONFIGS, ids=lambda kv: f"{kv.format}-g{kv.group_size}")
def test_forced_metal_gives_reference_logits(kv, monkeypatch):
    model = tiny_llama()
    want, _ = _logits(model, kv, monkeypatch, "reference")
    kernels.CALLS.clear()
    got, _ = _logits(model, kv, monkeypatch, "metal")
    assert kernels.CALLS["attention"] == 2 * 7
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-3), float(mx.abs(got - want).max())
