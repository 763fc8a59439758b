"""Executes a plan: one forward pass over [(request, rows)], lone or batched, and the speculative verify
of a lone greedy request. It decides nothing: the scheduler chose the rows, the core takes the tokens.

A lone decode row runs mlx-lm's single-sequence call on its own caches (the plain token loop, cheaper than
the batched pass, whose decode attention stacks a padded page run every step); anything else runs the
batched pass of kvexec/batch.py over the shared page pool.
"""

from typing import List, Optional

from .speculative import speculate


class Runner:
    """The model and how to run it over requests' caches."""

    def __init__(self, model, kv, residency=None):
        self.model, self.kv, self.residency = model, kv, residency  # kv: the KV manager

    def enter(self, phase: str, **kwargs) -> float:
        """Enter a PhaseSwap phase (weights back just in time); seconds spent reloading."""
        return self.residency.enter(phase, **kwargs) if self.residency is not None else 0.0

    def start(self, plan: List[tuple]) -> tuple:
        """Build and start one forward pass over `plan`: (plan, logits, argmax), evaluating asynchronously.
        Rows count as computed from here on; prompt and recomputed rows count as prefilled."""
        import mlx.core as mx

        ids = [t for r, n in plan for t in r.feed[r.cached:r.cached + n]]
        logits = self.forward(plan, ids)
        for r, n in plan:
            first_time = max(0, r.cached + n - max(len(r.prompt), r.high, r.cached))  # generated ids fed once
            r.stats.prefilled_tokens += n - first_time
            r.computed(n)
        greedy = mx.argmax(logits, axis=-1)  # every plain greedy row's token, in the same evaluation
        mx.async_eval(logits, greedy, *[c.state for r, _ in plan if r.left for c in r.caches])
        return plan, logits, greedy

    def queue(self, nxt: List[tuple], greedy) -> tuple:
        """Build the next decode-only pass on this pass's argmax before it is read (as mlx-lm's generate loop
        does): building the graph overlaps the computation. Rows are counted when the pass is taken."""
        import mlx.core as mx

        self.kv.reserve([(r, 1) for r, _ in nxt])
        logits = self.forward(nxt, greedy)
        greedy = mx.argmax(logits, axis=-1)
        mx.async_eval(logits, greedy)
        return nxt, logits, greedy

    @staticmethod
    def computes_while_built(plan: List[tuple]) -> bool:
        """The CPU kernel serves this pass: it evaluates as the pass is built, so queueing the next one
        early would only publish this step's tokens a step late."""
        from ..kvexec import kernel_serves

        return kernel_serves([r.caches[0] for r, _ in plan])

    def forward(self, plan: List[tuple], ids):
        """Logits [len(plan), vocab] at each request's last row; ids: a list, or the last step's argmax array."""
        import mlx.core as mx

        from ..kvexec.batch import BatchPlan, forward

        if len(plan) == 1 and plan[0][1] == 1:
            logits = self.model(mx.array(ids).reshape(1, 1), cache=plan[0][0].caches)[:, -1]
            if self.kv.over_budget():
                self.kv.drop_copies()  # its decode memo does not fit beside the pages: workspace of this step only
            return logits
        return forward(self.model, BatchPlan([(r.caches, n) for r, n in plan], *self.kv.memo(plan)), ids)

    def pick(self, r, logits, greedy: int) -> int:
        """r's next token from its row's logits; `greedy` (the row's argmax) is used as is when nothing
        rewrites the logits."""
        if not r.chooser.rewrites:
            return greedy
        return int(r.chooser.pick(logits[None], r.feed, len(r.feed))[0])

    def speculate(self, r, drafter, gate, eos) -> Optional[tuple]:
        """Draft after r's pending token and verify the drafts in one pass over r's own pages (rejected drafts
        are trimmed from those pages, nothing moves): (tokens now in the cache, next pending token or None)
        or None when no pass ran."""
        room = r.max_tokens - len(r.out)
        if room < 1 or not self.kv.fits(self.kv.grow_bytes(r.cached, min(room, 8) + 1)):
            return None
        h = drafter.hist
        if h and len(h) <= len(r.feed) and r.feed[:len(h)] == h:
            drafter.extend(r.feed[len(h):])
        else:
            drafter.reset(list(r.feed))
        res = speculate(self.model, r.caches, r.feed[-1], drafter, gate, room, eos, r.counts, self.enter)
        if res is None:
            return None
        out, pending, r.force_plain = res
        start = r.cached
        r.computed(len(out))
        self.kv.publish_sealed(r, start)
        return out, pending
