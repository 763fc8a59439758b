"""`justfit chat`: one-shot (--prompt or piped stdin) or an interactive REPL with history."""

import sys
from typing import Iterator, List, Optional

import typer


def format_stats(stats) -> str:
    """The one-line footer (from TurnStats): prompt tokens, TTFT, decode speed, peak memory."""
    stats = stats.as_dict()
    draft = (f" | {stats['drafter']} {stats.get('accepted_tokens', 0)}/{stats.get('drafted_tokens', 0)} accepted"
             if stats.get("drafter", "none") != "none" else "")
    return (f"[prompt {stats.get('prompt_tokens', 0)} tok, reused {stats.get('reused_tokens', 0)} | "
            f"TTFT {stats.get('ttft_s', 0.0):.2f} s | decode {stats.get('decode_tok_s', 0.0):.1f} tok/s | "
            f"{stats.get('generated_tokens', 0)} tok | peak {stats.get('peak_memory_bytes', 0) / 1e6:.0f} MB{draft}]")


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


def _residency(rt, show: bool) -> None:
    """With --stats: resident components, their bytes and the phase (PhaseSwap)."""
    if show:
        from .phaseswap.residency import format_report

        typer.echo(format_report(rt.residency()), err=True)


def one_shot(rt, prompt: str, system: Optional[str], opts: dict, show_residency: bool = False) -> None:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    _reply(rt, messages, opts)
    typer.echo(format_stats(rt.last_stats), err=True)
    _residency(rt, show_residency)


def _lines(banner: str) -> Iterator[str]:
    """REPL input: yields each non-empty line; Ctrl-C at the prompt is ignored, Ctrl-D or /exit ends."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    typer.echo(banner, err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            typer.echo("", err=True)
            return
        except KeyboardInterrupt:
            typer.echo("", err=True)
            continue
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line


def repl(rt, system: Optional[str], opts: dict, show_residency: bool = False) -> None:
    """Interactive chat: history across turns, /reset, /stats, /exit, Ctrl-D exits."""
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    for line in _lines("justfit chat — /reset clears history, /stats shows the last turn, /exit or Ctrl-D quits."):
        cmd = line.strip()
        if cmd == "/reset":
            messages = list(start)
            typer.echo("[history cleared]", err=True)
        elif cmd == "/stats":
            typer.echo(format_stats(rt.last_stats) if rt.last_stats.prompt_tokens else "[no turn yet]", err=True)
        else:
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": _reply(rt, messages, opts)})
            if show_residency:
                typer.echo(format_stats(rt.last_stats), err=True)
                _residency(rt, True)


def _show_history(session, out) -> None:
    """Print a resumed session's earlier turns, so the user sees where the conversation stands."""
    if not session.messages:
        return
    typer.echo(f"[session {session.name!r}: {len(session.messages)} earlier messages, "
               f"{len(session.tokens)} tokens, {session.kv_tokens} restored from pages]", err=True)
    for m in session.messages:
        typer.echo(f"{m['role']}: {m['content']}", err=out is sys.stderr)


def session_chat(rt, name: str, prompt: Optional[str], system: Optional[str], opts: dict,
                 show_residency: bool = False) -> None:
    """`justfit chat --session NAME`: resume the named session (earlier turns shown), answer `prompt`
    or run the REPL on it; every turn is checkpointed, so a restart continues where it stopped."""
    session = rt.session(name)
    try:
        _show_history(session, sys.stderr if prompt is not None else sys.stdout)
        first = [{"role": "system", "content": system}] if system and not session.tokens else []
        if prompt is not None:
            _reply(session, first + [{"role": "user", "content": prompt}], opts)
            typer.echo(format_stats(session.last_stats), err=True)
            _residency(rt, show_residency)
            return
        for line in _lines(f"justfit chat, session {name!r} — /reset clears it, /stats, /exit or Ctrl-D quits."):
            cmd = line.strip()
            if cmd == "/reset":
                session.rewind(len(session.tokens))
                first = [{"role": "system", "content": system}] if system else []
                typer.echo("[session cleared]", err=True)
            elif cmd == "/stats":
                typer.echo(format_stats(session.last_stats) if session.last_stats.prompt_tokens else "[no turn yet]",
                           err=True)
            else:
                _reply(session, first + [{"role": "user", "content": line}], opts)
                first = []
                _residency(rt, show_residency)
    finally:
        session.close()
