"""Route mlx-lm models' attention to KVExec without editing mlx-lm and without breaking its own caches.

The seam: every mlx-lm model file that computes attention calls `scaled_dot_product_attention`, which
it imports by name from `mlx_lm.models.base` (102 of 102 callers in mlx-lm 0.32.2; none calls it
through another module). `route(model)` rebinds that one name, in every loaded `mlx_lm.models.*`
module that holds base's function, to a dispatcher: when `keys` is a `PagedKV` handle (returned by
`PagedKVCache.update_and_fetch`) it runs paged attention, otherwise it calls base's function
unchanged, so mlx-lm's KVCache, QuantizedKVCache and RotatingKVCache keep working in the process.

Why not a patch inside base (its `hasattr(cache, "bits")` branch, i.e. making our cache look like a
QuantizedKVCache and replacing `base.quantized_scaled_dot_product_attention`): that branch raises on
attention sinks (gpt_oss, mimo_v2_flash) and would make every caller treat paged caches as mlx-lm
quantized ones. Rebinding by identity needs no list of model files and no knowledge of which module
defines which class, so a family added or reorganized by an mlx-lm upgrade is covered as long as it
imports base's function; tests/unit/test_kvexec_families.py runs every family the installed mlx-lm ships.
A model is routed only when every module that calls `cache.update_and_fetch` passes what it gets
back to that function alone (checked on the source, `_uses_only_sdpa`); multi-latent attention
(deepseek_v3, bailing_hybrid...) multiplies the cached latents itself, and a model calling
`mx.fast.scaled_dot_product_attention` directly is not routable either: their caches run in `dense`
mode (correct, full workspace). Wrapping is idempotent.
"""

import ast
import inspect
import sys
import textwrap
from functools import lru_cache

from .attention import paged_attention
from .batch import BatchKV, batch_attention
from .cache import PagedKV

NAME = "scaled_dot_product_attention"
PACKAGE = "mlx_lm.models."


def _dispatcher(original):
    signature = inspect.signature(original)

    def scaled_dot_product_attention(queries, keys, values, *args, **kwargs):
        if not isinstance(keys, (PagedKV, BatchKV)):
            return original(queries, keys, values, *args, **kwargs)
        # mlx-lm's callers pass everything after values by keyword; skip the signature bind, paid every layer of every token
        a = kwargs if not args and "scale" in kwargs else signature.bind(queries, keys, values, *args, **kwargs).arguments
        if isinstance(keys, BatchKV):  # -- batching (scheduler): B sequences in one call, kvexec/batch.py
            return batch_attention(queries, keys.layer, a["scale"], a.get("sinks"))
        return paged_attention(queries, keys.cache, a["scale"], a.get("mask"), a.get("sinks"))

    scaled_dot_product_attention.kvexec_original = original
    return scaled_dot_product_attention


def _modules(model):
    """The model's own modules plus every loaded mlx_lm.models module (helpers a model calls into)."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    names |= {n for n in list(sys.modules) if n.startswith(PACKAGE)}
    return [sys.modules[n] for n in sorted(names) if sys.modules.get(n) is not None]


@lru_cache(maxsize=None)
def _uses_only_sdpa(cls) -> bool:
    """True when cls.__call__ hands update_and_fetch's results only to NAME (reading .shape/.dtype is fine)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, SyntaxError):
        return False
    names, after = set(), None  # names bound to its results, and the line they are bound on
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr == "update_and_fetch":
                for t in node.targets:
                    names |= {e.id for e in ast.walk(t) if isinstance(e, ast.Name)}
                after = node.lineno if after is None else min(after, node.lineno)
    if not names:
        return True
    allowed = set()
    for node in ast.walk(tree):  # the other branch of an `if` that updates the cache never sees the handles
        if isinstance(node, ast.If):
            for here, other in ((node.body, node.orelse), (node.orelse, node.body)):
                if any(getattr(n, "lineno", None) == after for b in here for n in ast.walk(b)):
                    allowed |= {id(n) for b in other for n in ast.walk(b)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == NAME:
            allowed |= {id(a) for a in list(node.args) + [k.value for k in node.keywords]}
        elif isinstance(node, ast.Attribute) and node.attr in ("shape", "dtype"):
            allowed.add(id(node.value))
    return all(id(n) in allowed for n in ast.walk(tree)
               if isinstance(n, ast.Name) and n.id in names and isinstance(n.ctx, ast.Load) and n.lineno > after)


def _calls_update(cls) -> bool:
    try:
        return "update_and_fetch" in inspect.getsource(cls.__call__)
    except (OSError, TypeError, AttributeError):
        return False


def route(model) -> bool:
    """Install the dispatcher wherever base's attention is bound; False when the model's modules call none."""
    from mlx_lm.models import base

    original = getattr(base, NAME)
    own = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    routed = False
    for module in _modules(model):
        if module is base:
            continue
        fn = getattr(module, NAME, None)
        if fn is original:
            setattr(module, NAME, _dispatcher(original))
            fn = getattr(module, NAME)
        if getattr(fn, "kvexec_original", None) is original and module.__name__ in own:
            routed = True
    classes = {type(m) for _, m in model.named_modules()}
    return routed and all(_uses_only_sdpa(c) for c in classes if _calls_update(c))
