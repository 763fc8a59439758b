"""Softmax over runs of keys in different storage formats, shared by single-sequence and batched attention.

`whole`: every run's scores fit one small block (decode, a short prefill), so they are normalized together
in one pass, a few ops per run. `Online`: runs are folded one at a time into running (max, sum, output)
accumulators, so only one run's scores exist at once (long prefill). Both give an `Online` state, so parts
of one block's keys computed apart (on parallel streams, streams.py) combine with `Online.merge`. Either
way each value codec's mixed output stays in its own space and is mapped back once (`finish`), then
divided by the softmax sum.
The exponentials run through `exp_shifted`: MLX's CPU exp costs ~17 ns an element, most of a long
prefill's time; a polynomial fused by mx.compile costs ~4 (without a C++ compiler MLX runs it unfused).
"""

import mlx.core as mx

NEG_INF = -float("inf")
FAST_EXP_ELEMENTS = 1 << 12  # score blocks this big take the compiled exp (below it, call overhead wins)
_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453


def _exp_poly(x):
    """e^x in float32 for x <= 0: 2^n times a degree-6 polynomial of the rest (relative error < 1e-5);
    0 below -87, where float32 e^x underflows, so masked keys (-inf) weigh exactly nothing."""
    y = mx.maximum(x, -87.0)
    n = mx.floor(y * _LOG2E + 0.5)
    r = y - n * _LN2
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720))))))
    return mx.where(x < -87.0, 0.0, p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32))


_exp_fused = mx.compile(lambda s, m: _exp_poly(s - m))


def exp_shifted(s, m):
    """exp(s - m) of float32 scores s [.., M, T] against row maxima m [.., M, 1] (finite, >= every s)."""
    if s.size < FAST_EXP_ELEMENTS or s.dtype != mx.float32:
        return mx.exp(s - m)
    return _exp_fused(s, m)


def whole(scores, values) -> "Online":
    """Softmax state of masked float32 score blocks [.., M, T_i] with their (value codec, parts), all
    normalized at once; a block whose values entry is None (an attention-sink column) only joins the sum."""
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    m = s.max(axis=-1, keepdims=True)
    p = exp_shifted(s, mx.where(m == NEG_INF, 0.0, m))
    state, t0 = Online(m, p.sum(axis=-1, keepdims=True)), 0
    for block, vals in zip(scores, values):
        T = block.shape[-1]
        if vals is not None:
            cv, parts = vals
            _add(state.acc, cv, cv.mix(p if len(scores) == 1 else p[..., t0 : t0 + T], parts))
        t0 += T
    return state


class Online:
    """Running max `m`, sum `l` and per-value-codec outputs of a softmax folded run by run."""

    def __init__(self, m, l):
        self.m, self.l, self.acc = m, l, {}

    def fold(self, s, cv, parts):
        """Add one run: masked float32 scores s [.., M, T] and its values (codec, stored parts)."""
        m_new = mx.maximum(self.m, s.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == NEG_INF, 0.0, m_new)
        p = exp_shifted(s, m_safe)
        alpha = mx.exp(self.m - m_safe)
        self.l = self.l * alpha + p.sum(axis=-1, keepdims=True)
        self.acc = {key: (c, a * alpha) for key, (c, a) in self.acc.items()}
        _add(self.acc, cv, cv.mix(p, parts))
        self.m = m_new

    def merge(self, other: "Online") -> "Online":
        """The state of both parts' keys together (each normalized against its own max so far)."""
        m = mx.maximum(self.m, other.m)
        m_safe = mx.where(m == NEG_INF, 0.0, m)
        a, b = mx.exp(self.m - m_safe), mx.exp(other.m - m_safe)
        out = Online(m, self.l * a + other.l * b)
        out.acc = {key: (c, x * a) for key, (c, x) in self.acc.items()}
        for c, x in other.acc.values():
            _add(out.acc, c, x * b)
        return out

    def arrays(self):
        """The accumulators (what the next run's reads may wait on)."""
        return [self.m, self.l, *(a for _, a in self.acc.values())]

    def result(self, shape):
        return _finish(self.acc, self.l, shape)


def _add(acc, cv, o):
    acc[id(cv)] = (cv, o if id(cv) not in acc else acc[id(cv)][1] + o)


def _finish(acc, l, shape):
    """Sum of each value codec's output mapped back to head_dim, normalized by l."""
    o = None
    for cv, a in acc.values():
        o = cv.finish(a) if o is None else o + cv.finish(a)
    if o is None:  # nothing visible (only possible with an all-masking dense mask)
        return mx.zeros(shape)
    return o / mx.maximum(l, 1e-30)
