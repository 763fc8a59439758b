"""The agent's conversation state: token history plus the KV cache that holds its prefix.

Seam for StateTrans/PhaseSwap: `open_state` is the one place that picks the backing. Until
`Runtime.session` lands, MemoryState keeps one growing KV cache per agent (only new tokens are ever
prefilled), forks by copying cache references, shares system-prompt prefixes between agents of one
Runtime through a small prefix pool, and checkpoints to JUSTFIT_HOME/agents/NAME (FORMAT.md).
"""

import contextlib
import copy
import json
import os
import time
import weakref
from pathlib import Path
from typing import List, Optional

from .decode import decode, prefill

VERSION = 1
POOL_SIZE = 2
_POOL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def copy_cache(cache: list) -> list:
    """A cache that shares the parent's K/V and grows on its own: KVExec paged caches fork their
    block table (pages shared, copy-on-write); mlx-lm caches share arrays (MLX arrays are immutable;
    `state` hands back fresh array objects, so in-place writes never reach the parent)."""
    try:
        from justfit.kvexec import fork_caches, sequence_of

        sequence_of(cache)
        return fork_caches(cache)
    except (ImportError, StopIteration):
        pass
    out = []
    for c in cache:
        c2 = copy.copy(c)
        c2.state = c.state
        out.append(c2)
    return out


def trim_cache(cache: list, n: int) -> bool:
    """Drop the last n tokens of every layer; False when a layer cannot trim."""
    if n == 0:
        return True
    if not all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
        return False
    for c in cache:
        c.trim(n)
    return True


class MemoryState:
    """Token history + one KV cache; `cached` counts the leading tokens already in the cache."""

    def __init__(self, runtime, name: Optional[str] = None):
        self.rt = runtime
        self.name = name
        self.tokens: List[int] = []
        self.text = ""
        self.cache = None
        self.cached = 0
        self.extra: dict = {}
        self.shared = False  # this history's first prompt is in the prefix pool

    # -- history -----------------------------------------------------------------------------
    def sync(self, text: str) -> None:
        """Make the history equal to `text`: append only the new suffix when the old text is its
        prefix, else keep the longest common token prefix and re-tokenize the rest."""
        tok = self.rt.tokenizer
        if self.tokens and text.startswith(self.text):
            self.tokens = self.tokens + list(tok.encode(text[len(self.text):], add_special_tokens=False))
        else:
            new = list(tok.encode(text, add_special_tokens=False))
            keep = common_prefix(self.tokens, new)
            self._rewind(keep)
            self.tokens = new
        self.text = text
        if self.cache is None or self.cached == 0:
            self._borrow_prefix()

    def _rewind(self, keep: int) -> None:
        if self.cached > keep and not trim_cache(self.cache, self.cached - keep):
            self.cache, self.cached = None, 0
        self.cached = min(self.cached, keep)

    def _borrow_prefix(self) -> None:
        """Start from the longest prefix another agent of this Runtime already computed."""
        best, best_n = None, 0
        for toks, cache in _POOL.get(self.rt, []):
            n = min(common_prefix(toks, self.tokens), len(self.tokens) - 1)
            if n > best_n:
                best, best_n = (toks, cache), n
        if best is not None:
            self.cache = copy_cache(best[1])
            trim_cache(self.cache, len(best[0]) - best_n)
            self.cached = best_n

    def _share_prefix(self) -> None:
        pool = _POOL.setdefault(self.rt, [])
        pool.append((list(self.tokens[: self.cached]), copy_cache(self.cache)))
        del pool[:-POOL_SIZE]
        self.shared = True

    def append_generated(self, tokens: List[int]) -> None:
        """Record generated tokens (the cache already holds all but the last one)."""
        self.tokens = self.tokens + tokens
        self.text += self.rt.tokenizer.decode(tokens)

    # -- model -------------------------------------------------------------------------------
    def step(self, max_tokens: int, eos: set, temperature: float = 0.0, top_p: float = 1.0,
             constraint=None, seed: Optional[int] = None):
        """Prefill what the cache lacks, then decode; yields tokens, leaves stats in self.stats."""
        import mlx.core as mx

        if self.cache is None:
            self.cache = self.rt.make_cache()
        if seed is not None:
            mx.random.seed(seed)
        if self.cached >= len(self.tokens):  # nothing new: recompute the last token for its logits
            self._rewind(len(self.tokens) - 1)
            if self.cache is None:
                self.cache = self.rt.make_cache()
        stats = {"prompt_tokens": len(self.tokens), "reused_tokens": self.cached,
                 "prefilled_tokens": len(self.tokens) - self.cached}
        self.stats = stats
        start = time.perf_counter()
        _phase(self.rt, "prefill")
        logits = prefill(self.rt.model, self.cache, self.tokens[self.cached:])
        self.cached = len(self.tokens)
        stats["prefill_s"] = time.perf_counter() - start
        _phase(self.rt, "decode")
        if not self.shared:
            self._share_prefix()
        generated = []
        for t in decode(self.rt.model, self.cache, logits, max_tokens=max_tokens, eos=eos,
                        temperature=temperature, top_p=top_p, constraint=constraint, stats=stats):
            generated.append(t)
            yield t
        _phase(self.rt, "idle")
        stats["ttft_s"] = stats.pop("first_token_at", start) - start
        stats["turn_s"] = time.perf_counter() - start
        self.cached += len(generated) - stats.get("unfed_tokens", 0)  # the rest is fed by the next prefill
        self.append_generated(generated)

    def prefill_pending(self) -> None:
        """Bring the cache up to the history (used before forking sub-agents from this point)."""
        if self.cache is None:
            self.cache = self.rt.make_cache()
        if len(self.tokens) > self.cached:
            _phase(self.rt, "prefill")
            prefill(self.rt.model, self.cache, self.tokens[self.cached:])
            _phase(self.rt, "idle")
            self.cached = len(self.tokens)

    def fork(self, name: Optional[str] = None) -> "MemoryState":
        """A child that starts from this history and cache without recomputing either."""
        child = MemoryState(self.rt, name)
        child.tokens, child.text, child.cached = list(self.tokens), self.text, self.cached
        child.cache = copy_cache(self.cache) if self.cache is not None else None
        return child

    def tool_phase(self):
        """PhaseSwap's tool phase when the Runtime has one (frees model memory while a tool runs)."""
        phase = getattr(self.rt, "tool_phase", None)
        return phase() if callable(phase) else contextlib.nullcontext()

    # -- persistence ---------------------------------------------------------------------------
    def folder(self) -> Path:
        return Path(self.rt.home) / "agents" / self.name

    def checkpoint(self, messages: List[dict]) -> None:
        """Write state.json and cache.safetensors atomically (FORMAT.md)."""
        from mlx_lm.models.cache import save_prompt_cache

        if not self.name:
            return
        d = self.folder()
        d.mkdir(parents=True, exist_ok=True)
        cached = self.cached if self.cache is not None else 0
        if cached:
            tmp = d / "cache.tmp.safetensors"
            save_prompt_cache(str(tmp), self.cache, {"cached_tokens": str(cached)})
            _fsync(tmp)
            os.replace(tmp, d / "cache.safetensors")
        meta = {"format": "justfit-agent-state", "version": VERSION, "model": _model_id(self.rt),
                "tokens": self.tokens, "text": self.text, "cached_tokens": cached, "messages": messages,
                "extra": self.extra}
        tmp = d / "state.json.tmp"
        tmp.write_text(json.dumps(meta, ensure_ascii=False))
        _fsync(tmp)
        os.replace(tmp, d / "state.json")

    def resume(self) -> Optional[List[dict]]:
        """Load a checkpoint: the saved messages, or None when there is none or it is unusable.
        A missing or corrupt cache file keeps the history and recomputes it on the next step."""
        from mlx_lm.models.cache import load_prompt_cache

        path = self.folder() / "state.json"
        try:
            meta = json.loads(path.read_text())
            ok = (meta.get("format") == "justfit-agent-state" and meta.get("version") == VERSION
                  and meta.get("model") == _model_id(self.rt) and isinstance(meta.get("tokens"), list))
        except (OSError, ValueError):
            return None
        if not ok:
            return None
        self.tokens, self.text, self.extra = meta["tokens"], meta["text"], meta.get("extra", {})
        self.cache, self.cached = None, 0
        try:
            cache, info = load_prompt_cache(str(self.folder() / "cache.safetensors"), return_metadata=True)
            n = int(info.get("cached_tokens", -1))
            if n == meta["cached_tokens"] and 0 < n <= len(self.tokens) and cache[0].offset == n:
                self.cache, self.cached = cache, n
        except Exception:  # torn or foreign cache file: history survives, the cache is recomputed
            pass
        return meta["messages"]


class SessionState(MemoryState):
    """MemoryState on a StateTrans session: its pages, manifest and prefix index persist the
    history (resume after restart), and tool phases hand the session to PhaseSwap."""

    def __init__(self, runtime, name: str):
        super().__init__(runtime, name)
        self.session = runtime.session(name)
        self.cache = self.session.cache
        self.tokens = list(self.session.tokens)
        self.cached = self.session.kv_tokens
        self.text = runtime.tokenizer.decode(self.tokens) if self.tokens else ""

    def resume(self) -> Optional[List[dict]]:
        msgs = [{k: v for k, v in m.items() if k != "end"} for m in self.session.messages]
        return msgs or None

    def checkpoint(self, messages: List[dict]) -> None:
        """Hand the history to the session and commit its pages and manifest."""
        s = self.session
        s.tokens = list(self.tokens)
        s.messages = [dict(m, end=len(self.tokens)) for m in messages]
        s.dirty = True
        s.checkpoint()

    def tool_phase(self):
        """The session's tool phase (PhaseSwap checkpoints it, then releases weights and KV)."""
        if callable(getattr(self.session, "tool_phase", None)):
            return self.session.tool_phase()
        if callable(getattr(self.rt, "tool_phase", None)):
            return self.rt.tool_phase(self.session)
        return contextlib.nullcontext()


def _phase(rt, name: str) -> None:
    """Tell PhaseSwap which phase the model is in (it reloads what a tool phase released)."""
    residency = getattr(rt, "phaseswap", None)
    if residency is not None:
        residency.enter(name)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _model_id(rt) -> str:
    """Identifies model + KV layout; a checkpoint of another model is never reused."""
    kv = getattr(rt, "kv", None)
    return f"{getattr(rt.model, 'justfit_path', getattr(rt, 'model_spec', '?'))}|{getattr(kv, 'name', '?')}"


def open_state(runtime, name: Optional[str] = None) -> MemoryState:
    """The state an Agent runs on: a StateTrans session when named and the Runtime has sessions,
    else an in-memory state (which checkpoints to JUSTFIT_HOME/agents/NAME when named)."""
    if name and callable(getattr(runtime, "session", None)):
        return SessionState(runtime, name)
    return MemoryState(runtime, name)
