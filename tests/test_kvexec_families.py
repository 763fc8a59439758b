"""Every model family the installed mlx-lm ships: full-precision pages (KVConfig(bits=16)) give the same
greedy tokens as mlx-lm's KVCache. A family is skipped only with a stated reason (see kvexec_families)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from justfit.config import KVConfig
from justfit.kvexec import PagedKVCache, make_cache

from .kvexec_families import SPECIAL, build, families

PROMPT = [(5 * i + 3) % 120 + 1 for i in range(40)]  # > 2 pages of 16 tokens, and past the sliding window (8)
DIFFERS = {  # families where mlx-lm's own cache and its mask disagree; KVExec follows the mask
    "plamo3": "mlx-lm masks window_size + 1 keys but its RotatingKVCache keeps window_size, so mlx-lm's "
              "window depends on prefill chunking; KVExec applies the mask's window",
}


def _greedy(model, caches, n=6, chunk=17):
    x = mx.array(PROMPT)[None]
    for i in range(0, len(PROMPT), chunk):  # chunked prefill crosses page boundaries mid-chunk
        logits = model(x[:, i : i + chunk], cache=caches)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache=caches)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", families())
def test_family_fp_pages_match_mlx_lm(family, request):
    if family in SPECIAL:
        pytest.skip(SPECIAL[family])
    if family in DIFFERS:  # strict: when mlx-lm changes, the unexpected pass says so
        request.applymarker(pytest.mark.xfail(reason=DIFFERS[family], strict=True))
    mx.random.seed(0)
    try:
        model, reason = build(family)
        if model is None:
            pytest.skip(reason)
        ref = _greedy(model, make_prompt_cache(model))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError, ZeroDivisionError) as e:
        # the generic tiny config does not fit this family's ModelArgs
        pytest.skip(f"no tiny random config: {type(e).__name__}: {str(e)[:80]}")
    base = make_prompt_cache(model)
    if not any(type(c) in (KVCache, RotatingKVCache) for c in base):
        pytest.skip(f"no KVCache/RotatingKVCache layer ({type(base[0]).__name__}): nothing for KVExec to page")
    caches = make_cache(model, KVConfig(bits=16, page_size=32, quantized_kv_start=0))
    assert any(isinstance(c, PagedKVCache) for c in caches)
    assert _greedy(model, caches) == ref  # routed (paged attention) or dense (see routing.py), same tokens
    assert _greedy(model, make_prompt_cache(model)) == ref  # mlx-lm's own caches still work after routing
