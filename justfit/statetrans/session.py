"""Session: a named, persisted conversation whose KV lives in shared pages and survives restarts.

Each turn appends tokens (the chat template's rendering of the new messages, then the reply) to the
session's token ids; only tokens not already in its pages (or in the prefix index) are prefilled, by the
runtime's one generation path. At the end of every turn, and every `checkpoint_every` tokens of a long
prefill, sealed pages not yet on disk are written; the open last page is written too (full precision)
and the manifest is committed, so a restart re-prefills no old token. Restore reattaches pages lazily;
what cannot be restored is recomputed from the token ids.

The runtime is passed in and used through its methods (encode renderer, prefill, stream_tokens,
tool_phase); sessions never import it.
"""

import itertools
import time
from typing import Iterator, List, Optional

from ..errors import UserError
from ..kvexec import Page
from ..models.chat import chat_text, encode_text
from ..models.vocab import check_token_ids, vocab_size
from ..turns import Generation, Turn, TurnStats
from .checkpoint import commit, open_page_tensors, page_loaders
from .index import common_prefix
from .lock import acquire as acquire_lock
from .lock import release as release_lock
from .manifest import Manifest, check_name, manifest_path, read_manifest, warn
from .store import CorruptPage, StoreWriteError

CHECKPOINT_EVERY = 2048
_ephemeral = itertools.count()


class Session:
    """One history over the runtime's shared page pool (see the module docstring). A session made with
    `persist=False` (agents' unnamed conversations) shares pages the same way but writes nothing."""

    def __init__(self, rt, name: Optional[str], tokens=(), messages=(), cache=None, parent: Optional[str] = None,
                 created: Optional[float] = None, checkpoint_every: Optional[int] = CHECKPOINT_EVERY,
                 persist: bool = True):
        from ..kvexec import sequence_of

        self.rt = rt
        self.name = check_name(name) if persist else (name or f"ephemeral-{next(_ephemeral)}")
        self.index = rt.index
        self.cache = cache if cache is not None else rt.make_cache(resident=False)
        self.seq = sequence_of(self.cache)
        self.tokens: List[int] = list(tokens)
        self.messages: List[dict] = [dict(m) for m in messages]
        self.parent, self.created = parent, created or time.time()
        self.checkpoint_every = checkpoint_every
        self.persist, self.closed, self.dirty = persist, False, False
        self.writable = True  # False after the store failed once: auto checkpoints stay in memory
        self.last_stats = TurnStats()
        self.running = None  # the engine request of the turn in progress (one at a time)
        self.restore_s = 0.0
        self.commit = 0  # the manifest commit number this history was read or last written as
        self.kv_name = f"kv:session:{self.name}" if persist else None
        if self.kv_name:
            rt.register_kv(self.kv_name, self.cache, self.resident_bytes, self.release_pages, lambda: not self.dirty)

    # -- open / restore -------------------------------------------------------------------------
    @classmethod
    def open(cls, rt, name: str, checkpoint_every: Optional[int] = CHECKPOINT_EVERY) -> "Session":
        """Resume the named session from its manifest, or start it empty."""
        check_name(name)
        acquire_lock(rt.home, name)  # one writer process per session (statetrans/lock.py)
        try:
            return cls._open(rt, name, checkpoint_every)
        except BaseException:
            release_lock(rt.home, name)
            raise

    @classmethod
    def _open(cls, rt, name: str, checkpoint_every: Optional[int]) -> "Session":
        start = time.perf_counter()
        m = read_manifest(rt.home, name, vocab_size(rt.model))  # S.prev.json fallback, ids checked
        if m is None:
            return cls(rt, name, checkpoint_every=checkpoint_every)
        index = rt.index
        _check_compatible(m, index, name)
        s = cls(rt, name, m.tokens, m.messages, parent=m.parent, created=m.created,
                checkpoint_every=checkpoint_every)
        s.commit = m.commit
        hashes = index.hashes(m.tokens)
        sums = [p.get("sha256") if p.get("hash") == hashes[i] else None for i, p in enumerate(m.pages)]
        index.extend(s.seq, m.tokens, checksums=sums, label=f"session {name!r}")
        s._restore_open_page(m.open_page)
        s.restore_s = time.perf_counter() - start
        return s

    def _restore_open_page(self, entry: Optional[dict]):
        """Attach the checkpointed open page when every page before it was restored and it matches."""
        P, n = self.index.page_size, len(self.seq.table)
        if not entry or self.kv_tokens != n * P or entry.get("hash") is None:
            return
        m = int(entry.get("tokens", 0))
        if not 0 < m < P or len(self.tokens) < n * P + m:
            return
        from .hashing import partial_hash

        if partial_hash(self.tokens[:n * P + m], P, self.index.salt) != entry["hash"]:
            return
        try:
            pf = self.index.store.open(entry["hash"], entry.get("sha256"))
            kinds, loaders = page_loaders(pf, self.index.pool.n_layers, pad_to=P)
        except (CorruptPage, ValueError, KeyError, OSError) as e:
            warn(f"session {self.name!r}: the open page is unusable ({e}); recomputing {m} tokens")
            return
        self.seq.append_restored(kinds, loaders, n_tokens=m)

    def resident_bytes(self) -> int:
        """Bytes of this session's pages held in memory now (lazily restored pages count once loaded)."""
        pool, mine = self.seq.pool, set(self.seq.table)
        return sum(p.nbytes for layer in pool.records for pid, p in layer.items() if pid in mine)

    def release_pages(self) -> int:
        """Swap this session's pages that are safe in the store for lazy loaders, freeing their memory
        (PhaseSwap's tool phase calls this after a checkpoint); they reload on first use. Bytes freed."""
        before, P = self.resident_bytes(), self.index.page_size
        hashes = self.index.hashes(self.tokens[:self.kv_tokens])
        swaps = [(pid, hashes[i], None) for i, pid in enumerate(self.seq.table[:len(hashes)])]
        op = self.index.open_page(self.seq, self.tokens)
        if op is not None:
            swaps.append((self.seq.table[self.kv_tokens // P], op[0], P))
        for pid, h, pad in swaps:
            if not self.index.store.has(h):
                continue
            try:
                kinds, loaders = page_loaders(self.index.store.open(h, self.index.checksums.get(h)),
                                              self.index.pool.n_layers, pad_to=pad)
            except (CorruptPage, ValueError, KeyError, OSError):
                continue  # keep it in memory
            for layer, (kind, load) in enumerate(zip(kinds, loaders)):
                self.index.pool.put(layer, pid, Page(kind, loader=load))
        return before - self.resident_bytes()

    @property
    def kv_tokens(self) -> int:
        """How many of the session's tokens have their K/V in the cache."""
        return min(self.seq.lengths)

    # -- turns ----------------------------------------------------------------------------------
    def generate(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
                 top_p: float = 1.0, **options) -> Generation:
        """Append a turn (text = one user message, a message list, or raw token ids) and the reply."""
        turn = self.stream(prompt, max_tokens, temperature, seed, top_p, **options)
        chunks = list(turn)
        return Generation("".join(c.text for c in chunks), [c.token for c in chunks if c.token >= 0], turn.stats)

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
               top_p: float = 1.0, **options) -> Turn:
        """Like Runtime.stream, on this session's history (same options); the Turn's stats are this turn's
        (also in self.last_stats once it ends)."""
        stats = TurnStats()
        return Turn(self._stream(prompt, max_tokens, temperature, seed, top_p, stats, options), stats)

    def _stream(self, prompt, max_tokens, temperature, seed, top_p, stats: TurnStats, options) -> Iterator:
        req = self.submit(prompt, max_tokens, temperature, seed, top_p, stats=stats, **options)
        try:
            for chunk in req:  # (not `yield from`: closing this turn cancels the request, see Runtime._turn)
                yield chunk
        finally:
            if not req.done:
                req.cancel()  # stopped early: what was emitted stays in the history and its K/V
            else:  # left at (or after) the last chunk: the turn goes in now, so the next one is not refused
                req.engine.settle()

    def submit(self, prompt, max_tokens: int = 256, temperature: float = 0.0, seed: Optional[int] = None,
               top_p: float = 1.0, stats: Optional[TurnStats] = None, **options):
        """Queue a turn on this session's own caches as a request of the runtime's engine core and return
        it: iterate it (steps the engine) or let a front step it beside others. When it finishes the
        session records the reply (and the template's closing tokens) and checkpoints; one turn at a time."""
        self._check_open()
        if self.running is not None:
            raise UserError(f"session {self.name!r} already has a turn running; one turn at a time")
        start = time.perf_counter()
        delta, new_msgs = self._delta(prompt)
        if not delta:
            raise UserError("nothing to generate from: the new turn renders to no tokens")
        progress = options.pop("progress", None)
        stats = stats if stats is not None else TurnStats()
        before = len(self.tokens)
        self.tokens += delta
        self.dirty = True
        for m in new_msgs:
            m["end"] = len(self.tokens)
        try:
            reused = self.index.extend(self.seq, self.tokens, limit=len(self.tokens) - 1,
                                       label=f"session {self.name!r}")
            ckpt_s, written = self._long_prefill(progress)
            turn = {"prompt": list(self.tokens), "msgs": new_msgs, "reused": reused, "checkpoint_s": ckpt_s,
                    "written": written, "start": start}
            self.running = self.rt.submit_turn(self.tokens, self.cache, max_tokens, self.kv_tokens, stats, progress,
                                               on_done=lambda req: self._turn_done(req, turn),
                                               temperature=temperature, top_p=top_p, seed=seed, **options)
        except BaseException:  # refused or interrupted before it ran: the history is as it was (pages
            self.tokens = self.tokens[:before]  # checkpointed by a long prefill stay in the store for a retry)
            self._trim_kv(before)
            raise
        return self.running

    def _turn_done(self, req, turn: dict):
        """The engine finished this session's turn and its caches hold it: record and checkpoint."""
        self.running = None
        eos = set(self.rt.tokenizer.eos_token_ids)
        fed = req.held()
        self._end_turn(turn["prompt"], fed, [t for t in fed if t not in eos], turn["msgs"], "".join(req.text))
        c = self.checkpoint(auto=True)
        stats, prompt_tokens = req.stats, turn["prompt"]
        stats.reused_tokens, stats.prefilled_tokens = turn["reused"], len(prompt_tokens) - turn["reused"]
        stats.checkpoint_s = turn["checkpoint_s"] + c["checkpoint_s"]
        stats.disk_bytes_written = turn["written"] + c["disk_bytes_written"]
        stats.history_tokens, stats.restore_s = len(self.tokens), self.restore_s
        if req.token_times:  # from submission: restore and long-prefill checkpoints count too
            stats.ttft_s = req.token_times[0] - turn["start"]
        stats.turn_s = time.perf_counter() - turn["start"]
        self.restore_s = 0.0
        self.last_stats = stats

    def _delta(self, prompt):
        """(new token ids, new messages) for a turn; raw token ids pass through unchanged."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return check_token_ids(list(prompt), vocab_size(self.rt.model)), []  # refused before it joins
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
            msgs = [{"role": m["role"], "content": m.get("content", "")} for m in prompt]
        else:
            raise UserError("prompt must be a string, a list of {'role', 'content'} messages or token ids")
        tok = self.rt.tokenizer
        before = chat_text(tok, self.messages, False)
        after = chat_text(tok, self.messages + msgs, True)
        text = after[len(before):] if after.startswith(before) else chat_text(tok, msgs, True)
        return encode_text(tok, text, first=not self.tokens), msgs

    def _long_prefill(self, progress=None):
        """Prefill all but the last token in `checkpoint_every`-token chunks, checkpointing pages after each
        chunk (a crash mid-prefill keeps the work done); returns (seconds checkpointing, bytes written)."""
        todo = len(self.tokens) - 1 - self.kv_tokens
        if not self.checkpoint_every or todo <= self.checkpoint_every:
            return 0.0, 0
        spent = [0.0, 0]

        def save():
            c = self.checkpoint(auto=True, manifest=False)
            spent[0] += c["checkpoint_s"]
            spent[1] += c["disk_bytes_written"]

        self.rt.prefill(self.tokens[self.kv_tokens:-1], self.cache, progress, after_chunk=save,
                        step=self.checkpoint_every)
        return spent[0], spent[1]

    def _end_turn(self, prompt_tokens: List[int], fed: List[int], reply: List[int], new_msgs, text: str):
        """Record the reply and the template's closing tokens (prefilled with the next turn), keeping the
        K/V of every fed token that is also in the history (an end-of-turn id usually is)."""
        self.tokens += reply
        if new_msgs:
            tok = self.rt.tokenizer
            head = chat_text(tok, self.messages + new_msgs, True)
            self.messages += new_msgs + [{"role": "assistant", "content": text, "end": len(self.tokens)}]
            full = chat_text(tok, self.messages, False)
            if full.startswith(head + text):
                self.tokens += encode_text(tok, full[len(head) + len(text):], first=False)
                self.messages[-1]["end"] = len(self.tokens)
        self._trim_kv(common_prefix(prompt_tokens + fed, self.tokens))

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
        if len(self.tokens) > self.kv_tokens:
            self.rt.prefill(self.tokens[self.kv_tokens:], self.cache)
        mx.eval([c.state for c in self.cache])

    # -- history edits --------------------------------------------------------------------------
    def append(self, tokens: List[int]):
        """Append raw token ids to the history without generating (their K/V come with the next turn or
        prefill())."""
        self._check_open()
        check_token_ids(list(tokens), vocab_size(self.rt.model))
        self.tokens += list(tokens)
        self.dirty = True

    def set_persist(self, on: bool):
        """Write this named session to disk at its checkpoints (on), or keep it in memory only (off), e.g.
        a server keeps a prompt_cache_key session on disk only when the client asked for retention."""
        self.persist = bool(on) and self.kv_name is not None

    def set_messages(self, messages: List[dict]):
        """Replace the recorded chat messages (a front that renders its own prompts, like an agent loop,
        keeps them here so a resumed session can show and continue them)."""
        self.messages = [dict(m, end=min(m.get("end", len(self.tokens)), len(self.tokens))) for m in messages]
        self.dirty = True

    def rewind(self, n_tokens: int):
        """Drop the last n tokens of the history (and their K/V; shared pages are copied on write)."""
        self._check_open()
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= len(self.tokens):
            raise UserError(f"rewind needs 0..{len(self.tokens)} tokens, not {n_tokens!r}")
        keep = len(self.tokens) - n_tokens
        self.tokens, self.dirty = self.tokens[:keep], True
        self._trim_kv(keep)
        self.messages = [m for m in self.messages if m["end"] <= keep]

    def fork(self, child: Optional[str] = None) -> "Session":
        """A new session sharing every page of this one without copying (copy-on-write at the partial
        last page); a named child of a persisted session is committed at once (no page bytes: they are
        the parent's), child=None gives an in-memory one."""
        from ..kvexec import fork_caches

        self._check_open()
        persist = self.persist and child is not None
        if persist:
            check_name(child)
            if child == self.name or manifest_path(self.rt.home, child).exists():
                raise UserError(f"session {child!r} already exists; fork into a new name")
        s = Session(self.rt, child, self.tokens, self.messages, cache=fork_caches(self.cache),
                    parent=self.name, checkpoint_every=self.checkpoint_every, persist=persist)
        s.checkpoint(auto=True)
        return s

    # -- persistence ----------------------------------------------------------------------------
    def checkpoint(self, auto: bool = False, manifest: bool = True) -> dict:
        """Write sealed pages and the open page not yet on disk and commit the manifest; {'checkpoint_s',
        'disk_bytes_written'}. A store that cannot be written: UserError (auto: one warning, and the
        session continues in memory). A session made with persist=False only indexes its pages."""
        start = time.perf_counter()
        published = self.index.publish(self.seq, self.tokens)
        if not self.persist or (auto and not self.writable):
            return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": 0}
        try:
            new = self.index.new_pages(published)
            open_entry = self._open_page(new) if manifest else None
            m = self._manifest(published, open_entry) if manifest else None
            written = commit(self.index.store, self.rt.home, m, new, self.index.checksums,
                             keep=self.index.live_pages)
            self.commit = m.commit if m is not None else self.commit
        except (StoreWriteError, OSError) as e:
            err = e if isinstance(e, StoreWriteError) else StoreWriteError(
                f"cannot write the session store at {self.rt.home}: {e}; the session continues in memory")
            if not auto:
                raise err from None
            if self.writable:
                warn(f"session {self.name!r}: {err}")
            self.writable = False
            return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": 0}
        self.writable, self.dirty = True, self.dirty and not manifest
        return {"checkpoint_s": time.perf_counter() - start, "disk_bytes_written": written}

    def _open_page(self, new: list) -> Optional[dict]:
        """The manifest entry of the open last page; its tensors join `new` when the store lacks them."""
        op = self.index.open_page(self.seq, self.tokens)
        if op is None:
            return None
        h, m, pages = op
        if not self.index.store.has_valid(h):
            new.append((h, *open_page_tensors(pages, m)))
        return {"hash": h, "tokens": m}

    def _manifest(self, published, open_entry: Optional[dict]) -> Manifest:
        fps = self.index.fingerprints
        pages = [{"hash": h, "sha256": self.index.checksums.get(h)} for _, h, _ in published]
        if open_entry is not None:
            open_entry["sha256"] = self.index.checksums.get(open_entry["hash"])
        return Manifest(self.name, fps["model"], fps["tokenizer"], dict(self.index.kv), list(self.tokens),
                        pages, [dict(m) for m in self.messages], open_page=open_entry,
                        model=str(self.rt.model_spec), parent=self.parent, created=self.created,
                        commit=self.commit)

    def tool_phase(self):
        """`with s.tool_phase():` checkpoints this session, then PhaseSwap releases the weights and its
        pages while a tool runs; the next generate brings them back just in time."""
        return self.rt.tool_phase(self)

    def close(self):
        """Checkpoint and release this session's pages (the prefix index may keep them in memory)."""
        if self.closed:
            return
        if self.dirty:
            self.checkpoint(auto=True)
        self.seq.release()
        if self.kv_name:
            self.rt.unregister_kv(self.kv_name)
        self.closed = True
        release_lock(self.rt.home, self.name)

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
