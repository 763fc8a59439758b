"""Between KVExec pages and the store: page arrays to files, files to lazy page loaders, and the commit
of a checkpoint (new pages, then the manifest, under the store lock)."""

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .lock import acquire
from .manifest import Manifest, write_manifest
from .store import PageFile, PageStore


def to_numpy(a):
    """An MLX array as numpy (bfloat16 travels as its uint16 bits, tagged 'BF16')."""
    import mlx.core as mx
    import numpy as np

    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), "BF16"
    return np.array(a)


def page_tensors(pages) -> Tuple[Dict[str, object], Dict[str, str]]:
    """Named numpy arrays `<layer>.k.<i>` / `<layer>.v.<i>` of one page id across layers, and metadata."""
    out = {}
    for layer, page in enumerate(pages):
        for name, a in page.tensors().items():
            out[f"{layer}.{name}"] = to_numpy(a)
    return out, {"layers": str(len(pages)), "kinds": ",".join(p.kind for p in pages)}


def open_page_tensors(pages, n_tokens: int) -> Tuple[Dict[str, object], Dict[str, str]]:
    """page_tensors of an open (partial, full-precision) page, cut to its first n_tokens positions."""
    out = {}
    for layer, page in enumerate(pages):
        for name, a in page.tensors().items():
            out[f"{layer}.{name}"] = to_numpy(a[:, :n_tokens])
    return out, {"layers": str(len(pages)), "kinds": ",".join(p.kind for p in pages), "tokens": str(n_tokens)}


def page_loaders(pf: PageFile, n_layers: int, pad_to: Optional[int] = None):
    """(kinds, loaders) for Sequence.append_restored: loaders[layer]() reads that layer's arrays from the
    open file on first use (lazy restore, no staging copy); the file closes after the last layer. An open
    page's arrays are padded back to `pad_to` positions (the page size) so it can be written again."""
    import mlx.core as mx

    kinds = pf.meta["kinds"].split(",")
    if int(pf.meta.get("layers", -1)) != n_layers or len(kinds) != n_layers:
        raise ValueError(f"page has {pf.meta.get('layers')} layers, the model {n_layers}")
    counts = _part_counts(pf.names())
    left = [n_layers]

    def part(name):
        arr, tag = pf.read(name)
        x = mx.array(arr)
        x = x.view(mx.bfloat16) if tag == "BF16" else x
        if pad_to is not None and x.shape[1] < pad_to:
            pad = mx.zeros((x.shape[0], pad_to - x.shape[1], *x.shape[2:]), dtype=x.dtype)
            x = mx.concatenate([x, pad], axis=1)
        return x

    def loader(layer):
        def load():
            k = tuple(part(f"{layer}.k.{i}") for i in range(counts.get((str(layer), "k"), 0)))
            v = tuple(part(f"{layer}.v.{i}") for i in range(counts.get((str(layer), "v"), 0)))
            left[0] -= 1
            if left[0] == 0:
                pf.close()
            return k, v

        return load

    return kinds, [loader(i) for i in range(n_layers)]


def _part_counts(names) -> Dict[Tuple[str, str], int]:
    """(layer, 'k' or 'v') -> how many parts `<layer>.<k|v>.<i>` the page holds, in one pass over names."""
    out: Dict[Tuple[str, str], int] = {}
    for n in names:
        layer, kv, i = (n.split(".") + ["", ""])[:3]
        if kv in ("k", "v") and i.isdigit():
            out[layer, kv] = out.get((layer, kv), 0) + 1
    return out


def commit(store: PageStore, home: Path, manifest: Manifest, new_pages: List[Tuple[str, dict, dict]],
           checksums: Dict[str, str], keep=None) -> int:
    """Write pages not yet on disk, then the manifest, under the store lock; evict over the disk cap and
    the session quota (least recently used other sessions, quota.py).
    `checksums` maps block hash -> file sha256 and is updated. Returns bytes written."""
    written = 0
    with store.lock():
        for h, tensors, meta in new_pages:
            sha, n = store.write(h, tensors, meta)
            checksums[h] = sha
            written += n
        if manifest is not None:
            acquire(home, manifest.name, count=False)  # a fork's new session: take its lock on first commit
            for i, entry in enumerate(manifest.pages):
                sha = entry.get("sha256") or checksums.get(entry["hash"]) or store.valid_sha256(entry["hash"])
                if sha is None:  # evicted by another process meanwhile: later pages are recomputed on restore
                    del manifest.pages[i:]
                    break
                entry["sha256"] = checksums[entry["hash"]] = sha
            write_manifest(home, manifest)
            written += len(manifest.to_bytes())
        if store.disk_cap is not None:
            store.evict(store.disk_cap, keep or ())
        if manifest is not None and store.sessions_cap is not None:
            from .quota import evict_sessions

            evict_sessions(home, store.sessions_cap, keep=[manifest.name], live=store)
    return written
