"""Route mlx-lm models' attention to KVExec without editing mlx-lm and without breaking its own caches.

mlx-lm model modules do `from .base import scaled_dot_product_attention` and call that module-level
name. `route(model)` replaces the name, in every module that defines a class of the model, with a
dispatcher: when `keys` is a `PagedKV` handle (returned by `PagedKVCache.update_and_fetch`) it runs
paged attention, otherwise it calls the original function unchanged, so mlx-lm's KVCache,
QuantizedKVCache and RotatingKVCache keep working in the same process. Wrapping is idempotent.
"""

import inspect
import sys

from .attention import paged_attention
from .batch import BatchKV, batch_attention
from .cache import PagedKV

NAME = "scaled_dot_product_attention"


def _dispatcher(original):
    signature = inspect.signature(original)

    def scaled_dot_product_attention(queries, keys, values, *args, **kwargs):
        if not isinstance(keys, (PagedKV, BatchKV)):
            return original(queries, keys, values, *args, **kwargs)
        a = signature.bind(queries, keys, values, *args, **kwargs).arguments
        if isinstance(keys, BatchKV):  # -- batching (scheduler): B sequences in one call, kvexec/batch.py
            return batch_attention(queries, keys.layer, a["scale"], a.get("sinks"))
        return paged_attention(queries, keys.cache, a["scale"], a.get("mask"), a.get("sinks"))

    scaled_dot_product_attention.kvexec_original = original
    return scaled_dot_product_attention


def route(model) -> bool:
    """Install the dispatcher in the model's modules; False when none calls a routable attention."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    routed = False
    for name in names:
        module = sys.modules.get(name)
        fn = getattr(module, NAME, None)
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, "kvexec_original"):
            setattr(module, NAME, _dispatcher(fn))
        routed = True
    return routed
