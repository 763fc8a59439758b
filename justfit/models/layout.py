"""Row-major weights on the CPU: a float `nn.Linear` stores W^T ([in, out]), so a token's x @ W.T is one plain
row-major product; a tied embedding stores its table the same way, for its head.

Why: MLX's CPU matmul hands both layouts to BLAS as a GEMM, and OpenBLAS multiplies one row by a transposed
weight slower than by a row-major one, about even from a few hundred rows (prefill chunks). A decode step
is mostly such one-row products, so decode gains (benchmarks/repro/row_major_ab.py; results in
docs/benchmarks.md). Same bytes and the model folder's parameter names; only the layout differs. The price:
a lookup reads a column of the table, a small cost next to a prefill chunk's matmuls. `standard` undoes it,
for code that expects W as [out, in] (mlx-lm's `model.shard`, a baseline run as mlx-lm's users get it).
A module is left alone when its model's source reads `<name>.weight` itself (minicpm's and seed_oss's
heads multiply `embed_tokens.weight.T`): only modules reached through __call__ / as_linear change.
"""

import ast
import inspect
import sys
import textwrap
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from ..config import switched_off
from .device import backend

FLOATS = (mx.float32, mx.float16, mx.bfloat16)


class RowMajorLinear(nn.Module):
    """nn.Linear whose `weight` is stored [input_dims, output_dims]: y = x @ weight (+ bias)."""

    def __init__(self, weight: mx.array, bias=None):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias

    def __call__(self, x):
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight"])
        return x @ self["weight"]


class RowMajorEmbedding(nn.Module):
    """nn.Embedding whose table is stored [dims, num_embeddings]: lookups read columns, the tied head
    (`as_linear`) multiplies row-major."""

    def __init__(self, weight_t: mx.array):
        super().__init__()
        self.weight = weight_t

    def __call__(self, x):
        return self["weight"].T[x]

    def as_linear(self, x):
        return x @ self["weight"]


def enabled() -> bool:
    """Row-major on the CPU backend when it was measured faster here (tuning.py), unless JUSTFIT_ROW_MAJOR=0
    (Metal and CUDA have their own GEMV)."""
    if switched_off("JUSTFIT_ROW_MAJOR") or backend() != "cpu":
        return False
    from . import tuning

    return tuning.choices()["row_major"]


def row_major(model) -> int:
    """Swap the model's float nn.Linear / tied nn.Embedding modules for row-major ones, in place; returns
    how many. Idempotent. One module at a time, so at most one extra weight is alive while it runs."""
    read, heads = _scan(_model_modules(model))
    if "lm_head" in model:  # an untied head: the table is only looked up, its layout does not matter
        heads = frozenset()
    return _swap(model, lambda key, child: _convertible(key, child, read, heads), _row_major)


def standard(model) -> int:
    """Undo row_major: every row-major module back to mlx-lm's nn.Linear / nn.Embedding; returns how many."""
    return _swap(model, lambda key, child: isinstance(child, (RowMajorLinear, RowMajorEmbedding)), _standard)


def row_major_names(model) -> frozenset:
    """Parameter names (as in the model folder) whose arrays this model holds transposed."""
    return frozenset(f"{name}.weight" for name, m in model.named_modules()
                     if isinstance(m, (RowMajorLinear, RowMajorEmbedding)))


def _slots(model):
    """(owner, key) of every direct child module (a list's children keyed by index). Slots, not modules:
    holding every old module until the end would keep both layouts of the weights alive at once."""
    out = []
    for _, owner in model.named_modules():
        for key, child in owner.children().items():
            if isinstance(child, nn.Module):
                out.append((owner, key))
            elif isinstance(child, list):
                out += [(child, i) for i, c in enumerate(child) if isinstance(c, nn.Module)]
    return out


def _convertible(key, child, read, heads) -> bool:
    """A float nn.Linear, or the nn.Embedding of a tied head (an untied table is only looked up), that
    the model's code never reads as `<key>.weight`."""
    if type(child) is nn.Linear:
        ok = True
    elif type(child) is nn.Embedding:
        ok = key in heads
    else:
        return False
    return ok and child.weight.dtype in FLOATS and not (isinstance(key, str) and key in read)


def _model_modules(model) -> tuple:
    """Names of the mlx-lm modules that define the model's classes (whose code may read a weight)."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return tuple(sorted(n for n in names if n.startswith("mlx_lm.")))


def _row_major(child):
    if isinstance(child, nn.Embedding):
        return RowMajorEmbedding(mx.contiguous(child.weight.T))
    return RowMajorLinear(mx.contiguous(child.weight.T), child.bias if "bias" in child else None)


def _standard(child):
    w = mx.contiguous(child.weight.T)
    if isinstance(child, RowMajorEmbedding):
        new = nn.Embedding(w.shape[0], w.shape[1])
    else:
        new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in child)
        if "bias" in child:
            new.bias = child.bias
    new.weight = w
    return new


def _swap(model, wanted, convert) -> int:
    n = 0
    for owner, key in _slots(model):
        child = owner[key] if isinstance(owner, list) else getattr(owner, key)
        if not wanted(key, child):
            continue
        new = convert(child)
        mx.eval(new.parameters())
        if isinstance(owner, list):
            owner[key] = new
        else:
            setattr(owner, key, new)
        del child, new  # the old layout's array is freed here, before the next module is converted
        n += 1
    return n


@lru_cache(maxsize=None)
def _scan(modules: tuple):
    """(names X whose `X.weight` that code reads, names X on which it calls `X.as_linear(...)`)."""
    read, heads = set(), set()
    for name in modules:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(sys.modules[name])))
        except (KeyError, OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if node.attr == "weight":
                    read.add(node.value.attr)
                elif node.attr == "as_linear":
                    heads.add(node.value.attr)
    return frozenset(read), frozenset(heads)
