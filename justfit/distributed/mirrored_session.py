"""Rank 0's handle on a session every rank of an mlx.launch world holds.

A session's turns run on its own caches, and each rank's caches hold its own shard of the pages, so a
session cannot be mirrored as plain engine submissions. Instead every call that changes a session (open,
set_persist, rewind, submit, checkpoint, close) is announced as a session call before rank 0 makes it, and
each rank makes the same call on its own session (mirror.py `Sessions`), under the engine's lock so no step
comes between. The turn a submit queues is bound on the other ranks to rank 0's request id, so a cancel
reaches it. Reads (tokens, name, persist...) are rank 0's own.
"""

from .mirror import to_wire

CHANGES = ("set_persist", "rewind", "checkpoint", "close")


class MirroredSession:
    """A Session on rank 0 whose changes every rank repeats (made by `Leader.session`)."""

    def __init__(self, leader, session):
        self.leader, self.session = leader, session

    def __getattr__(self, name):
        if name in CHANGES:
            return lambda *args, **kwargs: self._call(name, args, kwargs)
        return getattr(self.session, name)

    def _call(self, call: str, args: tuple, kwargs: dict):
        with self.leader.batch_engine().lock:
            self.leader.announce({"op": "session", "name": self.session.name, "call": call, "args": list(args),
                                  "kwargs": kwargs})
            return getattr(self.session, call)(*args, **kwargs)

    def submit(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed=None, top_p: float = 1.0,
               **options):
        """Session.submit on every rank: the sampling options travel as a plain submission's do (an unseeded
        sampled turn gets rank 0's seed)."""
        options = dict(options, temperature=temperature, seed=seed, top_p=top_p)
        wire = to_wire(options, self.leader.grammars)
        engine = self.leader.batch_engine()
        with engine.lock:
            self.leader.announce({"op": "session", "name": self.session.name, "call": "submit",
                                  "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
                                  "max_tokens": max_tokens, "sampling": wire})
            with self.leader.lead.session_turn():
                return self.session.submit(prompt, max_tokens, **options)
