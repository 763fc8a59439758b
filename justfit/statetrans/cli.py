"""`justfit sessions list|show|rm|gc`: inspect and clean the session store (no MLX import)."""

import os
import time
from pathlib import Path

import typer

from ..errors import UserError

app = typer.Typer(no_args_is_help=True, help="Persisted sessions: list, show, remove, garbage-collect the store.")


def _home() -> Path:
    from ..config import home

    return home()


def _page_path(home: Path, model_fp: str, h: str) -> Path:
    return home / "store" / model_fp / "pages" / h[:2] / f"{h}.safetensors"


def _disk_bytes(home: Path, m) -> int:
    total = 0
    for p in m.pages:
        try:
            total += _page_path(home, m.model_fingerprint, p["hash"]).stat().st_size
        except OSError:
            pass
    return total


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

    home = _home()
    rows = list_manifests(home)
    if not rows:
        typer.echo(f"no sessions under {home / 'sessions'}")
        return
    typer.echo(f"{'NAME':<24} {'TOKENS':>7} {'PAGES':>5} {'DISK':>9} {'KV':<10} {'LAST USE':<10} MODEL")
    for m in rows:
        typer.echo(f"{m.name:<24} {len(m.tokens):>7} {len(m.pages):>5} {_disk_bytes(home, m) / 1e6:>7.1f}MB "
                   f"{m.kv.get('name', '?'):<10} {_ago(m.updated):<10} {m.model or m.model_fingerprint}")


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
                 ("tokens", len(m.tokens)), ("pages", f"{len(m.pages)} ({_disk_bytes(home, m) / 1e6:.1f} MB on disk)"),
                 ("parent", m.parent or "-"), ("created", time.ctime(m.created)), ("last use", time.ctime(m.updated))):
        typer.echo(f"{k:<10} {v}")
    for msg in m.messages:
        text = msg["content"].replace("\n", " ")
        typer.echo(f"  {msg['role']:>9}: {text[:200]}{'…' if len(text) > 200 else ''}")


@app.command("rm")
def rm(name: str = typer.Argument(..., help="Session name.")):
    """Remove a session's manifest (its pages go at the next `gc` or disk eviction)."""
    from .manifest import remove_manifest

    if not remove_manifest(_home(), name):
        raise UserError(f"no session named {name!r} (see `justfit sessions list`)")
    typer.echo(f"removed session {name!r}")


@app.command("gc")
def gc(max_bytes: int = typer.Option(None, "--max-bytes", min=0,
                                     help="Also evict least recently used pages, even ones sessions use, "
                                          "until the store holds at most this many bytes (those sessions "
                                          "recompute them from their tokens).")):
    """Delete pages no session references and stale temp files; optionally shrink the store further."""
    from .manifest import list_manifests, sessions_dir
    from .store import PageStore

    home = _home()
    live = {p["hash"] for m in list_manifests(home) for p in m.pages}
    root = home / "store"
    freed = removed = 0
    stores = [PageStore(d, root / "lock") for d in sorted(root.iterdir()) if d.is_dir()] if root.is_dir() else []
    for store in stores:
        with store.lock():
            for h, n, _ in store.pages():
                if h not in live:
                    store.path(h).unlink(missing_ok=True)
                    freed, removed = freed + n, removed + 1
            removed += _clear_tmp(store.root / "tmp")
    _clear_tmp(sessions_dir(home) / ".tmp")
    if max_bytes is not None:
        for store in stores:
            with store.lock():
                freed += store.evict(max_bytes)
    typer.echo(f"gc: removed {removed} files, freed {freed / 1e6:.1f} MB")


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
