"""What an engine needs from the processes that run it together, and the one-process answer.

Under `mlx.launch` every rank runs the same engine over its own shard of the model, and their model passes
must line up collective for collective. Three of the engine's answers are each rank's own: whether bytes
fit the KV budget (a rank counts its shard), how many prefill rows a decoding step carries (from step
times a rank measures) and the tokens (a shard's logits can differ in their last bits); and the calls from
outside (submit, cancel, step, settle) reach rank 0 only. So the engine's parts ask a `Consensus` at those points:
alone, every answer stands and nothing is announced; distributed/mirror.py plugs in a peer that announces
rank 0's calls to the other ranks and makes rank 0's answers every rank's.
"""

from typing import Optional


class Alone:
    """One process: its own answers stand; no call is announced."""

    def submitting(self, options: dict, caches, sampling) -> Optional[dict]:
        """Before a submission is made (may refuse it, may fix its seed in `options`): what to announce."""
        return None

    def submitted(self, request, announced: Optional[dict]):
        """A submission was queued."""

    def cancelling(self, request):
        """A running or queued request is about to be cancelled."""

    def stepping(self, engine):
        """A step is about to run."""

    def settling(self, engine):
        """Finished turns are about to be fed into their caller-owned caches, outside a step."""

    def failed(self, error: BaseException):
        """A step raised (a lost rank, under mlx.launch)."""

    def agree(self, value: int) -> int:
        return value

    def agree_tokens(self, greedy):
        return greedy


class Consensus:
    """The engine's one handle on how its answers are agreed, shared by its parts (the KV manager, the
    chunk sizer, the runner): alone until `use(peer)` plugs in another (distributed/mirror.py)."""

    def __init__(self):
        self.peer = Alone()

    def use(self, peer):
        self.peer = peer

    def submitting(self, options: dict, caches, sampling) -> Optional[dict]:
        return self.peer.submitting(options, caches, sampling)

    def submitted(self, request, announced: Optional[dict]):
        self.peer.submitted(request, announced)

    def cancelling(self, request):
        self.peer.cancelling(request)

    def stepping(self, engine):
        self.peer.stepping(engine)

    def settling(self, engine):
        self.peer.settling(engine)

    def failed(self, error: BaseException):
        self.peer.failed(error)

    def agree(self, value: int) -> int:
        """This process's int, or the one every process agreed on."""
        return self.peer.agree(value)

    def agree_tokens(self, greedy):
        """A pass's argmax array, or the one every process agreed on (lazily, in the pass's own graph)."""
        return self.peer.agree_tokens(greedy)
