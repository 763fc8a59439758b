"""KV of a cache list as a component: spill to a scratch safetensors file, restore just in time.

For callers without a StateTrans session (a bare `rt.make_cache()` list), unloading writes every
page (KVExec `PagedKVCache`) or the keys/values (mlx-lm `KVCache`) to `<home>/spill/<name>.safetensors`
and drops them from memory; loading reads them back bit for bit. KVExec pages are replaced by lazy
loaders, so even a forward pass that skips `Residency.enter` restores them on first use.
StateTrans sessions register their own KV component instead (their pages are checkpointed already).
"""

import os
from pathlib import Path

from .components import Component


def _paged(caches):
    from ..kvexec import PagedKVCache

    return [c for c in caches if isinstance(c, PagedKVCache)]


def _kv_bytes(caches) -> int:
    total, seen = 0, set()
    for c in caches:
        if hasattr(c, "seq"):
            key = id(c.seq)
            if key in seen:
                continue
            seen.add(key)
            total += sum(p.nbytes for layer in c.seq.pool.records for pid, p in layer.items() if pid in c.seq.table)
        elif getattr(c, "keys", None) is not None:
            total += c.nbytes
    return total


def spillable(caches) -> bool:
    """True when every layer cache is a KVExec paged cache or a plain mlx-lm KVCache."""
    from mlx_lm.models.cache import KVCache

    return all(type(c) is KVCache for c in caches) or len(_paged(caches)) == len(caches)


def cache_component(name: str, caches, folder: Path) -> Component:
    """A `kv` component that spills `caches` to folder/<name>.safetensors and restores them."""
    import mlx.core as mx

    path = Path(folder) / f"{name.replace('/', '_').replace(':', '_')}.safetensors"
    state = {"spilled": False}

    def unload():
        tensors, meta = {}, {}
        if _paged(caches):
            seq = caches[0].seq
            for layer, records in enumerate(seq.pool.records):
                for pid in seq.table:
                    page = records.get(pid)
                    if page is None:
                        continue
                    meta[f"{layer}.{pid}"] = page.kind
                    for k, a in page.tensors().items():
                        tensors[f"{layer}.{pid}.{k}"] = a
        else:
            for i, c in enumerate(caches):
                if c.keys is not None:
                    k, v = c.state
                    tensors[f"{i}.k"], tensors[f"{i}.v"] = k, v
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path), tensors, metadata=meta)
        _drop(caches, meta, path)
        state["spilled"] = True

    def load():
        if not state["spilled"]:
            return
        if _paged(caches):
            seq = caches[0].seq
            for records in seq.pool.records:  # parts() runs each page's loader
                for pid in seq.table:
                    if pid in records:
                        records[pid].parts()
        else:
            tensors = mx.load(str(path))
            for i, c in enumerate(caches):
                if f"{i}.k" in tensors:
                    c.state = (tensors[f"{i}.k"], tensors[f"{i}.v"])
            mx.eval([c.state for c in caches if c.keys is not None])
        os.unlink(path)
        state["spilled"] = False

    return Component(name, "kv", lambda: 0 if state["spilled"] else _kv_bytes(caches), load, unload,
                     roles=("kv",), releasable=spillable(caches), checkpointed=lambda: state["spilled"])


def _drop(caches, meta, path):
    """Replace in-memory KV by lazy loaders (paged) or nothing (mlx-lm KVCache keeps its offset)."""
    from ..kvexec import Page

    if _paged(caches):
        seq = caches[0].seq
        for key, kind in meta.items():
            layer, pid = (int(x) for x in key.split("."))
            seq.pool.put(layer, pid, Page(kind, loader=_page_loader(path, key)))
        for c in caches:
            c.drop_memo()  # its stacked copies of the spilled pages would keep them in memory
    else:
        for c in caches:
            c.keys = c.values = None


def _page_loader(path, key):
    def load():
        import mlx.core as mx

        tensors = mx.load(str(path))
        names = {n[len(key) + 1:]: a for n, a in tensors.items() if n.startswith(key + ".")}
        k = tuple(names[f"k.{i}"] for i in range(sum(n.startswith("k.") for n in names)))
        v = tuple(names[f"v.{i}"] for i in range(sum(n.startswith("v.") for n in names)))
        mx.eval(list(k) + list(v))
        return k, v

    return load
