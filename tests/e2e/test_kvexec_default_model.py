"""KVExec on the real default model (SmolLM2-135M-Instruct): bits=16 pages reproduce mlx-lm exactly."""

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from justfit.config import KVConfig
from justfit.kvexec import make_cache


def _greedy(model, caches, ids, n, forced=None):
    """Greedy tokens and step logits; with `forced`, feed those tokens instead (teacher forcing)."""
    logits = model(mx.array(ids)[None], cache=caches)[0, -1]
    out, steps = [], []
    for i in range(n):
        steps.append(logits)
        out.append(int(mx.argmax(logits)))
        logits = model(mx.array([[forced[i] if forced else out[-1]]]), cache=caches)[0, -1]
    return out, mx.stack(steps)


def test_fp16_pages_match_mlx_lm_and_q4_stays_close(runtime16):
    runtime16.phaseswap.enter("decode")  # weights resident even if an earlier test ran a tool phase
    model = runtime16.model
    ids = runtime16.encode("Explain why the sky is blue in two sentences.")
    ref, ref_logits = _greedy(model, make_prompt_cache(model), ids, 20)
    got, logits = _greedy(model, make_cache(model, KVConfig(bits=16, page_size=32)), ids, 20)
    assert got == ref  # several sealed pages plus the open one
    assert mx.allclose(logits, ref_logits, atol=1e-3)
    # rotated 4-bit, almost everything quantized (32-token pages): close to fp16, not identical
    _, q = _greedy(model, make_cache(model, KVConfig(quantized_kv_start=0, bits=4, format="rotated", page_size=32)), ids, 20, forced=ref)
    lp0, lp = (x - mx.logsumexp(x, axis=-1, keepdims=True) for x in (ref_logits, q))
    kl = float((mx.exp(lp0) * (lp0 - lp)).sum(-1).mean())
    assert 0 < kl < 0.1
