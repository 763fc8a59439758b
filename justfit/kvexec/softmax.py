"""Softmax over runs of keys in different storage formats, shared by single-sequence and batched attention.

`whole`: every run's scores fit one small block (decode, a short prefill), so they are normalized together
in one pass, a few ops per run. `Online`: runs are folded one at a time into running (max, sum, output)
accumulators, so only one run's scores exist at once (long prefill). Either way each value codec's mixed
output stays in its own space and is mapped back once (`finish`), then divided by the softmax sum.
"""

import mlx.core as mx

NEG_INF = -float("inf")


def whole(scores, values, shape):
    """Output [.., M, Dv] of masked float32 score blocks [.., M, T_i] with their (value codec, parts); a
    block whose values entry is None (an attention-sink column) only joins the normalization."""
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    m = s.max(axis=-1, keepdims=True)
    p = mx.exp(s - mx.where(m == NEG_INF, 0.0, m))
    acc, t0 = {}, 0
    for block, vals in zip(scores, values):
        T = block.shape[-1]
        if vals is not None:
            cv, parts = vals
            _add(acc, cv, cv.mix(p if len(scores) == 1 else p[..., t0 : t0 + T], parts))
        t0 += T
    return _finish(acc, p.sum(axis=-1, keepdims=True), shape)


class Online:
    """Running max `m`, sum `l` and per-value-codec outputs of a softmax folded run by run."""

    def __init__(self, m, l):
        self.m, self.l, self.acc = m, l, {}

    def fold(self, s, cv, parts):
        """Add one run: masked float32 scores s [.., M, T] and its values (codec, stored parts)."""
        m_new = mx.maximum(self.m, s.max(axis=-1, keepdims=True))
        m_safe = mx.where(m_new == NEG_INF, 0.0, m_new)
        p = mx.exp(s - m_safe)
        alpha = mx.exp(self.m - m_safe)
        self.l = self.l * alpha + p.sum(axis=-1, keepdims=True)
        self.acc = {key: (c, a * alpha) for key, (c, a) in self.acc.items()}
        _add(self.acc, cv, cv.mix(p, parts))
        self.m = m_new

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
