"""Every model family the installed mlx-lm ships: full-precision pages (KVConfig(bits=16)) give the same
greedy tokens as mlx-lm's KVCache. A family is skipped only with a stated reason (see kvexec_families)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from justfit.config import KVConfig
from justfit.kvexec import PagedKVCache, make_cache

from tests.kvexec_families import SPECIAL, build, families, greedy
DIFFERS = {  # families where mlx-lm's own cache and its mask disagree; KVExec follows the mask
    "plamo3": "mlx-lm masks window_size + 1 keys but its RotatingKVCache keeps window_size, so mlx-lm's "
              "window depends on prefill chunking; KVExec applies the mask's window",
}


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
        ref = greedy(model, make_prompt_cache(model))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError, ZeroDivisionError) as e:
        # the generic tiny config does not fit this family's ModelArgs
        pytest.skip(f"no tiny random config: {type(e).__name__}: {str(e)[:80]}")
    base = make_prompt_cache(model)
    if not any(type(c) in (KVCache, RotatingKVCache) for c in base):
        pytest.skip(f"no KVCache/RotatingKVCache layer ({type(base[0]).__name__}): nothing for KVExec to page")
    caches = make_cache(model, KVConfig(bits=16, page_size=32, quantized_kv_start=0))
    assert any(isinstance(c, PagedKVCache) for c in caches)
    assert greedy(model, caches) == ref  # routed (paged attention) or dense (see routing.py), same tokens
    assert greedy(model, make_prompt_cache(model)) == ref  # mlx-lm's own caches still work after routing
