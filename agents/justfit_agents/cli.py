"""`justfit agent run NAME --workspace DIR "task"`: a ready agent with a live view of its steps.
No MLX import at module import (keeps `justfit --help` fast)."""

from typing import List, Optional

import typer

app = typer.Typer(help="Agent loops on JustFit: ready agents over a workspace folder.", no_args_is_help=True)


@app.callback()
def agent_group():
    """Agent loops on JustFit: ready agents over a workspace folder (`run`)."""


def _show(event) -> None:
    """One live line (or block) per event, on stderr so stdout holds only the answer."""
    st = event.stats
    if event.kind == "call":
        args = ", ".join(f"{k}={v!r}" for k, v in event.call.arguments.items())
        typer.echo(f"[step {event.step}] {event.call.name}({args[:200]})  "
                   f"prompt {st.prompt_tokens} / reused {st.reused_tokens} / prefilled {st.prefilled_tokens} "
                   f"tok, {st.turn_s:.1f} s", err=True)
    elif event.kind == "result":
        text = event.text if len(event.text) < 400 else event.text[:400] + " ..."
        typer.echo("    -> " + text.replace("\n", "\n       "), err=True)
    elif event.kind == "answer":
        typer.echo(f"[step {event.step}] answer  prompt {st.prompt_tokens} / reused {st.reused_tokens} / "
                   f"prefilled {st.prefilled_tokens} tok, {st.turn_s:.1f} s", err=True)


@app.command("run")
def run(
    name: str = typer.Argument(..., help="Ready agent: files | coding."),
    task: str = typer.Argument(..., help="What the agent should do."),
    workspace: str = typer.Option(".", "--workspace", "-w", help="Folder the agent's tools are confined to."),
    model: str = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a .gguf or an HF id."),
    session: Optional[str] = typer.Option(None, "--session", help="Resume and extend this named agent session."),
    max_steps: int = typer.Option(8, "--max-steps", min=1, help="Most model turns."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    kv_bits: int = typer.Option(4, "--kv-bits", help="KV cache precision: 4, 8 or 16."),
    allow: List[str] = typer.Option([], "--allow", help="Enable the shell tool for this command (repeatable; coding agent)."),
    transcript: bool = typer.Option(False, "--transcript", help="Print the full transcript at the end."),
    unsafe_no_sandbox: bool = typer.Option(False, "--unsafe-no-sandbox",
                                           help="Run code tools unconfined where no OS sandbox exists (dangerous)."),
):
    """Run a ready agent on a task; steps stream to stderr, the final answer goes to stdout."""
    from pathlib import Path

    from justfit import KVConfig, Runtime, UserError

    from .ready import READY
    from .sandbox import SandboxError

    if name not in READY:
        raise UserError(f"no ready agent {name!r}; choose one of: {', '.join(READY)}")
    if not Path(workspace).is_dir():
        raise UserError(f"workspace {workspace!r} is not a folder")
    if seed is not None and temp == 0:
        typer.echo(f"justfit agent: note: --seed {seed} does nothing with --temp 0 (greedy decoding is already "
                   "deterministic); set --temp above 0 to sample", err=True)
    rt = Runtime(model=model, kv=KVConfig(bits=kv_bits))
    kw = dict(session=session, max_steps=max_steps, temperature=temp, seed=seed)
    if name == "coding":
        kw["shell_allow"] = allow or None
        kw["unsafe_no_sandbox"] = unsafe_no_sandbox
    try:
        agent = READY[name](rt, workspace, **kw)
    except SandboxError as e:
        raise UserError(str(e)) from None
    result = None
    for event in agent.stream(task):
        _show(event)
        result = event.result or result
    if transcript:
        typer.echo(result.transcript(), err=True)
    s = result.stats
    typer.echo(f"[{s['steps']} steps, {result.stopped} | prompt {s['prompt_tokens']} / reused {s['reused_tokens']} / "
               f"prefilled {s['prefilled_tokens']} tok | {s['turn_s']:.1f} s model, {s['tool_s']:.2f} s tools]", err=True)
    reason = unfinished_reason(result, max_steps)
    if reason:  # stdout holds answers only: a tool's error or a repeated call's output is not one
        typer.echo(f"justfit agent: did not finish: {reason}", err=True)
        raise typer.Exit(1)
    typer.echo(result.answer)


def unfinished_reason(result, max_steps: int) -> str:
    """Why a run is not a finished task ('' when the agent gave its answer): scripts see exit code 1."""
    last = result.steps[-1].call if result.steps else None
    before = result.steps[-2].call if len(result.steps) > 1 else None
    return {
        "answer": "",
        "max_steps": f"no final answer within {max_steps} steps (raise --max-steps, or try a larger --model)",
        "length": "the last reply hit the token limit before it was complete",
        "repeat": (f"the model repeated the same call {last.name if last else ''}(...) instead of answering; "
                   "its result, above, is not an answer"),
        "stop": "a stop condition ended the run before an answer",
        "tool_error": (f"{before.name if before else 'a tool'}(...) failed and the model answered without fixing it "
                       f"(its answer {result.answer[:80]!r} is not shown as one; try a larger --model)"),
    }.get(result.stopped, f"stopped: {result.stopped}")
