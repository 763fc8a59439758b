"""Session: a named, persisted conversation whose KV lives in shared pages and survives restarts.

Each turn appends tokens (the chat template's rendering of the new messages, then the reply) to the
session's token ids; only tokens not already in its pages (or in the prefix index) are prefilled. At the
end of every turn, and every `checkpoint_every` tokens of a long prefill, sealed pages not yet on disk
are written and the manifest is committed. Restore reattaches pages lazily; what cannot be restored is
recomputed from the token ids.
"""

import time
from typing import Iterator, List, Optional

from ..errors import UserError
from .checkpoint import commit
from .lock import acquire as acquire_lock  # issue 15
from .lock import release as release_lock  # issue 15
from .manifest import Manifest, check_name, manifest_path, read_manifest, warn
from .store import StoreWriteError

CHECKPOINT_EVERY = 2048


class Session:
    """One named history over the runtime's shared page pool (see the module docstring)."""

    def __init__(self, rt, name: str, tokens=(), messages=(), cache=None, parent: Optional[str] = None,
                 created: Optional[float] = None, checkpoint_every: Optional[int] = CHECKPOINT_EVERY):
        from ..kvexec import sequence_of

        self.rt, self.name = rt, check_name(name)
        self.index = rt.prefix_index()
        self.cache = cache if cache is not None else rt.make_cache()
        self.seq = sequence_of(self.cache)
        self.tokens: List[int] = list(tokens)
        self.messages: List[dict] = [dict(m) for m in messages]
        self.parent, self.created = parent, created or time.time()
        self.checkpoint_every = checkpoint_every
        self.persist, self.closed, self.dirty = True, False, False
        self.last_stats: dict = {}
        self.restore_s = 0.0

    # -- open / restore -------------------------------------------------------------------------
    @classmethod
    def open(cls, rt, name: str, checkpoint_every: Optional[int] = CHECKPOINT_EVERY) -> "Session":
        """Resume the named session from its manifest, or start it empty."""
        check_name(name)
        acquire_lock(rt.home, name)  # issue 15: one writer process per session (statetrans/lock.py)
        try:
            return cls._open(rt, name, checkpoint_every)
        except BaseException:
            release_lock(rt.home, name)
            raise

    @classmethod
    def _open(cls, rt, name: str, checkpoint_every: Optional[int]) -> "Session":
        from ..models.vocab import vocab_size

        start = time.perf_counter()
        m = read_manifest(rt.home, name, vocab_size(rt.model))  # issue 15: S.prev.json fallback, ids checked
        if m is None:
            return cls(rt, name, checkpoint_every=checkpoint_every)
        index = rt.prefix_index()
        _check_compatible(m, index, name)
        s = cls(rt, name, m.tokens, m.messages, parent=m.parent, created=m.created,
                checkpoint_every=checkpoint_every)
        hashes = index.hashes(m.tokens)
        sums = [p.get("sha256") if p.get("hash") == hashes[i] else None for i, p in enumerate(m.pages)]
        index.extend(s.seq, m.tokens, checksums=sums, label=f"session {name!r}")
        s.restore_s = time.perf_counter() - start
        return s

    @property
    def kv_tokens(self) -> int:
        """How many of the session's tokens have their K/V in the cache."""
        return min(self.seq.lengths)

    # -- turns ----------------------------------------------------------------------------------
    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
                 top_p: float = 1.0):
        """Append a turn (text = one user message, a message list, or raw token ids) and the reply."""
        from ..runtime import Generation

        chunks = list(self.stream(prompt, max_tokens, temperature, seed, top_p))
        tokens = [c.token for c in chunks if c.token >= 0]
        return Generation("".join(c.text for c in chunks), tokens, dict(self.last_stats))

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
               top_p: float = 1.0) -> Iterator:
        """Like Runtime.stream, on this session's history; stats land in self.last_stats."""
        self._check_open()
        start = time.perf_counter()
        delta, new_msgs = self._delta(prompt)
        if not delta:
            raise UserError("nothing to generate from: the new turn renders to no tokens")
        self.tokens += delta
        self.dirty = True
        for m in new_msgs:
            m["end"] = len(self.tokens)
        reused = self.index.extend(self.seq, self.tokens, limit=len(self.tokens) - 1,
                                   label=f"session {self.name!r}")
        ckpt_s, written = self._long_prefill()
        texts, out, first = [], [], None
        try:
            for chunk in self.rt.stream_tokens(self.tokens, self.cache, max_tokens, temperature, seed, top_p,
                                               reused_tokens=self.kv_tokens):
                first = first or time.perf_counter()
                texts.append(chunk.text)
                if chunk.token >= 0:
                    out.append(chunk.token)
                yield chunk
        finally:
            stats = dict(self.rt.last_stats)
            self._end_turn(new_msgs, out, "".join(texts))
            c = self.checkpoint(auto=True)
            stats.update(reused_tokens=reused, checkpoint_s=ckpt_s + c["checkpoint_s"],
                         disk_bytes_written=written + c["disk_bytes_written"], history_tokens=len(self.tokens),
                         turn_s=time.perf_counter() - start)
            if first is not None:
                stats["ttft_s"] = first - start
            self.last_stats = stats

    def _delta(self, prompt):
        """(new token ids, new messages) for a turn; raw token ids pass through unchanged."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt), []
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            msgs = [{"role": m["role"], "content": m.get("content", "")} for m in prompt]
        else:
            raise UserError("prompt must be a string, a list of {'role', 'content'} messages or token ids")
        before, after = self._render(self.messages, False), self._render(self.messages + msgs, True)
        text = after[len(before):] if after.startswith(before) else self._render(msgs, True)
        return self._encode(text), msgs

    def _render(self, messages, generation_prompt: bool) -> str:
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        tok = self.rt.tokenizer
        if not msgs:
            return ""
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)
        return "\n".join(m["content"] for m in msgs) + ("\n" if generation_prompt else "")

    def _encode(self, text: str) -> List[int]:
        tok = self.rt.tokenizer
        if getattr(tok, "chat_template", None):
            return list(tok.encode(text, add_special_tokens=False))
        return list(tok.encode(text, add_special_tokens=not self.tokens))

    def _long_prefill(self):
        """Prefill all but the last chunk in `checkpoint_every`-token steps, checkpointing pages after each
        step (a crash mid-prefill keeps the work done); returns (seconds checkpointing, bytes written)."""
        import mlx.core as mx

        step, spent, written = self.checkpoint_every, 0.0, 0
        while step and len(self.tokens) - self.kv_tokens > step:
            at = self.kv_tokens
            self.rt.model(mx.array(self.tokens[at:at + step])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            c = self.checkpoint(auto=True, manifest=False)
            spent, written = spent + c["checkpoint_s"], written + c["disk_bytes_written"]
        return spent, written

    def _end_turn(self, new_msgs, reply: List[int], text: str):
        """Record the reply, drop K/V of tokens not in the history (an EOS fed by the sampler), and append
        the template's closing tokens (prefilled with the next turn)."""
        self.tokens += reply
        self._trim_kv(len(self.tokens))
        if not new_msgs:
            return
        head = self._render(self.messages + new_msgs, True)
        self.messages += new_msgs + [{"role": "assistant", "content": text, "end": len(self.tokens)}]
        full = self._render(self.messages, False)
        if full.startswith(head + text):
            self.tokens += self._encode(full[len(head) + len(text):])
            self.messages[-1]["end"] = len(self.tokens)

    def _trim_kv(self, n: int):
        for c in self.cache:
            if c.offset > n:
                c.trim(c.offset - n)

    def prefill(self):
        """Bring the K/V up to every token of the history now (restore does this lazily otherwise) and
        load every lazily restored page."""
        import mlx.core as mx

        self._check_open()
        if len(self.tokens) > self.kv_tokens:
            self.index.extend(self.seq, self.tokens, label=f"session {self.name!r}")
        while len(self.tokens) > self.kv_tokens:
            at = self.kv_tokens
            self.rt.model(mx.array(self.tokens[at:at + 2048])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        mx.eval([c.state for c in self.cache])

    # -- history edits --------------------------------------------------------------------------
    def rewind(self, n_tokens: int):
        """Drop the last n tokens of the history (and their K/V; shared pages are copied on write)."""
        self._check_open()
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(self.tokens):
            raise UserError(f"rewind needs 0..{len(self.tokens)} tokens, not {n_tokens!r}")
        keep = len(self.tokens) - n_tokens
        self.tokens, self.dirty = self.tokens[:keep], True
        self._trim_kv(keep)
        self.messages = [m for m in self.messages if m["end"] <= keep]

    def fork(self, child: str) -> "Session":
        """A new session sharing every page of this one without copying (copy-on-write at the partial
        last page); it is committed at once (no page bytes: they are the parent's)."""
        from ..kvexec import fork_caches

        self._check_open()
        check_name(child)
        if child == self.name or manifest_path(self.rt.home, child).exists():
            raise UserError(f"session {child!r} already exists; fork into a new name")
        s = Session(self.rt, child, self.tokens, self.messages, cache=fork_caches(self.cache),
                    parent=self.name, checkpoint_every=self.checkpoint_every)
        s.persist = self.persist
        s.checkpoint(auto=True)
        return s

    # -- persistence ----------------------------------------------------------------------------
    def checkpoint(self, auto: bool = False, manifest: bool = True) -> dict:
        """Write sealed pages not yet on disk and commit the manifest; {'checkpoint_s',
        'disk_bytes_written'}. A store that cannot be written: UserError (auto: one warning, and the
        session continues in memory)."""
        start = time.perf_counter()
        published = self.index.publish(self.seq, self.tokens)
        if not self.persist and auto:
            return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": 0}
        try:
            new = self.index.new_pages(published)
            m = self._manifest(published) if manifest else None
            written = commit(self.index.store, self.rt.home, m, new, self.index.checksums,
                             keep=self.index.live_pages)
        except (StoreWriteError, OSError) as e:
            err = e if isinstance(e, StoreWriteError) else StoreWriteError(
                f"cannot write the session store at {self.rt.home}: {e}; the session continues in memory")
            if not auto:
                raise err from None
            if self.persist:
                warn(f"session {self.name!r}: {err}")
            self.persist = False
            return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": 0}
        self.persist, self.dirty = True, self.dirty and not manifest
        return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": written}

    def _manifest(self, published) -> Manifest:
        fps = self.index.fingerprints
        pages = [{"hash": h, "sha256": self.index.checksums.get(h)} for _, h, _ in published]
        return Manifest(self.name, fps["model"], fps["tokenizer"], dict(self.index.kv), list(self.tokens),
                        pages, [dict(m) for m in self.messages], model=str(self.rt.model_spec),
                        parent=self.parent, created=self.created)

    def tool_phase(self):
        """`with s.tool_phase():` checkpoints this session, then PhaseSwap releases the weights while a
        tool runs; the next generate brings them back just in time."""
        from ..phaseswap.toolphase import tool_phase

        return tool_phase(self.rt, self)

    def suspend(self) -> int:
        """Checkpoint and release the weights until the next generate; bytes released."""
        from ..phaseswap.toolphase import suspend

        return suspend(self.rt, self)

    def close(self):
        """Checkpoint and release this session's pages (the prefix index may keep them in memory)."""
        if self.closed:
            return
        if self.dirty:
            self.checkpoint(auto=True)
        self.seq.release()
        self.closed = True
        release_lock(self.rt.home, self.name)  # issue 15

    def _check_open(self):
        if self.closed:
            raise UserError(f"session {self.name!r} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_compatible(m: Manifest, index, name: str):
    """Refuse a manifest written for another model, tokenizer or KV format, saying which."""
    fps = index.fingerprints
    if m.model_fingerprint != fps["model"]:
        raise UserError(f"session {name!r} was made with another model ({m.model or m.model_fingerprint}, "
                        f"fingerprint {m.model_fingerprint}; this one is {fps['model']}); "
                        "resume it with that model or use another session name")
    if m.tokenizer_fingerprint != fps["tokenizer"]:
        raise UserError(f"session {name!r} was made with another tokenizer (fingerprint "
                        f"{m.tokenizer_fingerprint}; this one is {fps['tokenizer']}); refusing to restore")
    if m.kv != index.kv:
        theirs, ours = m.kv.get("name", "?"), index.kv["name"]
        raise UserError(f"session {name!r} was saved with KV format {theirs} (page size "
                        f"{m.kv.get('page_size')}), this runtime uses {ours} (page size {index.kv['page_size']}); "
                        "pass the same --kv-bits/--kv-format or use another session name")
