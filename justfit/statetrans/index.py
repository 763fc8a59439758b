"""Prefix index: the longest cached prefix of a token list, from memory (pool pages) or disk (store).

Keys are chained block hashes (hashing.py), so a hit on page i means the same tokens [0, (i+1)P) under
the same model, tokenizer and KV format. The memory tier keeps one pool reference per indexed page, so a
page outlives the sequence that computed it; LRU eviction drops only pages no sequence holds, those
already on disk first. Misses in memory fall through to the store, whose pages restore lazily.

Reuse is token-exact: the memory tier also knows the tokens of each page it holds, under the hash of
the pages before it, and remembers recent open (partial, full precision) last pages the same way. A
prompt gets every matching sealed page shared, then the one page that matches most of what follows
attached up to its last matching token; the sequence copies that page on its first write
(copy-on-write, a quantized page comes back dequantized), so at most one page is copied.
"""

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .checkpoint import page_loaders, page_tensors
from .hashing import block_hashes, kv_format, model_fingerprint, partial_hash, salt, tokenizer_fingerprint
from .manifest import list_manifests, warn
from .store import CorruptPage, PageStore

MEMORY_CAP = int(os.environ.get("JUSTFIT_PREFIX_MEMORY_BYTES", 1 << 30))
OPEN_PER_PREFIX = 4  # remembered open pages that continue the same sealed prefix
DISK_CAP = int(os.environ.get("JUSTFIT_STORE_DISK_BYTES", 8 << 30))
_READERS = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="justfit-pages")


class PrefixIndex:
    """Block hash -> page id over one shared PagePool, backed by one model's PageStore."""

    def __init__(self, pool, store: PageStore, home: Path, fingerprints: dict, kv: dict,
                 memory_cap: Optional[int] = MEMORY_CAP):
        self.pool, self.store, self.home = pool, store, Path(home)
        self.fingerprints, self.kv = fingerprints, kv
        self.salt = salt(fingerprints["model"], fingerprints["tokenizer"], kv)
        self.page_size = pool.page_size
        self.memory_cap = memory_cap
        self.persist = True  # False after the store could not be written: pages stay in memory only
        self.mem: "OrderedDict[str, int]" = OrderedDict()
        self.checksums: Dict[str, str] = {}  # block hash -> sha256 of its file on disk
        # hash of the sealed pages before an open page -> [(its tokens, page id)], most recent last
        self.open: "OrderedDict[str, List[Tuple[Tuple[int, ...], int]]]" = OrderedDict()
        # hash of the pages before a sealed page -> {its block hash: its tokens}
        self.sealed_tokens: Dict[str, Dict[str, Tuple[int, ...]]] = {}

    def chain(self, tokens) -> str:
        """Hash of the full pages of `tokens` (the salt when there are none)."""
        hs = self.hashes(tokens[:len(tokens) // self.page_size * self.page_size])
        return hs[-1] if hs else self.salt

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
        hashes = self.hashes(tokens, n, prev)
        sums = [checksums[i] if checksums and i < len(checksums) else None for i in range(n, n + len(hashes))]
        opened = self._open_ahead(hashes, sums)
        try:
            for i, h in enumerate(hashes, start=n):
                if not self._attach(seq, h, sums[i - n], label, i, len(tokens) // P, opened.pop(h, None)):
                    break
        finally:
            for f in opened.values():  # pages past a failed one: verified for nothing, closed
                if not f.exception():
                    f.result().close()
        self._attach_partial(seq, tokens)
        return min(seq.lengths)

    def _open_ahead(self, hashes, sums) -> dict:
        """Verify the store pages a walk will need, several at once (hashing releases the GIL): block
        hash -> future of store.open. Pages in memory or not on disk are left to the walk."""
        todo = [(h, sha) for h, sha in zip(hashes, sums)
                if not (h in self.mem and self.mem[h] in self.pool.refs) and self.store.has(h)]
        if len(todo) < 2:
            return {}
        return {h: _READERS.submit(self.store.open, h, sha) for h, sha in todo}

    def _attach_partial(self, seq, tokens):
        """Attach the remembered page (open or sealed) that shares the most tokens with what follows
        seq's pages, up to the last shared token."""
        P, n = self.page_size, len(seq.table)
        if any(x != n * P for x in seq.lengths):
            return
        rest = tuple(tokens[n * P:(n + 1) * P])
        if not rest:
            return
        prev = self.chain(tokens[:n * P])
        entries = list(self.open.get(prev, []))
        entries += [(t, self.mem[h]) for h, t in self.sealed_tokens.get(prev, {}).items() if h in self.mem]
        best, pid = max(((common_prefix(t, rest), pid) for t, pid in entries if pid in self.pool.refs),
                        default=(0, None))
        if best:
            self.pool.retain([pid])
            seq.table.append(pid)
            seq.lengths = [n * P + best] * len(seq.lengths)

    def _attach(self, seq, h: str, sha: Optional[str], label: str, i: int, total: int, opening=None) -> bool:
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
            pf = opening.result() if opening is not None else self.store.open(h, sha)
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
                known = self.sealed_tokens.setdefault(hashes[index - 1] if index else self.salt, {})
                for old in [k for k in known if k not in self.mem]:
                    del known[old]
                known[h] = tuple(tokens[index * P:(index + 1) * P])
            out.append((index, h, pages))
        self._remember_open(seq, tokens)
        self.evict_memory()
        return out

    def _remember_open(self, seq, tokens):
        """Remember seq's open last page (token-exact reuse of the tokens since its last sealed page)."""
        P, m = self.page_size, min(min(seq.lengths), len(tokens))
        n, tail = m // P, tuple(tokens[m // P * P:m])
        if not tail or len(seq.table) <= n:
            return
        key = self.chain(tokens[:n * P])
        entries = []
        for t, old in self.open.pop(key, []):
            if tail[:len(t)] == t or old not in self.pool.refs:  # the new page holds all the old one did
                if old in self.pool.refs:
                    self.pool.release([old])
            else:
                entries.append((t, old))
        if any(t[:len(tail)] == tail for t, _ in entries):  # an older page already holds all of it
            self.open[key] = entries
            return
        pid = seq.table[n]
        self.pool.retain([pid])
        entries.append((tail, pid))
        for _, old in entries[:-OPEN_PER_PREFIX]:
            self.pool.release([old])
        self.open[key] = entries[-OPEN_PER_PREFIX:]

    def open_page(self, seq, tokens) -> Optional[Tuple[str, int, list]]:
        """(key, valid tokens, [Page per layer]) of seq's open last page, for a checkpoint; None if none."""
        P, m = self.page_size, min(min(seq.lengths), len(tokens))
        if m % P == 0 or len(seq.table) <= m // P:
            return None
        pid = seq.table[m // P]
        pages = [self.pool.get(layer, pid) for layer in range(self.pool.n_layers)]
        if any(p is None for p in pages):
            return None
        return partial_hash(tokens[:m], P, self.salt), m % P, pages

    def _remember(self, h: str, pid: int):
        self.pool.retain([pid])
        old = self.mem.pop(h, None)
        if old is not None and old in self.pool.refs:
            self.pool.release([old])
        self.mem[h] = pid

    def save_pages(self) -> int:
        """Write every sealed page the index holds in memory that the store lacks, so that after a restart
        any prompt finds them by their chain hashes (a server's shutdown under --persist: plain requests'
        prefixes, not only sessions'). Returns bytes written."""
        from .checkpoint import commit

        if not self.persist:
            return 0
        new = []
        for h, pid in list(self.mem.items()):
            if pid not in self.pool.refs or self.store.has(h):
                continue
            pages = [self.pool.get(layer, pid) for layer in range(self.pool.n_layers)]
            if all(p is not None and p.kind != "open" for p in pages):
                new.append((h, *page_tensors(pages)))
        return commit(self.store, self.home, None, new, self.checksums) if new else 0

    def new_pages(self, published) -> List[tuple]:
        """(hash, tensors, metadata) of published pages the store does not have yet."""
        return [(h, *page_tensors(pages)) for _, h, pages in published if not self.store.has_valid(h)]

    # -- budgets --------------------------------------------------------------------------------
    def evict_memory(self, cap: Optional[int] = None):
        """Drop index-only pages (no sequence holds them), LRU, on-disk ones first, until the pool fits."""
        cap = self.memory_cap if cap is None else cap
        if cap is None:
            return
        total = self.pool.nbytes
        if total <= cap:
            return
        for key in list(self.open):  # open pages first: the cheapest to recompute
            for _, pid in self.open.pop(key):
                if pid in self.pool.refs:
                    self.pool.release([pid])
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

    def sequence_refs(self) -> int:
        """Page references held by sequences (sessions, requests), not by this index: 0 when idle."""
        own = len([h for h, pid in self.mem.items() if pid in self.pool.refs])
        own += sum(len(entries) for entries in self.open.values())
        return sum(self.pool.refs.values()) - own

    def live_pages(self) -> set:
        """Block hashes (open pages' too) referenced by any session manifest (disk eviction keeps them)."""
        return {p["hash"] for m in list_manifests(self.home) for p in m.pages + ([m.open_page] if m.open_page else [])}


def common_prefix(a, b, limit: Optional[int] = None) -> int:
    """How many leading items two token lists share, counting at most `limit` of them."""
    n = min(len(a), len(b)) if limit is None else max(0, min(len(a), len(b), limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def make_index(model, tokenizer, kv, home, memory_cap: Optional[int] = MEMORY_CAP,
               disk_cap: Optional[int] = DISK_CAP) -> PrefixIndex:
    """The index a Runtime shares between plain requests and sessions: one page pool, one store."""
    from ..kvexec import PagePool

    n_layers = len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)
    fps = {"model": model_fingerprint(model), "tokenizer": tokenizer_fingerprint(tokenizer)}
    root = Path(home) / "store"
    store = PageStore(root / fps["model"], root / "lock", disk_cap)
    return PrefixIndex(PagePool(n_layers, kv.page_size), store, home, fps, kv_format(kv), memory_cap)
