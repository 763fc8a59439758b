"""Page pool and block tables: where a model's KV lives, page by page, shareable between sequences.

A `PagePool` hands out page ids that are valid in every layer at once (one id = one page_size-token slot
of K and V in all layers), so reserving room for an append is atomic across layers: either every page
needed is allocated or none is. Each (layer, page id) holds a `Page` record. Ids are reference-counted.

A `Sequence` is one block table over a pool: the list of page ids in token order plus each layer's
token count. The per-layer `PagedKVCache` objects of one sequence share it.

API for StateTrans (sharing, checkpoints, restore):
- `seq.fork()` -> a new Sequence sharing every page (refcount + 1, no copy). The first write to a
  shared page (the partial last page) copies its records for all layers first (copy-on-write,
  `seq.writable(index)`); sealed pages are never written, so they stay shared forever.
- `seq.sealed_pages()` -> [(index, page_id, [Page per layer])] for every page that is full and sealed in
  all layers; `page.tensors()` gives its named arrays (see FORMAT.md) to hash and write to disk.
- `seq.append_restored(loaders)` -> appends one sealed page whose per-layer tensors are produced by
  `loaders[layer]()` on first use (lazy restore); `Page.from_tensors(kind, dict)` rebuilds a record.
- `seq.release()` drops the sequence's references; pages free when no sequence holds them.
"""

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

from ..errors import MemoryBudgetError

OPEN, FULL, QUANT = "open", "fp", "q"  # page kinds: being filled (float), sealed float, sealed quantized


@dataclass
class Page:
    """One layer's K and V for one page id: tuples of arrays (codec parts), or a loader for lazy restore."""

    kind: str
    k: Optional[tuple] = None
    v: Optional[tuple] = None
    loader: Optional[Callable] = None

    def parts(self):
        """(k parts, v parts), loading them on first use when the page was restored lazily."""
        if self.k is None and self.loader is not None:
            self.k, self.v = self.loader()
            self.loader = None
        return self.k, self.v

    def tensors(self) -> Dict[str, object]:
        """Named arrays for checkpointing: k.0, k.1, ... v.0, ... (FORMAT.md names each part per format)."""
        k, v = self.parts()
        out = {f"k.{i}": a for i, a in enumerate(k)}
        out.update({f"v.{i}": a for i, a in enumerate(v)})
        return out

    @classmethod
    def from_tensors(cls, kind: str, tensors: Dict[str, object]) -> "Page":
        """Inverse of tensors()."""
        k = tuple(tensors[f"k.{i}"] for i in range(sum(n.startswith("k.") for n in tensors)))
        v = tuple(tensors[f"v.{i}"] for i in range(sum(n.startswith("v.") for n in tensors)))
        return cls(kind, k, v)

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


class PagePool:
    """Page ids shared by all layers, per-layer Page records, reference counts, optional capacity."""

    def __init__(self, n_layers: int, page_size: int = 256, max_pages: Optional[int] = None):
        self.n_layers, self.page_size, self.max_pages = n_layers, page_size, max_pages
        self.records: List[Dict[int, Page]] = [{} for _ in range(n_layers)]
        self.refs: Dict[int, int] = {}
        self._free: List[int] = []
        self._next = 0

    def alloc(self, n: int) -> List[int]:
        """n fresh page ids, all or none: raises MemoryBudgetError (and allocates nothing) when full."""
        if self.max_pages is not None and len(self.refs) + n > self.max_pages:
            raise MemoryBudgetError(
                f"KV page pool is full: {len(self.refs)} of {self.max_pages} pages in use, {n} more needed"
            )
        ids = []
        for _ in range(n):
            pid = self._free.pop() if self._free else self._take_next()
            self.refs[pid] = 1
            ids.append(pid)
        return ids

    def _take_next(self) -> int:
        self._next += 1
        return self._next - 1

    def retain(self, ids):
        for pid in ids:
            self.refs[pid] += 1

    def release(self, ids):
        """Drop one reference per id; an id with none left loses its records in every layer."""
        for pid in ids:
            self.refs[pid] -= 1
            if self.refs[pid] == 0:
                del self.refs[pid]
                for layer in self.records:
                    layer.pop(pid, None)
                self._free.append(pid)

    @property
    def free_ids(self) -> int:
        """Released page ids waiting for reuse (a metric; alloc takes them first)."""
        return len(self._free)

    def get(self, layer: int, pid: int) -> Optional[Page]:
        return self.records[layer].get(pid)

    def put(self, layer: int, pid: int, page: Page):
        self.records[layer][pid] = page

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for layer in self.records for p in layer.values())


class Sequence:
    """A block table (page ids in token order) over a PagePool plus each layer's token count."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.table: List[int] = []
        self.lengths = [0] * pool.n_layers

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def reserve(self, n_tokens: int):
        """Make room for n_tokens in every layer; on failure nothing changes (MemoryBudgetError)."""
        need = self.pages_for(n_tokens) - len(self.table)
        if need > 0:
            self.table.extend(self.pool.alloc(need))

    def set_length(self, layer: int, n_tokens: int):
        """Record a layer's new token count and free pages no layer needs any more (after a trim)."""
        self.lengths[layer] = n_tokens
        keep = self.pages_for(max(self.lengths))
        if keep < len(self.table):
            dropped, self.table = self.table[keep:], self.table[:keep]
            self.pool.release(dropped)

    def writable(self, index: int) -> int:
        """The page id at `index`, first copied (records of all layers) if another sequence shares it."""
        pid = self.table[index]
        if self.pool.refs[pid] == 1:
            return pid
        (new,) = self.pool.alloc(1)
        for layer in range(self.pool.n_layers):
            page = self.pool.get(layer, pid)
            if page is not None:
                page.parts()  # load a lazily restored page once, so both copies share its arrays
                self.pool.put(layer, new, replace(page))
        self.pool.release([pid])
        self.table[index] = new
        return new

    def fork(self) -> "Sequence":
        """A new sequence sharing every page of this one (copy-on-write for the partial last page)."""
        child = Sequence(self.pool)
        child.table, child.lengths = list(self.table), list(self.lengths)
        self.pool.retain(child.table)
        return child

    def sealed_pages(self):
        """[(index, page id, [Page per layer])] for pages that are full and sealed in every layer."""
        out = []
        for index in range(min(self.lengths) // self.page_size):
            pid = self.table[index]
            pages = [self.pool.get(layer, pid) for layer in range(self.pool.n_layers)]
            if all(p is not None and p.kind != OPEN for p in pages):
                out.append((index, pid, pages))
        return out

    def append_restored(self, kinds: List[str], loaders: List[Callable], n_tokens: Optional[int] = None):
        """Append one page restored from disk (sealed, or an open page holding n_tokens < page_size);
        loaders[layer]() -> (k parts, v parts) on first use."""
        if any(n != self.lengths[0] or n % self.page_size for n in self.lengths):
            raise ValueError("restored pages can only be appended at a page boundary reached by every layer")
        (pid,) = self.pool.alloc(1)
        for layer, (kind, load) in enumerate(zip(kinds, loaders)):
            self.pool.put(layer, pid, Page(kind, loader=load))
        self.table.append(pid)
        self.lengths = [n + (n_tokens or self.page_size) for n in self.lengths]
        return pid

    def release(self):
        """Drop this sequence's references to all its pages."""
        self.pool.release(self.table)
        self.table, self.lengths = [], [0] * self.pool.n_layers
