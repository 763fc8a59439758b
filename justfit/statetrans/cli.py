"""`justfit sessions list|show|rm|pin|unpin|gc`: inspect and clean the session store (no MLX import)."""

import os
import time
from pathlib import Path

import typer

from ..errors import UserError

app = typer.Typer(no_args_is_help=True, help="Persisted sessions: list, show, remove, pin, garbage-collect the store.")


def _home() -> Path:
    from ..config import home

    return home()


def _page_path(home: Path, model_fp: str, h: str) -> Path:
    return home / "store" / model_fp / "pages" / h[:2] / f"{h}.safetensors"


def _pages(m) -> list:
    """Every page file holding the session's tokens: the sealed pages, then the open (partial) last one,
    which is all a session shorter than one page has."""
    return m.pages + ([m.open_page] if m.open_page else [])


def _disk_bytes(home: Path, m) -> int:
    total = 0
    for p in _pages(m):
        try:
            total += _page_path(home, m.model_fingerprint, p["hash"]).stat().st_size
        except OSError:
            pass
    return total


def _aligned(header: list, rows: list, right: set) -> list:
    """Lines of a table whose columns are as wide as their widest cell (numbers right-aligned), so the
    columns line up for any name length, on a terminal or in a pipe."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in cells]


def _ago(t: float) -> str:
    s = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


@app.command("list")
def list_sessions():
    """Sessions with their tokens, pages, bytes on disk and last use."""
    from .manifest import list_manifests
    from .quota import is_pinned

    home = _home()
    rows = list_manifests(home)
    if not rows:
        typer.echo(f"no sessions under {home / 'sessions'}")
        return
    header = ["NAME", "TOKENS", "PAGES", "DISK", "KV", "LAST USE", "PIN", "MODEL"]
    table = [[m.name, len(m.tokens), len(_pages(m)), f"{_disk_bytes(home, m) / 1e6:.1f} MB", m.kv.get("name", "?"),
              _ago(m.updated), "yes" if is_pinned(home, m.name) else "-", m.model or m.model_fingerprint]
             for m in rows]
    for line in _aligned(header, table, right={1, 2, 3}):
        typer.echo(line)


@app.command("show")
def show(name: str = typer.Argument(..., help="Session name.")):
    """One session: model, KV format, tokens, pages, parent, and its messages."""
    from .manifest import read_manifest

    home = _home()
    m = read_manifest(home, name)
    if m is None:
        raise UserError(f"no session named {name!r} (see `justfit sessions list`)")
    kv = m.kv
    for k, v in (("name", m.name), ("model", f"{m.model} ({m.model_fingerprint})"),
                 ("tokenizer", m.tokenizer_fingerprint), ("kv", f"{kv.get('name')} page {kv.get('page_size')}"),
                 ("tokens", len(m.tokens)), ("pages", f"{len(m.pages)} sealed{' + 1 open' if m.open_page else ''} "
                                               f"({_disk_bytes(home, m) / 1e6:.1f} MB on disk)"),
                 ("parent", m.parent or "-"), ("created", time.ctime(m.created)), ("last use", time.ctime(m.updated))):
        typer.echo(f"{k:<10} {v}")
    for msg in m.messages:
        text = msg["content"].replace("\n", " ")
        typer.echo(f"  {msg['role']:>9}: {text[:200]}{'…' if len(text) > 200 else ''}")


@app.command("rm")
def rm(name: str = typer.Argument(..., help="Session name.")):
    """Remove a session's manifest and pin (its pages go at the next `gc` or disk eviction)."""
    from .manifest import remove_manifest
    from .quota import set_pinned

    if not remove_manifest(_home(), name):
        raise UserError(f"no session named {name!r} (see `justfit sessions list`)")
    set_pinned(_home(), name, False)
    typer.echo(f"removed session {name!r}")


def _existing(name: str) -> Path:
    from .manifest import _prev_path, manifest_path

    home = _home()
    path = manifest_path(home, name)
    if not (os.path.lexists(path) or os.path.lexists(_prev_path(path))):
        raise UserError(f"no session named {name!r} (see `justfit sessions list`)")
    return home


@app.command("pin")
def pin(name: str = typer.Argument(..., help="Session name.")):
    """Pin a session: `gc --max-bytes` and the server's --sessions-max-bytes quota never evict it."""
    from .quota import set_pinned

    set_pinned(_existing(name), name, True)
    typer.echo(f"pinned session {name!r}")


@app.command("unpin")
def unpin(name: str = typer.Argument(..., help="Session name.")):
    """Unpin a session: the quota may evict it again (least recently used first)."""
    from .quota import set_pinned

    set_pinned(_existing(name), name, False)
    typer.echo(f"unpinned session {name!r}")


@app.command("gc")
def gc(max_bytes: str = typer.Option(None, "--max-bytes", metavar="SIZE",
                                     help="Disk quota for the store, e.g. 500MB, 2GiB or bytes: after the "
                                          "cleanup, remove whole sessions, least recently used first, until "
                                          "pages and manifests fit. Pinned sessions (`justfit sessions pin`) "
                                          "and sessions a running process has open are never removed; a page "
                                          "shared with a remaining session stays.")):
    """Delete pages no session references and stale temp files; with --max-bytes, evict sessions too.

    Prints each removed session and the bytes freed."""
    from .manifest import list_manifests, sessions_dir
    from .quota import evict_sessions, parse_size
    from .store import PageStore

    cap = None if max_bytes is None else parse_size(max_bytes, "--max-bytes")
    home = _home()
    root = home / "store"
    freed = removed = 0
    stores = [PageStore(d, root / "lock") for d in sorted(root.iterdir()) if d.is_dir()] if root.is_dir() else []
    with PageStore(root, root / "lock").lock():
        live = {p["hash"] for m in list_manifests(home) for p in m.pages + ([m.open_page] if m.open_page else [])}
        for store in stores:
            for h, n, _ in store.pages():
                if h not in live:
                    store.path(h).unlink(missing_ok=True)
                    freed, removed = freed + n, removed + 1
            removed += _clear_tmp(store.root / "tmp")
        _clear_tmp(sessions_dir(home) / ".tmp")
        evicted = evict_sessions(home, cap) if cap is not None else None
    if evicted is not None:
        for name, n in evicted.sessions:
            typer.echo(f"removed session {name!r} ({n / 1e6:.1f} MB)")
        removed += evicted.pages
        freed += evicted.freed
    typer.echo(f"gc: removed {removed} files, freed {freed / 1e6:.1f} MB")
    if evicted is not None and evicted.usage > cap:
        typer.echo(f"gc: the store still holds {evicted.usage / 1e6:.1f} MB, over the {cap / 1e6:.1f} MB quota: "
                   "the rest is pinned or open in a running process")


def _clear_tmp(folder: Path, age_s: float = 3600) -> int:
    """Delete temp files left by killed writers (older than an hour: a live writer's are newer)."""
    n = 0
    if folder.is_dir():
        for p in folder.iterdir():
            try:
                if time.time() - p.stat().st_mtime > age_s:
                    os.unlink(p)
                    n += 1
            except OSError:
                pass
    return n
