"""`justfit chat`: one-shot (--prompt or piped stdin) or an interactive REPL with history."""

import sys
from typing import List, Optional

import typer


def format_stats(stats: dict) -> str:
    """The one-line footer: prompt tokens, TTFT, decode speed, peak memory."""
    return (f"[prompt {stats.get('prompt_tokens', 0)} tok, reused {stats.get('reused_tokens', 0)} | "
            f"TTFT {stats.get('ttft_s', 0.0):.2f} s | decode {stats.get('decode_tok_s', 0.0):.1f} tok/s | "
            f"{stats.get('generated_tokens', 0)} tok | peak {stats.get('peak_memory_bytes', 0) / 1e6:.0f} MB]")


def _reply(rt, messages: List[dict], opts: dict) -> str:
    """Stream one reply to stdout; Ctrl-C stops it early and keeps what was said."""
    parts = []
    try:
        for chunk in rt.stream(messages, **opts):
            parts.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    return "".join(parts)


def one_shot(rt, prompt: str, system: Optional[str], opts: dict) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    _reply(rt, messages, opts)
    typer.echo(format_stats(rt.last_stats), err=True)


def repl(rt, system: Optional[str], opts: dict) -> None:
    """Interactive chat: history across turns, /reset, /stats, /exit, Ctrl-D exits."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    typer.echo("justfit chat — /reset clears history, /stats shows the last turn, /exit or Ctrl-D quits.", err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            typer.echo("", err=True)
            return
        except KeyboardInterrupt:
            typer.echo("", err=True)
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            messages = list(start)
            typer.echo("[history cleared]", err=True)
            continue
        if cmd == "/stats":
            typer.echo(format_stats(rt.last_stats) if rt.last_stats else "[no turn yet]", err=True)
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": _reply(rt, messages, opts)})


def _show_history(session, out) -> None:
    """Print a resumed session's earlier turns, so the user sees where the conversation stands."""
    if not session.messages:
        return
    typer.echo(f"[session {session.name!r}: {len(session.messages)} earlier messages, "
               f"{len(session.tokens)} tokens, {session.kv_tokens} restored from pages]", err=True)
    for m in session.messages:
        typer.echo(f"{m['role']}: {m['content']}", err=out is sys.stderr)


def session_chat(rt, name: str, prompt: Optional[str], system: Optional[str], opts: dict) -> None:
    """`justfit chat --session NAME`: resume the named session (earlier turns shown), answer `prompt`
    or run the REPL on it; every turn is checkpointed, so a restart continues where it stopped."""
    session = rt.session(name)
    try:
        _show_history(session, sys.stderr if prompt is not None else sys.stdout)
        first = [{"role": "system", "content": system}] if system and not session.tokens else []
        if prompt is not None:
            _reply(session, first + [{"role": "user", "content": prompt}], opts)
            typer.echo(format_stats(session.last_stats), err=True)
            return
        typer.echo(f"justfit chat, session {name!r} — /reset clears it, /stats, /exit or Ctrl-D quits.", err=True)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                typer.echo("", err=True)
                return
            except KeyboardInterrupt:
                typer.echo("", err=True)
                continue
            cmd = line.strip()
            if cmd in ("/exit", "/quit"):
                return
            if cmd == "/reset":
                session.rewind(len(session.tokens))
                first = [{"role": "system", "content": system}] if system else []
                typer.echo("[session cleared]", err=True)
            elif cmd == "/stats":
                typer.echo(format_stats(session.last_stats) if session.last_stats else "[no turn yet]", err=True)
            elif cmd:
                _reply(session, first + [{"role": "user", "content": line}], opts)
                first = []
    finally:
        session.close()
