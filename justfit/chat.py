"""`justfit chat`: one-shot (--prompt or piped stdin) or an interactive REPL with history.

Every reply ends with a stats line on stderr; with --json each reply is instead one JSON object on
stdout: {"text": ..., "stats": {...}, "stopped": bool}.
"""

import json
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional

import typer

from .progress import LateBar


def stats_dict(stats) -> dict:
    """A turn's stats as a plain dict, whether the runtime hands a TurnStats or (older) a dict."""
    if stats is None:
        return {}
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)


def format_stats(stats) -> str:
    """The one-line footer: prompt tokens, TTFT, decode speed, tokens, peak memory."""
    s = stats_dict(stats)
    draft = (f" | {s['drafter']} {s.get('accepted_tokens', 0)}/{s.get('drafted_tokens', 0)} accepted"
             if s.get("drafter", "none") not in ("none", None) else "")
    stopped = " | stopped by Ctrl-C" if s.get("stopped") else ""
    return (f"[prompt {s.get('prompt_tokens') or 0} tok, reused {s.get('reused_tokens') or 0} | "
            f"TTFT {s.get('ttft_s') or 0.0:.2f} s | decode {s.get('decode_tok_s') or 0.0:.1f} tok/s | "
            f"{s.get('generated_tokens') or 0} tok | peak {(s.get('peak_memory_bytes') or 0) / 1e6:.0f} MB"
            f"{draft}{stopped}]")


@dataclass
class ChatOutput:
    """How replies are shown (streamed text or JSON, residency report) and the last turn's stats."""

    json_out: bool = False
    residency: bool = False
    last: dict = field(default_factory=dict)

    def reply(self, rt, source, messages, opts: dict) -> str:
        """Run one turn on `source` (a Runtime or a Session), show it, keep its stats; Ctrl-C stops
        the reply early and keeps what was said (and the stats up to there, for /stats)."""
        parts, stopped = [], False
        prefill = LateBar("prefilling the prompt (tokens)", after=2.0)  # drawn only for prefills over 2 s
        gen = source.stream(messages, **opts, progress=prefill)
        try:
            for chunk in gen:
                prefill.close()
                parts.append(chunk.text)
                if not self.json_out:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            stopped = True
        finally:
            prefill.close()
            gen.close()  # run the stream's own cleanup now, so its stats are final before we read them
        text = "".join(parts)
        self.last = {**stats_dict(getattr(source, "last_stats", None)), "stopped": stopped}
        if self.json_out:
            typer.echo(json.dumps({"text": text, "stats": self.last, "stopped": stopped}))
        else:
            sys.stdout.write(" [stopped]\n" if stopped else "\n")
            typer.echo(format_stats(self.last), err=True)
        if self.residency:
            from .phaseswap.residency import format_report

            typer.echo(format_report(rt.residency()), err=True)
        return text

    def show_stats(self) -> None:
        """The REPL's /stats: the last turn's numbers (also after a reply stopped by Ctrl-C)."""
        typer.echo(format_stats(self.last) if self.last else "[no turn yet]", err=True)


def _system(system: Optional[str]) -> List[dict]:
    return [{"role": "system", "content": system}] if system else []


def one_shot(rt, prompt: str, system: Optional[str], opts: dict, out: Optional[ChatOutput] = None) -> None:
    (out or ChatOutput()).reply(rt, rt, _system(system) + [{"role": "user", "content": prompt}], opts)


HELP = ("/help      this list\n"
        "/reset     clear the history and start over\n"
        "/stats     the last reply's numbers (also one stopped with Ctrl-C)\n"
        "/exit      quit (or Ctrl-D); Ctrl-C stops a reply and keeps the chat\n"
        '"""        on a line of its own opens a message of several lines, and again closes it\n'
        "A line that starts with / is a command, never sent to the model; start it with a space to send it.\n"
        "Piped input (printf 'hi\\nwhat did I say?\\n' | justfit chat) is a scripted chat: a turn per line.")


def model_name(rt) -> str:
    """The name the banner shows: the model's folder (a converted GGUF's, an HF id's) or what was asked for."""
    from pathlib import Path

    path = getattr(getattr(rt, "model", None), "justfit_path", None) or str(getattr(rt, "model_spec", "") or "")
    return Path(str(path)).name or str(path) or "the model"


def banner(rt, session: Optional[str] = None) -> str:
    where = f", session {session!r}" if session else ""
    return f"justfit chat: {model_name(rt)}{where}. /help lists the commands, /exit or Ctrl-D quits."


def command(line: str, out: "ChatOutput") -> bool:
    """Handle a REPL /command here (it is never sent to the model); True when it was /reset, which the
    caller applies to its own history."""
    cmd = line.strip()
    if cmd == "/reset":
        return True
    if cmd == "/help":
        typer.echo(HELP, err=True)
    elif cmd == "/stats":
        out.show_stats()
    else:
        typer.echo(f"[unknown command {cmd.split()[0]!r}: /help lists them; start the line with a space to "
                   "send it to the model]", err=True)
    return False


BLOCK = '"""'


def tty_reader(banner: str) -> Callable[[str], str]:
    """Interactive input: the banner once, then `input(prompt)` with line editing and history; Ctrl-D
    and Ctrl-C end the prompt's line first, so what follows starts on its own line."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    typer.echo(banner, err=True)

    def read(prompt: str) -> str:
        try:
            return input(prompt)
        except (EOFError, KeyboardInterrupt):
            typer.echo("", err=True)
            raise

    return read


def script_reader(lines: Iterable[str]) -> Callable[[str], str]:
    """Scripted input (piped stdin): the next line, no prompt drawn; EOFError at the end."""
    feed = iter(lines)

    def read(prompt: str = "") -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


def _block(first: str, read: Callable[[str], str]) -> str:
    """A multi-line entry: from a line that starts with BLOCK (three double quotes) to one that ends with
    it (the same line or a later one); the end of input closes it too. The markers are dropped, the lines
    between kept as typed."""
    parts, line = [], first.lstrip()[len(BLOCK):]
    while not line.rstrip().endswith(BLOCK):
        parts.append(line)
        try:
            line = read("... ")
        except EOFError:
            return "\n".join(parts).strip("\n")
    parts.append(line.rstrip()[:-len(BLOCK)])
    return "\n".join(parts).strip("\n")


def entries(read: Callable[[str], str]) -> Iterator[str]:
    """What the user sends, one entry per turn or /command: each non-empty line, or a BLOCK of several
    lines. Ctrl-C at the prompt (or inside a block) drops what was typed; Ctrl-D or /exit ends."""
    while True:
        try:
            line = read(">>> ")
            if line.lstrip().startswith(BLOCK):
                line = _block(line, read)
        except EOFError:
            return
        except KeyboardInterrupt:
            continue
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line


def repl(rt, system: Optional[str], opts: dict, out: Optional[ChatOutput] = None,
         script: Optional[Iterable[str]] = None) -> None:
    """Chat with history across turns, /help, /reset, /stats, /exit: typed at a prompt, or `script`'s
    lines (piped stdin), each a turn that sees the ones before it."""
    out = out or ChatOutput()
    messages = _system(system)
    read = tty_reader(banner(rt)) if script is None else script_reader(script)
    for line in entries(read):
        if line.startswith("/"):
            if command(line, out):
                messages = _system(system)
                typer.echo("[history cleared]", err=True)
        else:
            text = _turn(out, rt, rt, messages + [{"role": "user", "content": line}], opts)
            if text is not None:
                messages += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]


def _turn(out, rt, source, messages, opts) -> Optional[str]:
    """One interactive turn; a turn the runtime refuses (the history has filled the model's context, a bad
    option) is said in one line and the conversation goes on without it."""
    from .errors import UserError

    try:
        return out.reply(rt, source, messages, opts)
    except UserError as e:
        typer.echo(f"justfit: {e} (nothing was added; /reset clears the history)", err=True)
        return None


def _show_history(session, to_stderr: bool) -> None:
    """Print a resumed session's earlier turns, so the user sees where the conversation stands."""
    if not session.messages:
        return
    typer.echo(f"[session {session.name!r}: {len(session.messages)} earlier messages, "
               f"{len(session.tokens)} tokens, {session.kv_tokens} restored from pages]", err=True)
    for m in session.messages:
        typer.echo(f"{m['role']}: {m['content']}", err=to_stderr)


def session_chat(rt, name: str, prompt: Optional[str], system: Optional[str], opts: dict,
                 out: Optional[ChatOutput] = None, script: Optional[Iterable[str]] = None) -> None:
    """`justfit chat --session NAME`: resume the named session (earlier turns shown), answer `prompt`,
    `script`'s lines (piped stdin) or the REPL's on it; every turn is checkpointed, so a restart continues
    where it stopped."""
    out = out or ChatOutput()
    session = rt.session(name)
    try:
        _show_history(session, to_stderr=prompt is not None or script is not None or out.json_out)
        first = _system(system) if not session.tokens else []
        if prompt is not None:
            out.reply(rt, session, first + [{"role": "user", "content": prompt}], opts)
            return
        read = tty_reader(banner(rt, name)) if script is None else script_reader(script)
        for line in entries(read):
            if line.startswith("/"):
                if command(line, out):
                    session.rewind(len(session.tokens))
                    first = _system(system)
                    typer.echo("[session cleared]", err=True)
            elif _turn(out, rt, session, first + [{"role": "user", "content": line}], opts) is not None:
                first = []
    finally:
        session.close()
