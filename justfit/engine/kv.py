"""The engine's KV manager: attaches and releases requests' paged caches and keeps the one running byte
count the budget is checked against.

The count is every page in the pool (running sequences' and cached prefixes') plus what decode keeps only
for speed: the batched decode stacks, each sequence's decode memo, and a lone sequence's float window.
Speed copies are the first thing dropped when memory is short; then cold cached prefixes; then the
scheduler preempts. Caches come from the runtime's `make_cache`, prefixes from the prefix index
(statetrans), which also receives the pages a request sealed.
"""

from typing import Callable, List, Optional

from ..errors import MemoryBudgetError
from .kvbytes import KVBytes


class KVManager:
    """Pages and bytes of the engine's requests under one budget (None: no budget, no arithmetic)."""

    def __init__(self, model, make_cache: Callable[[], list], index=None, kv=None, budget_bytes: Optional[int] = None,
                 consensus=None):
        self.make_cache, self.index, self.kv, self.budget_bytes = make_cache, index, kv, budget_bytes
        self.consensus = consensus  # the engine's Consensus: under mlx.launch rank 0's budget answers stand
        self.kv_bytes = KVBytes(model, kv) if kv is not None else None  # None: no KV arithmetic (0 bytes)
        self.page_size = index.page_size if index is not None else None
        self.pool = index.pool if index is not None else None  # set from the first cache otherwise
        self.stacks: dict = {}  # batched decode: stacked sealed pages reused across steps (kvexec/batch.py)
        self.attached: List = []  # the requests whose caches are attached (their speed copies count)

    # -- a request's caches --------------------------------------------------------------------------
    def check(self, n_tokens: int):
        """Refuse one request that could never fit the budget, before it is queued."""
        need = self.worst_bytes(n_tokens)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise MemoryBudgetError(f"one request of {n_tokens} tokens needs {need} bytes of KV, "
                                    f"more than the budget of {self.budget_bytes}")

    def attach(self, r) -> int:
        """Give r its caches: the caller's own as they are (holding r.reused tokens), else fresh ones with
        the longest indexed prefix of its feed attached. Returns how many tokens they hold."""
        self.attached.append(r)
        if r.given is not None:
            r.caches = r.given
            return r.reused
        r.caches = self.make_cache()
        seq = r.caches[0].seq
        self.pool = seq.pool
        return self.index.extend(seq, r.feed, limit=len(r.feed) - 1) if self.index is not None else 0

    def detach(self, r):
        """Take r's caches back without publishing anything (it did not run); the caller's stay theirs."""
        if r.given is None:
            r.caches[0].seq.release()
        r.caches = None
        self.attached.remove(r)

    def release(self, r, publish: bool = True):
        """r is finished: publish what it computed for reuse (unless cancelled) and release its sequence;
        caller-owned caches are the caller's to publish and keep."""
        if r in self.attached:
            self.attached.remove(r)
        if not self.attached:
            self.stacks.clear()  # nothing decodes now: give the stacked copies back
        if r.caches is not None and r.given is None:
            seq = r.caches[0].seq
            if publish and self.index is not None:
                self.index.publish(seq, r.feed[:r.cached])
            seq.release()
        r.caches = None

    def preempt(self, r):
        """Checkpoint r's sealed pages through the index (and to disk when the index persists), then release
        its sequence; the speed copies go too, since memory is short."""
        from ..statetrans.checkpoint import commit

        seq = r.caches[0].seq
        if self.index is not None:
            published = self.index.publish(seq, r.feed[:r.cached])
            if self.index.persist:
                try:
                    commit(self.index.store, self.index.home, None, self.index.new_pages(published),
                           self.index.checksums)
                except OSError:
                    pass  # stays in memory only; if evicted there, its tokens are recomputed
        seq.release()
        r.caches = None
        self.attached.remove(r)
        self.drop_copies()
        if self.index is not None and self.budget_bytes is not None:
            self.index.evict_memory(self.budget_bytes // 2)

    def publish_sealed(self, r, before: int):
        """Index pages r sealed since it held `before` tokens, so followers attach them now."""
        if self.index is None or r.caches is None:
            return
        P = r.caches[0].seq.page_size
        if before // P < r.cached // P:
            self.index.publish(r.caches[0].seq, r.feed[:r.cached // P * P])  # sealed pages only

    def reserve(self, plan: List[tuple]):
        """Make room in every layer's page table for the rows the plan writes, before the pass."""
        for r, n in plan:
            seq = getattr(r.caches[0], "seq", None)  # a caller's mlx-lm caches grow by themselves
            if seq is not None:
                seq.reserve(r.cached + n)

    def batched(self, requests):
        """Switch requests' caches to batched serving (kvexec/cache.py for_batch): no float window, 16-bit open
        pages (capacity). A request admitted alone keeps single-sequence mode, as fast as `justfit chat`'s
        path, until a second one runs beside it."""
        self._batched([c for r in requests if r.caches for c in r.caches])

    @staticmethod
    def _batched(caches):
        from ..kvexec import PagedKVCache

        for c in caches:
            if isinstance(c, PagedKVCache) and not c.batched:
                c.for_batch()

    # -- bytes ---------------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """The running count: every page in the pool plus the speed copies decode keeps between steps."""
        from ..kvexec.batch import memo_nbytes

        pool = self.pool.nbytes if self.pool is not None else 0
        solo = sum(c.window_nbytes for c in self._solo_caches())
        return pool + memo_nbytes(self.stacks) + sum(c.memo.nbytes for c in self._memo_caches()) + solo

    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.used_bytes() > self.budget_bytes

    def _memo_caches(self):
        """Attached layer caches that hold a decode memo (stacked pages, or the CPU kernel's page list)."""
        return [c for r in self.attached if r.caches for c in r.caches
                if getattr(c, "memo", None) and (c.memo.runs or c.memo.table is not None)]

    def _solo_caches(self):
        """Layer caches of a lone sequence still in single-sequence mode (float window, float32 open page)."""
        return [c for r in self.attached if r.caches for c in r.caches if getattr(c, "batched", True) is False]

    def drop_copies(self, need: int = 0):
        """Free what is only a speed cache, cheapest to rebuild first: stacked sealed pages and decode memos
        (the next step rebuilds what it reads); then, if `need` more bytes still pass the budget, a lone
        sequence's float window (it runs batched from here on)."""
        self.stacks.clear()
        for c in self._memo_caches():
            c.drop_memo()
        if self.budget_bytes is not None and self.used_bytes() + need > self.budget_bytes:
            self._batched(self._solo_caches())

    def fits(self, need: int) -> bool:
        """True when `need` more bytes fit the budget, after dropping what is only a speed cache (stacked page
        copies) and cold cached prefixes, in that order (the answer agreed with the other ranks, if any)."""
        if self.budget_bytes is None:
            return True
        fits = self._fits(need)
        return bool(self.consensus.agree(int(fits))) if self.consensus is not None else fits

    def _fits(self, need: int) -> bool:
        if self.used_bytes() + need <= self.budget_bytes:
            return True
        self.drop_copies(need)  # speed copies go first: one step rebuilds them
        if self.used_bytes() + need <= self.budget_bytes:
            return True
        if self.index is not None:  # cold cached prefixes next
            self.index.evict_memory(max(0, self.budget_bytes - need))
        return self.used_bytes() + need <= self.budget_bytes

    def grow_bytes(self, cached: int, n: int) -> int:
        """Bytes a sequence holding `cached` tokens grows by when n more are written."""
        return self.kv_bytes.grow(cached, n) if self.kv_bytes is not None else 0

    def reclaim(self, need: int):
        """PhaseSwap asks for `need` bytes: give back speed copies, then cold cached prefixes, as far as they
        go (pages a request holds stay)."""
        self.drop_copies(need)
        if self.index is not None:
            self.index.evict_memory(max(0, self.used_bytes() - need))

    def seq_bytes(self, n_tokens: int) -> int:
        """KV bytes of a sequence of n_tokens."""
        return self.kv_bytes.seq(n_tokens) if self.kv_bytes is not None else 0

    def worst_bytes(self, n_tokens: int) -> int:
        """KV bytes one request of n_tokens can reach."""
        return self.kv_bytes.worst(n_tokens) if self.kv_bytes is not None else 0

    def memo(self, plan: List[tuple]) -> tuple:
        """(the stacked sealed pages to keep between steps, or None and none kept; whether they may hold 4-bit
        pages dequantized): the stacks are a speed cache, one more copy of the decoders' sealed pages, each
        padded to the longest decoder's, so the budget counts them. Float32 copies of every sealed page when
        the budget holds them, else copies in the stored format (16-bit floats widened: at most 2x stored)."""
        from ..kvexec.batch import drop_decoded

        if self.budget_bytes is None or self.kv_bytes is None:
            return self.stacks, True
        P = self.kv.page_size
        decoders = [r for r, n in plan if n == 1]  # rows batched decode reads through the stacks
        longest = max(((r.cached + 1) // P * P for r in decoders), default=0)  # sealed pages during the pass
        floats = len(decoders) * (longest // P) * 2 * self.kv_bytes.open  # float32: twice a 16-bit page
        stored = 2 * len(decoders) * self.kv_bytes.seq(longest)
        if self.pool.nbytes + floats <= self.budget_bytes:
            return self.stacks, True
        if self.pool.nbytes + stored <= self.budget_bytes:
            drop_decoded(self.stacks)  # float copies out now, before stored-format ones come in
            return self.stacks, False
        self.drop_copies()
        return None, False
