"""The `justfit` command line: chat, models, info, bench, probe, sessions."""

import os
import sys
from enum import Enum
from typing import Optional

import typer
from typer.core import TyperGroup

from .errors import UserError


class _Group(TyperGroup):
    """Turns a UserError raised anywhere below into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            typer.echo(f"justfit: error: {e}", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=_Group, no_args_is_help=True, add_completion=False,
                  help="JustFit: local LLM agents on MLX that fit in memory and answer fast.")
models_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Cached models: list, import GGUF files.")
app.add_typer(models_app, name="models")

from .bench.cli import app as bench_app  # noqa: E402
from .probe.cli import probe as _probe  # noqa: E402

app.add_typer(bench_app, name="bench")
app.command("probe")(_probe)


def _agent_app():
    """The `justfit agent` group from justfit_agents (source in agents/; installed by pip)."""
    try:
        from justfit_agents.cli import app as agent_app
    except ImportError:  # a bare checkout without `pip install -e .`
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agents"))
        from justfit_agents.cli import app as agent_app
    return agent_app


app.add_typer(_agent_app(), name="agent")

from .statetrans.cli import app as sessions_app  # noqa: E402

app.add_typer(sessions_app, name="sessions")


class KVBits(str, Enum):
    four = "4"
    eight = "8"
    sixteen = "16"


class KVFormat(str, Enum):
    affine = "affine"
    rotated = "rotated"


@app.command()
def chat(
    model: str = typer.Option("default", "--model", "-m", help="'default', an mlx-lm folder, a .gguf file or an HF repo id."),
    session: Optional[str] = typer.Option(None, "--session", help="Named session to resume and extend."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One-shot: answer this and exit."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Most tokens per reply."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling threshold."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    kv_bits: KVBits = typer.Option(KVBits.four, "--kv-bits", help="KV cache precision: 4, 8 or 16 (full)."),
    kv_format: KVFormat = typer.Option(KVFormat.affine, "--kv-format", help="4-bit KV format."),
    stats: bool = typer.Option(False, "--stats", help="Show resident components and the phase after each reply."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Small model with the same tokenizer for speculative decoding."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Bytes, '4GB', or a fraction/percent of RAM."),
    avoid_regimes: bool = typer.Option(False, "--avoid-regimes", help="Steer decode budgets around latency cliffs in this device's `justfit probe` map."),
):
    """Chat with a model: interactive on a terminal, one-shot with --prompt or piped stdin."""
    from .chat import one_shot, repl, session_chat
    from .config import KVConfig
    from .runtime import Runtime

    if session is not None:
        from .statetrans.manifest import check_name

        check_name(session)
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise UserError("nothing to answer: stdin was empty")
    fmt = kv_format.value if int(kv_bits.value) == 4 else "affine"
    from .phaseswap import parse_budget

    kv = KVConfig(bits=int(kv_bits.value), format=fmt)
    steering = None
    if avoid_regimes:
        from .probe.maps import RegimeSteering

        steering = RegimeSteering(model, kv)
    rt = Runtime(model=model, kv=kv, memory_budget=parse_budget(memory_budget), draft_model=draft_model,
                 steering=steering)
    opts = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, seed=seed)
    if session is not None:
        session_chat(rt, session, prompt, system, opts, stats)
    elif prompt is not None:
        one_shot(rt, prompt, system, opts, stats)
    else:
        repl(rt, system, opts, stats)


@models_app.command("list")
def models_list():
    """Models cached under JUSTFIT_HOME/models with their sizes."""
    from .models import list_models

    rows = list_models()
    if not rows:
        typer.echo("no cached models (the default one is fetched on first `justfit chat`)")
    for r in rows:
        typer.echo(f"{r['name']:<48} {r['bytes'] / 1e6:8.1f} MB  {r['path']}")


@models_app.command("import")
def models_import(path: str = typer.Argument(..., help="A Llama-family .gguf file (Q4_0, Q4_1, Q8_0, F16, F32).")):
    """Convert a GGUF file into a cached mlx-lm model folder."""
    from .models import import_gguf

    typer.echo(import_gguf(path))


@app.command()
def info():
    """Backend, device memory, versions, BLAS, weight dtype and JUSTFIT_HOME."""
    from importlib.metadata import version

    import mlx.core as mx
    import psutil

    from . import __version__
    from .blas import active_blas
    from .config import home
    from .models import backend
    from .phaseswap.budget import Budget, parse_budget

    be = backend()
    mem = mx.metal.device_info().get("memory_size") if be == "metal" else psutil.virtual_memory().total
    weights = os.environ.get("JUSTFIT_WEIGHTS", "auto")
    if weights == "auto":
        weights = "auto (fp32 on CPU when it fits in a quarter of RAM, else as stored)" if be == "cpu" else "auto (as stored)"
    rows = [
        ("backend", be.upper() if be != "metal" else "Metal"),
        ("device memory", f"{mem / 2**30:.1f} GiB"),
        ("available memory", f"{psutil.virtual_memory().available / 2**30:.1f} GiB"),
        ("justfit", __version__), ("mlx", version("mlx")), ("mlx-lm", version("mlx-lm")),
        ("blas", active_blas()), ("weights", weights), ("JUSTFIT_HOME", str(home())),
        ("memory budget", Budget(parse_budget(os.environ.get("JUSTFIT_MEMORY_BUDGET"))).describe()),
    ]
    for k, v in rows:
        typer.echo(f"{k:<17} {v}")


def main():
    """Console entry point: fast BLAS re-exec, then the app; internal errors exit 1 in one line."""
    from .blas import maybe_reexec

    maybe_reexec(sys.argv)
    try:
        rc = app(standalone_mode=False, prog_name="justfit")
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        # Usage errors come from the click that typer bundles: they know how to show themselves.
        if callable(getattr(e, "show", None)) and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            sys.exit(130)
        if os.environ.get("JUSTFIT_DEBUG"):
            raise
        print(f"justfit: internal error: {type(e).__name__}: {e} (JUSTFIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)
