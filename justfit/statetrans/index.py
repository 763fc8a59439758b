"""Prefix index: the longest cached prefix of a token list, from memory (pool pages) or disk (store).

Keys are chained block hashes (hashing.py), so a hit on page i means the same tokens [0, (i+1)P) under
the same model, tokenizer and KV format. The memory tier keeps one pool reference per indexed page, so a
page outlives the sequence that computed it; LRU eviction drops only pages no sequence holds, those
already on disk first. Misses in memory fall through to the store, whose pages restore lazily.
"""

import os
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional

from .checkpoint import page_loaders, page_tensors
from .hashing import block_hashes, kv_format, model_fingerprint, salt, tokenizer_fingerprint
from .manifest import list_manifests, warn
from .store import CorruptPage, PageStore

MEMORY_CAP = int(os.environ.get("JUSTFIT_PREFIX_MEMORY_BYTES", 1 << 30))
DISK_CAP = int(os.environ.get("JUSTFIT_STORE_DISK_BYTES", 8 << 30))


class PrefixIndex:
    """Block hash -> page id over one shared PagePool, backed by one model's PageStore."""

    def __init__(self, pool, store: PageStore, home: Path, fingerprints: dict, kv: dict,
                 memory_cap: Optional[int] = MEMORY_CAP):
        self.pool, self.store, self.home = pool, store, Path(home)
        self.fingerprints, self.kv = fingerprints, kv
        self.salt = salt(fingerprints["model"], fingerprints["tokenizer"], kv)
        self.page_size = pool.page_size
        self.memory_cap = memory_cap
        self.mem: "OrderedDict[str, int]" = OrderedDict()
        self.checksums: Dict[str, str] = {}  # block hash -> sha256 of its file on disk

    @classmethod
    def for_runtime(cls, rt, memory_cap: Optional[int] = MEMORY_CAP, disk_cap: Optional[int] = DISK_CAP):
        """The index a Runtime shares between plain generate calls and sessions."""
        from ..kvexec import PagePool

        n_layers = len(rt.model.make_cache()) if hasattr(rt.model, "make_cache") else len(rt.model.layers)
        fps = {"model": model_fingerprint(rt.model), "tokenizer": tokenizer_fingerprint(rt.tokenizer)}
        root = Path(rt.home) / "store"
        store = PageStore(root / fps["model"], root / "lock", disk_cap)
        return cls(PagePool(n_layers, rt.kv.page_size), store, rt.home, fps, kv_format(rt.kv), memory_cap)

    def hashes(self, tokens, start: int = 0, prev: Optional[str] = None) -> List[str]:
        return block_hashes(tokens, self.page_size, self.salt, start, prev)

    # -- lookup ---------------------------------------------------------------------------------
    def extend(self, seq, tokens, limit: Optional[int] = None, checksums: Optional[List[str]] = None,
               label: str = "prefix") -> int:
        """Append to `seq` (at a page boundary) the cached pages that continue it along `tokens[:limit]`;
        returns how many tokens seq now holds. A corrupt page stops the walk with a one-line warning."""
        P, n = self.page_size, len(seq.table)
        if any(x != n * P for x in seq.lengths):
            return min(seq.lengths)
        tokens = list(tokens[:limit] if limit is not None else tokens)
        prev = self.hashes(tokens[:n * P])[-1] if n else None
        for i, h in enumerate(self.hashes(tokens, n, prev), start=n):
            if not self._attach(seq, h, checksums[i] if checksums and i < len(checksums) else None,
                                label, i, len(tokens) // P):
                break
        return min(seq.lengths)

    def _attach(self, seq, h: str, sha: Optional[str], label: str, i: int, total: int) -> bool:
        P = self.page_size
        pid = self.mem.get(h)
        if pid is not None and pid in self.pool.refs:
            self.mem.move_to_end(h)
            self.pool.retain([pid])
            seq.table.append(pid)
            seq.lengths = [x + P for x in seq.lengths]
            return True
        if not self.store.has(h):
            if sha is not None:
                warn(f"{label}: page {i + 1} of {total} is missing from the store; recomputing "
                     f"{(total - i) * P}+ tokens from token ids")
            return False
        try:
            pf = self.store.open(h, sha)
            kinds, loaders = page_loaders(pf, self.pool.n_layers)
        except (CorruptPage, ValueError, KeyError) as e:
            warn(f"{label}: page {i + 1} of {total} is unusable ({e}); recomputing "
                 f"{(total - i) * P}+ tokens from token ids")
            if not str(e).startswith("missing"):
                self.store.discard(h)
            return False
        self.checksums[h] = pf.sha256
        pid = seq.append_restored(kinds, loaders)
        self._remember(h, pid)
        return True

    # -- publish --------------------------------------------------------------------------------
    def publish(self, seq, tokens) -> List[tuple]:
        """Index the sealed pages of `seq` whose tokens are known; [(index, hash, pages)] for them."""
        P = self.page_size
        n = min(len(tokens), min(seq.lengths)) // P
        hashes = self.hashes(tokens[:n * P])
        out = []
        for index, pid, pages in seq.sealed_pages():
            if index >= n:
                break
            h = hashes[index]
            if h not in self.mem or self.mem[h] not in self.pool.refs:
                self._remember(h, pid)
            out.append((index, h, pages))
        self.evict_memory()
        return out

    def _remember(self, h: str, pid: int):
        self.pool.retain([pid])
        old = self.mem.pop(h, None)
        if old is not None and old in self.pool.refs:
            self.pool.release([old])
        self.mem[h] = pid

    def new_pages(self, published) -> List[tuple]:
        """(hash, tensors, metadata) of published pages the store does not have yet."""
        return [(h, *page_tensors(pages)) for _, h, pages in published if not self.store.has(h)]

    # -- budgets --------------------------------------------------------------------------------
    def evict_memory(self, cap: Optional[int] = None):
        """Drop index-only pages (no sequence holds them), LRU, on-disk ones first, until the pool fits."""
        cap = self.memory_cap if cap is None else cap
        if cap is None:
            return
        total = self.pool.nbytes
        if total <= cap:
            return
        for on_disk in (True, False):
            for h in list(self.mem):
                pid = self.mem[h]
                if self.pool.refs.get(pid) != 1 or self.store.has(h) != on_disk:
                    continue
                total -= sum(layer[pid].nbytes for layer in self.pool.records if pid in layer)
                del self.mem[h]
                self.pool.release([pid])
                if total <= cap:
                    return

    def live_pages(self) -> set:
        """Block hashes referenced by any session manifest (disk eviction keeps them)."""
        return {p["hash"] for m in list_manifests(self.home) for p in m.pages}
