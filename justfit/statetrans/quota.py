"""A disk quota for the session store: least recently used unpinned sessions are removed until it fits.

Usage is every page file of the store (all models) plus every session manifest and its backup. Pages
are content-addressed and shared, so removing a session frees only the pages no remaining manifest
names. What goes first: pages no session names (prefix-cache pages, least recently read first), then
whole sessions, least recently committed first, never a pinned one (`justfit sessions pin`) nor one a
live process has open (its lock is taken, non-blocking, for the removal). No MLX here.
"""

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ..errors import UserError
from .lock import held_if_free
from .manifest import _prev_path, check_name, list_manifests, manifest_path, remove_manifest, sessions_dir
from .store import PageStore

log = logging.getLogger(__name__)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text, what: str = "size") -> int:
    """Bytes from an int or text like '500MB', '2GiB', '1.5g', '0' (UserError otherwise)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise UserError(f"{what} {text!r} is not a size: use bytes or a number with KB, MB, GB, KiB, MiB or GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def pin_path(home: Path, name: str) -> Path:
    return sessions_dir(home) / ".pins" / check_name(name)


def is_pinned(home: Path, name: str) -> bool:
    return pin_path(home, name).exists()


def set_pinned(home: Path, name: str, on: bool):
    """Pin (an empty marker file) or unpin a session: pinned sessions are never evicted by the quota."""
    path = pin_path(home, name)
    if on:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    else:
        path.unlink(missing_ok=True)


@dataclass
class Evicted:
    sessions: List[Tuple[str, int]] = field(default_factory=list)  # (name, bytes freed with it)
    pages: int = 0  # page files deleted
    freed: int = 0  # bytes in all
    usage: int = 0  # bytes left


def _stores(home: Path, live: Optional[PageStore] = None) -> Dict[str, PageStore]:
    """A PageStore per model folder of the store; `live` (the caller's own) stands for its folder, so
    the pages deleted here leave its set of known pages too."""
    root = Path(home) / "store"
    dirs = sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    stores = {d.name: PageStore(d, root / "lock") for d in dirs}
    if live is not None and live.root.name in stores:
        stores[live.root.name] = live
    return stores


def _manifest_bytes(home: Path, name: str) -> int:
    total = 0
    for p in (manifest_path(home, name), _prev_path(manifest_path(home, name))):
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def usage(home: Path) -> int:
    """Bytes of every page file and every manifest (stat only: cheap enough to run after each commit)."""
    pages = sum(n for store in _stores(home).values() for _, n, _ in store.pages())
    manifests = 0
    for p in sessions_dir(home).glob("*.json"):
        try:
            manifests += p.stat().st_size
        except OSError:
            pass
    return pages + manifests


def evict_sessions(home: Path, max_bytes: int, keep: Iterable[str] = (), live: Optional[PageStore] = None) -> Evicted:
    """Bring the store to at most max_bytes (call under the store lock): unreferenced pages first, then
    least recently committed sessions that are not pinned, not in `keep` and not open anywhere."""
    home, out = Path(home), Evicted()
    out.usage = usage(home)
    if out.usage <= max_bytes:
        return out
    stores = _stores(home, live)
    files = {(fp, h): (n, t) for fp, store in stores.items() for h, n, t in store.pages()}
    manifests = list_manifests(home)
    refs = {m.name: {(m.model_fingerprint, p["hash"]) for p in m.pages + ([m.open_page] if m.open_page else [])}
            for m in manifests}
    count = Counter(k for r in refs.values() for k in r)

    def drop(key) -> int:
        fp, h = key
        n = files.pop(key, (0, 0))[0]
        if n:
            stores[fp].path(h).unlink(missing_ok=True)
            stores[fp].known.discard(h)
            out.pages += 1
        return n

    for key in sorted((k for k in files if not count[k]), key=lambda k: files[k][1]):
        if out.usage <= max_bytes:
            return out
        n = drop(key)
        out.usage, out.freed = out.usage - n, out.freed + n
    keep = set(keep)
    for m in sorted(manifests, key=lambda m: m.updated):
        if out.usage <= max_bytes:
            break
        if m.name in keep or is_pinned(home, m.name):
            continue
        with held_if_free(home, m.name) as free:
            if not free:
                continue
            n = _manifest_bytes(home, m.name)
            remove_manifest(home, m.name)
            for key in refs[m.name]:
                count[key] -= 1
                if count[key] == 0:
                    n += drop(key)
        out.sessions.append((m.name, n))
        out.usage, out.freed = out.usage - n, out.freed + n
    if out.sessions:
        log.info("session quota %d bytes: removed %s (%.1f MB freed, %.1f MB left)", max_bytes,
                 ", ".join(name for name, _ in out.sessions), out.freed / 1e6, out.usage / 1e6)
    return out
