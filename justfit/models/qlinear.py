"""Quantized weights that stay quantized on the CPU: mlx-lm's nn.QuantizedLinear / QuantizedEmbedding heads
computed by qmm.c for decode-sized inputs and by BLAS over a dequantized copy of one layer for prefill.

`use_kernel(model)` changes the class of every affine nn.QuantizedLinear (and of a quantized embedding
whose `as_linear` is the tied head) in place: same arrays, same parameter names, no model code forked.
- Up to `kernel_rows` rows (decode, small batches, short prompts; measured by tuning.py, 16-64): one
  qmm.c call. Siblings that read the same input (q/k/v, gate/up)
  form a group: the first one called computes all of them in one call (one host synchronization instead
  of three) and hands the others their outputs when they are called with that same array.
- More rows (prefill of a longer prompt): this layer's weight is dequantized to float32 and multiplied by MLX's matmul
  (BLAS), so a long prompt runs as fast as on float32 weights; the float copy is a temporary that
  MLX's allocator reuses from one layer to the next, so at most about one layer's float weight is alive.
- Where the kernel does not run (JUSTFIT_CPU_KERNELS=0, no compiler, other CPUs) MLX's quantized_matmul.
`standard(model)` puts mlx-lm's classes back (for mlx-lm's own code paths: sharding, baselines).
"""

import mlx.core as mx
import mlx.nn as nn

from . import qmm, tuning

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("wq", "wk", "wv"), ("w1", "w3"))


class _Group:
    """Sibling layers that read the same input: the last input seen and the outputs not yet handed out."""

    def __init__(self, members):
        self.members = members
        self.x = None
        self.ready = {}

    def run(self, x, me):
        if self.x is x and id(me) in self.ready:
            out = self.ready.pop(id(me))
            if not self.ready:
                self.x = None
            return out
        outs = _kernel(x, self.members)
        self.x, self.ready = x, {id(m): o for m, o in zip(self.members, outs) if m is not me}
        return outs[self.members.index(me)]


def _weights(layers):
    return [(m["weight"], m["scales"], m["biases"], m.group_size, m.bits) for m in layers]


def _kernel(x, linears):
    """x @ W^T (+ bias) for each quantized linear layer, in one qmm.c call."""
    choice = tuning.choices()
    outs = qmm.matmul(x, _weights(linears), choice["variant"], choice["threads"])
    return [o + m["bias"] if "bias" in m else o for m, o in zip(linears, outs)]


def _decode_sized(x, layers) -> bool:
    return qmm.available() and qmm.takes(x, _weights(layers), tuning.choices().get("kernel_rows", 16))


def _dense(x, w, scales, biases, group_size, bits):
    """x @ W^T: MLX's quantized_matmul for a few rows, else BLAS over this weight dequantized to float32."""
    rows = x.size // x.shape[-1]
    if rows <= 16:
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(x.dtype).T


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear computed by qmm.c (decode) or BLAS on a dequantized copy (prefill)."""

    def __call__(self, x):
        if _decode_sized(x, [self]):
            group = self.__dict__.get("_qmm_group")
            return group.run(x, self) if group is not None else _kernel(x, [self])[0]
        y = _dense(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose tied head (`as_linear`) runs like KernelQuantizedLinear."""

    def as_linear(self, x):
        if _decode_sized(x, [self]):
            return _kernel(x, [self])[0]
        return _dense(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)


SWAPS = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}


def _affine(m) -> bool:
    return getattr(m, "mode", "affine") == "affine" and m.bits in (4, 8) and m.group_size in (32, 64, 128)


def use_kernel(model) -> int:
    """Swap the model's affine quantized linears and embeddings to the kernel's classes, in place, and group
    siblings that read the same input; returns how many modules changed. Idempotent."""
    n = 0
    for _, m in model.named_modules():
        new = SWAPS.get(type(m))
        if new is not None and _affine(m):
            m.__class__ = new
            n += 1
    for _, m in model.named_modules():
        for names in GROUPS:
            members = [m[k] for k in names if k in m and isinstance(m[k], KernelQuantizedLinear)]
            if len(members) == len(names) and len({(x.group_size, x.bits, x.weight.shape[1]) for x in members}) == 1:
                for x in members:
                    object.__setattr__(x, "_qmm_group", _Group(members) if x is members[0] else members[0]._qmm_group)
    return n


def standard(model) -> int:
    """Undo use_kernel: mlx-lm's own classes again; returns how many modules changed."""
    n = 0
    back = {v: k for k, v in SWAPS.items()}
    for _, m in model.named_modules():
        old = back.get(type(m))
        if old is not None:
            m.__dict__.pop("_qmm_group", None)
            m.__class__ = old
            n += 1
    return n


def kernel_modules(model) -> int:
    """How many modules run through the kernel's classes."""
    return sum(isinstance(m, tuple(SWAPS.values())) for _, m in model.named_modules())
