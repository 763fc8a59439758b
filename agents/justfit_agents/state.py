"""An agent's conversation state: a StateTrans session of the runtime, used through its public API.

A named agent opens `rt.session(name)` (pages + manifest persist; it resumes after a restart); an
unnamed one gets an in-memory session (`rt.session(None)`). Either way its K/V lives in the runtime's
shared page pool: prompts shared with other agents come from the prefix index, forks share pages
copy-free, tool phases hand the session to PhaseSwap, and `close()` gives the pages back.
"""

from typing import Iterator, List, Optional


class AgentState:
    """Token history of one agent, kept in sync with the text its loop renders."""

    def __init__(self, runtime, name: Optional[str] = None, session=None):
        self.rt, self.name = runtime, name
        self.session = session if session is not None else runtime.session(name)
        self.pending: List[int] = []  # rendered tokens not yet in the session's history
        self.text = runtime.tokenizer.decode(self.session.tokens) if self.session.tokens else ""
        self.stats = None
        self._reply_from = 0  # where the reply of the submitted turn starts in the history

    @property
    def tokens(self) -> List[int]:
        return self.session.tokens + self.pending

    @property
    def cached(self) -> int:
        """Leading tokens whose K/V the session holds."""
        return self.session.kv_tokens

    def sync(self, text: str) -> None:
        """Make the history equal to `text`: when the old text is its prefix only the new suffix is
        tokenized (generated ids stay as generated); else keep the longest common token prefix."""
        encode = self.rt.tokenizer.encode
        if self.text and text.startswith(self.text):
            self.pending += list(encode(text[len(self.text):], add_special_tokens=False))
        else:
            new = list(encode(text, add_special_tokens=False))
            old = self.session.tokens
            keep = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            if keep < len(old):
                self.session.rewind(len(old) - keep)
            self.pending = new[keep:]
        self.text = text

    def step(self, max_tokens: int, eos: set, temperature: float = 0.0, top_p: float = 1.0,
             constraint=None, seed: Optional[int] = None) -> Iterator[int]:
        """Append the pending tokens and generate the reply (the runtime's one generation path)."""
        delta = self._take_pending()
        before = len(self.session.tokens) + len(delta)
        for chunk in self.session.stream(delta, max_tokens, temperature, seed, top_p, constraint=constraint):
            if chunk.token >= 0:
                yield chunk.token
        self.stats = self.session.last_stats
        self.text += self.rt.tokenizer.decode(self.session.tokens[before:])

    def submit(self, max_tokens: int, eos: set, temperature: float = 0.0, top_p: float = 1.0,
               constraint=None, seed: Optional[int] = None):
        """Queue the reply as the session's next turn on the runtime's engine core instead of decoding it
        now (Session.submit: on the session's own caches, recorded by the session when it finishes); several
        agents' requests then run in one batch. Read the finished request with reply()."""
        delta = self._take_pending()
        self._reply_from = len(self.session.tokens) + len(delta)
        return self.session.submit(delta, max_tokens, temperature, seed, top_p, constraint=constraint)

    def reply(self, request):
        """(generated ids, TurnStats) of a finished submit() (the session already holds the turn)."""
        g = request.result()
        self.stats = g.stats
        self.text += self.rt.tokenizer.decode(self.session.tokens[self._reply_from:])
        return list(g.tokens), g.stats

    def _take_pending(self) -> List[int]:
        """The rendered tokens not yet in the history (nothing new: the last token again, regenerated)."""
        if not self.pending:
            self.pending = self.session.tokens[-1:]
            self.session.rewind(1)
            self.text = self.rt.tokenizer.decode(self.session.tokens)
        delta, self.pending = self.pending, []
        return delta

    def prefill_pending(self) -> None:
        """Bring the K/V up to the history (before forking sub-agents from this point)."""
        if self.pending:
            self.session.append(self.pending)
            self.pending = []
        self.session.prefill()

    def fork(self, name: Optional[str] = None) -> "AgentState":
        """A child sharing every page of this history (copy-free); named children persist."""
        return AgentState(self.rt, name, self.session.fork(name))

    def tool_phase(self):
        """PhaseSwap's tool phase for this session: weights and its checkpointed pages are released."""
        return self.session.tool_phase()

    def checkpoint(self, messages: List[dict]) -> None:
        """Record the conversation's messages with the history and commit (named sessions only)."""
        if self.pending:
            self.session.append(self.pending)
            self.pending = []
        self.session.set_messages(messages)
        self.session.checkpoint()

    def resume(self) -> Optional[List[dict]]:
        """The messages of a resumed named session, or None."""
        msgs = [{k: v for k, v in m.items() if k != "end"} for m in self.session.messages]
        return msgs or None

    def close(self) -> None:
        """Checkpoint (named) and give the session's pages back to the pool."""
        self.session.close()
