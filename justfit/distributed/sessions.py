"""StateTrans across ranks: every rank checkpoints its own pages, one world manifest ties them together.

Rank r of N keeps a plain StateTrans session named `<name>.<tag>` (tag e.g. `tp2r1`, see shard.py) over
its own shard's pages (its fingerprint is the shard's, so the store keeps them apart). After each
checkpoint the ranks gather their page hashes with a collective and rank 0 writes
`$JUSTFIT_HOME/sessions/world/<name>.json` (WORLD.md, next to this file): world size, sharding, every rank's page hashes.
Opening a session (`Runtime.session`, so chat, agents and the API alike) checks that manifest first, on
rank 0, and refuses another world size or sharding in one line on every rank, 1-rank runs included.
"""

import hashlib
import json
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from .world import World, broadcast_json, gather_strings, world

WORLD_FORMAT = "justfit-world-session"
WORLD_VERSION = 1


def world_manifest_path(home, name: str) -> Path:
    return Path(home) / "sessions" / "world" / f"{name}.json"


def rank_session_name(name: str, sharding) -> str:
    """The per-rank StateTrans session name: the name itself on one rank, `<name>.<tag>` on N ranks."""
    tag = sharding.tag()
    return f"{name}.{tag}" if tag else name


def read_world_manifest(home, name: str) -> Optional[dict]:
    """The world manifest of `name`, None when there is none; a damaged one is a UserError."""
    path = world_manifest_path(home, name)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_bytes())
        checksum = doc.pop("checksum")
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        ok = hashlib.sha256(body.encode()).hexdigest() == checksum
    except (ValueError, KeyError, AttributeError, TypeError):
        ok = False
    if not ok or doc.get("format") != WORLD_FORMAT or doc.get("version") != WORLD_VERSION:
        raise UserError(f"the world manifest of session {name!r} ({path}) is damaged; remove it to start over")
    return doc


def write_world_manifest(home, name: str, sharding, ranks: list) -> Path:
    """Atomically write the world manifest (rank 0 only)."""
    from ..atomic import atomic_write

    doc = {"format": WORLD_FORMAT, "version": WORLD_VERSION, "name": name, "world_size": sharding.world_size,
           "sharding": sharding.kind, "updated": time.time(), "ranks": ranks}
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    doc["checksum"] = hashlib.sha256(body.encode()).hexdigest()
    path = world_manifest_path(home, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(doc, sort_keys=True).encode())
    return path


def check_world(home, name: str, sharding) -> Optional[dict]:
    """Refuse to open `name` in a world other than the one that checkpointed it (one-line UserError)."""
    from ..statetrans.manifest import manifest_path

    doc = read_world_manifest(home, name)
    if doc is None:
        if sharding.world_size > 1 and manifest_path(home, name).exists():
            raise UserError(f"session {name!r} was checkpointed by 1 rank; this run has {sharding.world_size} "
                            f"ranks; resume it without mlx.launch or use another session name")
        return None
    if doc["world_size"] != sharding.world_size:
        how = "without mlx.launch" if doc["world_size"] == 1 else f"with `mlx.launch -n {doc['world_size']}`"
        raise UserError(f"session {name!r} was checkpointed by {doc['world_size']} ranks ({doc['sharding']} "
                        f"parallel); this run has {sharding.world_size}; resume it {how} (re-sharding pages is "
                        "not supported)")
    if doc["sharding"] != sharding.kind:
        raise UserError(f"session {name!r} was checkpointed {doc['sharding']}-parallel; this run is "
                        f"{sharding.kind}-parallel; set JUSTFIT_SHARDING={doc['sharding']}")
    return doc


class WorldSession:
    """This rank's StateTrans session (`<name>.<tag>`) plus the world manifest. It has the Session API
    (attributes not defined here are the rank session's); checkpoint and close also update the manifest."""

    def __init__(self, rt, name: str, w: Optional[World] = None, **options):
        from ..statetrans.session import Session

        self.rt, self.name, self.world = rt, name, w or world()
        self.session = Session.open(rt, rank_session_name(name, rt.sharding), **options)
        try:
            self._check_restored()
            self._publish()  # the manifest exists from the first turn on, not only after a clean close
        except BaseException:
            self.session.close()
            raise

    def __getattr__(self, attr):  # tokens, messages, kv_tokens, last_stats, rewind, generate, stream ...
        return getattr(self.session, attr)

    def _check_restored(self):
        """Every rank must hold the same number of restored tokens, or the ranks' steps would differ."""
        have = [int(x) for x in gather_strings(str(self.session.kv_tokens), self.world)]
        if len(set(have)) > 1:
            raise UserError(f"session {self.name!r}: ranks restored different amounts of KV ({have} tokens); "
                            "a rank's pages are missing or damaged; remove the session or restore its files")

    def _publish(self):
        """Gather every rank's page hashes; rank 0 writes the world manifest."""
        from ..statetrans.manifest import read_manifest

        own = self.session.name
        m = read_manifest(self.rt.home, own)
        mine = {"rank": self.world.rank, "session": own, "model_fingerprint": m.model_fingerprint if m else None,
                "tokens": len(self.session.tokens), "pages": [p["hash"] for p in (m.pages if m else [])]}
        ranks = [json.loads(r) for r in gather_strings(json.dumps(mine), self.world)]
        if self.world.is_front:
            write_world_manifest(self.rt.home, self.name, self.rt.sharding, ranks)

    def checkpoint(self, *args, **kwargs):
        """Checkpoint this rank's pages, then update the world manifest (a collective: every rank calls it)."""
        out = self.session.checkpoint(*args, **kwargs)
        self._publish()
        return out

    def close(self):
        if self.session.closed:
            return
        self.checkpoint()
        self.session.close()


def open_session(rt, name: str, **options):
    """Create or resume session `name`. Rank 0 checks the world manifest and every rank gets its verdict
    (a one-line UserError on all ranks, so none is left waiting). One rank: a plain StateTrans Session;
    N ranks: a WorldSession."""
    from ..statetrans.session import Session

    w = world()
    verdict = ""
    if w.is_front:  # on two Macs only rank 0's home holds the world manifest
        try:
            check_world(rt.home, name, rt.sharding)
        except UserError as e:
            verdict = str(e)
    verdict = broadcast_json(verdict, w)
    if verdict:
        raise UserError(verdict)
    if rt.sharding.world_size == 1:
        return Session.open(rt, name, **options)
    return WorldSession(rt, name, w, **options)
