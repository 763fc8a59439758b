"""The `justfit` command line: chat, serve, models, info, bench, probe, sessions."""

import os
import sys
from enum import Enum
from typing import List, Optional

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


# -h works like --help on every command: click passes help_option_names down to subcommands.
CONTEXT = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(cls=_Group, no_args_is_help=True, add_completion=False, context_settings=CONTEXT)
models_app = typer.Typer(cls=_Group, no_args_is_help=True, help="Cached models: pull, list with sizes, remove, import GGUF files.")
app.add_typer(models_app, name="models")


def _version(value: bool):
    if value:
        from . import __version__

        typer.echo(f"justfit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    r"""JustFit: local LLM agents on MLX that fit in memory and answer fast.

    Defaults for any option can live in $JUSTFIT_HOME/config.toml, one table per command
    (\[chat], \[probe], \[agent.run] ...); precedence: flags > environment variables > config file > defaults.
    """

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


# Chat's defaults against loops (llama.cpp and ollama default to a 1.1 repetition penalty too); each 0 or 1
# turns it off. The repetition penalty treats a token seen once like one seen ten times, so a phrase all of
# whose tokens are already penalized can still loop; the frequency penalty grows with every repeat.
CHAT_REPETITION_PENALTY = 1.1
CHAT_FREQUENCY_PENALTY = 0.1


class KVBits(str, Enum):
    four = "4"
    eight = "8"
    sixteen = "16"


class KVFormat(str, Enum):
    affine = "affine"
    rotated = "rotated"


@app.command()
def chat(
    model: str = typer.Option("default", "--model", "-m", envvar="JUSTFIT_MODEL", help="'default', an mlx-lm folder, a .gguf file, a cached model name or an HF repo id."),
    session: Optional[str] = typer.Option(None, "--session", help="Named session to resume and extend."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One-shot: answer this and exit."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Most tokens per reply."),
    temp: float = typer.Option(0.0, "--temp", min=0.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0, help="Nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample only among the K most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Drop tokens less likely than P x the most likely one (0 = off)."),
    repetition_penalty: float = typer.Option(CHAT_REPETITION_PENALTY, "--repetition-penalty", min=1.0, help="Divide the logits of tokens already in the reply's recent context by this (1.0 = off); against loops on small models."),
    frequency_penalty: float = typer.Option(CHAT_FREQUENCY_PENALTY, "--frequency-penalty", min=0.0, help="Subtract this from a token's logit for each time it occurs in the last 256 tokens (0 = off); with --repetition-penalty, against loops."),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop the reply before this string (repeatable)."),
    seed: Optional[int] = typer.Option(None, "--seed", min=-1, max=2**63 - 1, help="Random seed for sampling (-1 or unset: a fresh one each run)."),
    kv_bits: KVBits = typer.Option(KVBits.four, "--kv-bits", help="KV cache precision: 4, 8 or 16 (full)."),
    kv_format: KVFormat = typer.Option(KVFormat.affine, "--kv-format", help="4-bit KV format (rotated needs --kv-bits 4)."),
    json: bool = typer.Option(False, "--json", help="Print one JSON object per reply (text, stats) instead of streamed text; for scripts."),
    stats: bool = typer.Option(False, "--stats", help="Also show resident components and the phase after each reply."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Small model with the same tokenizer for speculative decoding."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", envvar="JUSTFIT_MEMORY_BUDGET", help="Bytes, '4GB', or a fraction/percent of RAM."),
    avoid_regimes: bool = typer.Option(False, "--avoid-regimes", help="Steer decode budgets around latency cliffs in this device's `justfit probe` map."),
):
    """Chat with a model: interactive on a terminal, one-shot with --prompt, scripted from piped stdin
    (each line a turn that sees the ones before it; three double quotes open and close a multi-line turn).

    Every reply ends with a stats line on stderr (prompt tokens, TTFT, decode speed, peak memory).
    """
    from .chat import ChatOutput, one_shot, repl, session_chat
    from .config import KVConfig
    from .phaseswap import parse_budget
    from .runtime import Runtime

    if session is not None:
        from .statetrans.manifest import check_name

        check_name(session)
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty: give the text to answer, or leave --prompt out for the REPL")
    script = None
    if prompt is None and not sys.stdin.isatty():  # piped: each line (or """ block) a turn, as in the REPL
        script = sys.stdin.read().splitlines()
        if not any(line.strip() for line in script):
            raise UserError("nothing to answer: stdin was empty")
    if kv_format is KVFormat.rotated and kv_bits is not KVBits.four:
        raise UserError(f"--kv-format rotated is 4-bit only: use --kv-bits 4 (or --kv-format affine with --kv-bits {kv_bits.value})")
    if any(not s for s in stop or []):
        raise UserError("--stop needs a non-empty string")
    if seed not in (None, -1) and temp == 0:
        typer.echo(f"justfit: note: --seed {seed} does nothing with --temp 0 (greedy decoding is already "
                   "deterministic); set --temp above 0 to sample", err=True)
    kv = KVConfig(bits=int(kv_bits.value), format=kv_format.value)
    opts = sampling_options(max_tokens, temp, top_p, top_k, min_p, repetition_penalty, stop,
                            None if seed == -1 else seed, frequency_penalty)
    from .engine.sampling import Sampling

    Sampling(**{k: v for k, v in opts.items() if k != "max_tokens"})  # bad values: one line, before loading
    steering = None
    if avoid_regimes:
        from .probe.maps import RegimeSteering

        steering = RegimeSteering(model, kv)
    rt = Runtime(model=model, kv=kv, memory_budget=parse_budget(memory_budget), draft_model=draft_model,
                 steering=steering)
    out = ChatOutput(json_out=json, residency=stats)
    if session is not None:
        session_chat(rt, session, prompt, system, opts, out, script)
    elif prompt is not None:
        one_shot(rt, prompt, system, opts, out)
    else:
        repl(rt, system, opts, out, script)


def sampling_options(max_tokens, temp, top_p, top_k, min_p, repetition_penalty, stop, seed,
                     frequency_penalty: float = 0.0) -> dict:
    """Keyword arguments for rt.stream (the engine contract); filters that are off are left out."""
    opts = dict(max_tokens=max_tokens, temperature=temp, top_p=top_p, seed=seed)
    extra = dict(top_k=top_k or None, min_p=min_p or None,
                 repetition_penalty=repetition_penalty if repetition_penalty != 1.0 else None,
                 frequency_penalty=frequency_penalty or None, stop=stop or None)
    return {**opts, **{k: v for k, v in extra.items() if v is not None}}


@app.command()
def serve(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="'default', an mlx-lm folder, a .gguf file or an HF repo id; repeat to serve several (the first loads at start, the others on first use, under one --memory-budget). Models cached under JUSTFIT_HOME are served too."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; anything but loopback needs --api-key."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0 picks a free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="JUSTFIT_API_KEY", help="Require 'Authorization: Bearer KEY' (env JUSTFIT_API_KEY)."),
    cors: Optional[str] = typer.Option(None, "--cors", help="Allow browser requests from these origins (comma-separated); off by default."),
    persist: bool = typer.Option(False, "--persist", help="Checkpoint every prompt_cache_key session to disk (as prompt_cache_retention='24h' does per request), and save the prefix cache at shutdown so every API's prompts are found again after a restart."),
    idle_release: Optional[float] = typer.Option(None, "--idle-release", min=1, help="Release weights and KV after this many idle seconds; the next request reloads them."),
    max_queue: int = typer.Option(64, "--max-queue", min=1, help="Requests waiting beyond this get 503 with retry-after."),
    max_body: int = typer.Option(8 << 20, "--max-body", min=1024, help="Largest request body in bytes (413 beyond)."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.1, help="Seconds a client has to send a request's headers (then 408 and closed)."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", min=0.1, help="Seconds a client has to send a request's body once its headers arrived (then 408 and closed)."),
    max_connections: int = typer.Option(1000, "--max-connections", min=1, help="Open connections in all (lowered to fit the open-file limit); a new one closes the oldest idle one, or gets 503."),
    max_client_connections: int = typer.Option(256, "--max-client-connections", min=1, help="Open connections per client address; a new one closes that client's oldest idle one, or gets 503."),
    kv_bits: KVBits = typer.Option(KVBits.four, "--kv-bits", help="KV cache precision: 4, 8 or 16 (full)."),
    kv_format: KVFormat = typer.Option(KVFormat.affine, "--kv-format", help="4-bit KV format."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Bytes, '4GB', or a fraction/percent of RAM."),
    models_dir: Optional[List[str]] = typer.Option(None, "--models-dir", metavar="DIR", help="Also serve every mlx-lm folder and .gguf file in this folder, by its name (a GGUF's file name without .gguf), each loaded on first use; a GGUF is converted into JUSTFIT_HOME/models the first time. Repeatable."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Small model with the first --model's tokenizer: it drafts tokens for that model's lone greedy requests (output unchanged), loads and unloads with it, and counts against --memory-budget as a part of it."),
    sessions_max_bytes: Optional[str] = typer.Option(None, "--sessions-max-bytes", metavar="SIZE", envvar="JUSTFIT_SESSIONS_MAX_BYTES", help="Disk quota for persisted sessions (e.g. 2GB): after a checkpoint over it, the least recently used unpinned sessions no process has open are removed (as `justfit sessions gc --max-bytes`)."),
):
    """Serve the model over the OpenAI HTTP API (chat and text completions, tools, JSON output, sessions).

    Under `mlx.launch -n N`, rank 0 serves and every rank runs the same batching engine, rank 0 leading
    (--idle-release is single-process only; docs/distributed.md).
    """
    from .config import KVConfig
    from .phaseswap import parse_budget
    from .runtime import Runtime
    from .server.app import check_bind, serve as run_server

    from .distributed import launched

    from .statetrans.quota import parse_size

    check_bind(host, api_key)
    _check_port(host, port)
    quota = None if sessions_max_bytes is None else parse_size(sessions_max_bytes, "--sessions-max-bytes")
    if launched() and idle_release:  # under mlx.launch every rank runs this command
        raise UserError("--idle-release is not supported under mlx.launch yet (the ranks would release at different times)")
    specs = list(model or ["default"])
    if launched() and (len(specs) > 1 or models_dir):
        raise UserError("serving several models is not supported under mlx.launch yet: give one --model and no --models-dir")
    if launched() and draft_model:
        raise UserError("--draft-model is not supported under mlx.launch yet (the ranks would draft at different times)")
    others = _resolve_models(specs[1:]) + _scan_dirs(models_dir or [])
    fmt = kv_format.value if int(kv_bits.value) == 4 else "affine"
    rt = Runtime(model=specs[0], kv=KVConfig(bits=int(kv_bits.value), format=fmt), memory_budget=parse_budget(memory_budget),
                 draft_model=draft_model)
    rt.index.store.sessions_cap = quota
    options = dict(api_key=api_key, cors=cors, persist=persist, idle_release=idle_release, max_queue=max_queue,
                   max_body=max_body, header_timeout=header_timeout, body_timeout=body_timeout,
                   max_connections=max_connections, max_client_connections=max_client_connections)
    if rt.sharding.world_size > 1:  # rank 0 serves HTTP, the other ranks follow its turns
        from .distributed.serving import run_front

        from .grammar import Constraint
        from .models.vocab import vocab_size

        why = run_front(rt, lambda front: run_server(front, host, port, **options),
                        make_constraint=lambda grammar: Constraint(rt.tokenizer, vocab_size(rt.model), grammar))
        if why:  # a turn may still be stuck inside MLX waiting for the dead rank: exit now
            typer.echo(f"justfit: error: {why}", err=True)
            os._exit(1)
        return
    run_server(rt, host, port, models=others, catalog=True, draft_model=draft_model, **options)


def _resolve_models(specs: List[str]) -> list:
    """(spec, folder) of each extra --model, checked now so a bad one is one line before the server starts."""
    from .models import default_model, resolve

    return [(s, str(default_model()) if s == "default" else resolve(s)) for s in specs]


def _scan_dirs(folders: List[str]) -> list:
    """(name, path) of the models in each --models-dir (GGUF files unconverted until first used)."""
    from .models import scan_models_dir

    return [row for folder in folders for row in scan_models_dir(folder)]


def _check_port(host: str, port: int) -> None:
    """Bind the address once before the model loads, as the server will (SO_REUSEADDR, like uvicorn), so a
    busy port is one line and exit code 2 up front, not a traceback after a minute of loading."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use (another server?); choose one with --port") from None
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None


@models_app.command("list")
def models_list():
    """Models cached under JUSTFIT_HOME/models with their sizes on disk."""
    from .models import list_models

    rows = list_models()
    if not rows:
        typer.echo("no cached models (`justfit models pull default`, or the first `justfit chat`, fetches one)")
    for r in rows:
        typer.echo(f"{r['name']:<48} {_size(r['bytes']):>9}  {r['path']}")
    if len(rows) > 1:
        typer.echo(f"{'total':<48} {_size(sum(r['bytes'] for r in rows)):>9}")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="'default', a .gguf file, an mlx-lm folder or an HF repo id.")):
    """Fetch or convert a model into JUSTFIT_HOME/models (or the HF cache for a repo id) ahead of use."""
    typer.echo(_pull(name))


# What an mlx-lm model folder needs (the files mlx-lm itself fetches).
_HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def _pull(name: str) -> str:
    """'default' or a .gguf: convert into $JUSTFIT_HOME/models; an mlx-lm folder: copy it there;
    an HF repo id: download into the HF cache (where `--model ID` finds it)."""
    import shutil
    from pathlib import Path

    from .config import writable_home
    from .models import default_model, import_gguf, resolve

    if name == "default":
        return str(default_model())
    path = Path(name).expanduser()
    if path.is_file():
        return str(import_gguf(path))
    if path.is_dir():
        resolve(str(path))  # a clear error when it is not a model folder
        dest = writable_home() / "models" / path.resolve().name
        if dest.exists():
            raise UserError(f"{dest} already exists: `justfit models rm {dest.name}` first, or use --model {path}")
        shutil.copytree(path, dest)
        return str(dest)
    repo = resolve(name)  # a cached name comes back as its folder; local-looking misses are errors
    if Path(repo).is_dir():
        return repo
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, allow_patterns=_HF_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated: all things the user can act on
        raise UserError(f"could not download {repo!r} from the Hugging Face hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


@models_app.command("rm")
def models_rm(name: str = typer.Argument(..., help="A name shown by `justfit models list`.")):
    """Remove a cached model folder from JUSTFIT_HOME/models."""
    from .config import home
    from .models import list_models

    rows = {r["name"]: r for r in list_models()}
    asked = name
    if name == "default" and name not in rows:  # what `pull default` and `--model default` fetch
        from .models.default import NAME as name
    if name not in rows:
        known = ", ".join(rows) or "none cached"
        what = repr(asked) + (f" ({name})" if name != asked else "")
        raise UserError(f"no cached model named {what} under {home() / 'models'} (cached: {known})")
    import shutil

    shutil.rmtree(rows[name]["path"])
    typer.echo(f"removed {rows[name]['path']} ({_size(rows[name]['bytes'])})")


@models_app.command("import")
def models_import(path: str = typer.Argument(..., help="A Llama-family .gguf file (Q4_0, Q4_1, Q8_0, F16, F32).")):
    """Convert a GGUF file into a cached mlx-lm model folder (same as `models pull FILE.gguf`)."""
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
    from .kvexec import cpu as cpu_kernel
    from .models import backend, layout
    from .phaseswap.budget import Budget, parse_budget

    be = backend()
    mem = mx.metal.device_info().get("memory_size") if be == "metal" else psutil.virtual_memory().total
    weights = os.environ.get("JUSTFIT_WEIGHTS", "auto")
    if weights == "auto":
        weights = ("auto (as stored + qmm.c where measured faster, else fp32 when it fits in a quarter of RAM)"
                   if be == "cpu" else "auto (as stored)")
    rows = [
        ("backend", be.upper() if be != "metal" else "Metal"),
        ("device memory", f"{mem / 2**30:.1f} GiB"),
        ("available memory", f"{psutil.virtual_memory().available / 2**30:.1f} GiB"),
        ("justfit", __version__), ("mlx", version("mlx")), ("mlx-lm", version("mlx-lm")),
        ("blas", active_blas()), ("weights", weights),
        ("weight layout", "row-major x @ W (CPU decode; JUSTFIT_ROW_MAJOR=0: off)" if layout.enabled() else "as stored"),
        ("JUSTFIT_HOME", str(home())),
        ("memory budget", Budget(parse_budget(os.environ.get("JUSTFIT_MEMORY_BUDGET"))).describe()),
        ("tool sandbox", __import__("justfit_agents.sandbox", fromlist=["describe"]).describe()),  # how agent tools are confined
        ("cpu 4-bit kernel", cpu_kernel.status()),  # kvexec/cpu: decode over 4-bit pages on x86-64 CPUs
    ]
    if be == "cpu":  # models/qmm.c and the speed choices models/tuning.py measured on this machine
        from .models import qmm, tuning

        rows += [("cpu linear kernel", qmm.status()), ("cpu tuning", tuning.describe())]
    for k, v in rows:
        typer.echo(f"{k:<17} {v}")


def _config_defaults(command) -> dict:
    """$JUSTFIT_HOME/config.toml as click's default_map (below flags and env vars); a bad file is a user error."""
    from .userconfig import default_map

    try:
        return default_map(command)
    except UserError as e:
        typer.echo(f"justfit: error: {e}", err=True)
        sys.exit(2)


def _plain_flags(command) -> None:
    """On/off flags show no `<bool>` value in --help: they take none."""
    for p in command.params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    made = command.get_help_option  # --help/-h is made per context, not listed in params

    def help_option(ctx):
        option = made(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for sub in (getattr(command, "commands", None) or {}).values():
        _plain_flags(sub)


def main():
    """Console entry point (OpenBLAS is already loaded by `import justfit`); internal errors exit 1 in one line."""
    from .distributed import quiet_followers

    quiet_followers()  # under mlx.launch only rank 0 prints
    try:
        command = typer.main.get_command(app)
        _plain_flags(command)
        rc = command.main(prog_name="justfit", standalone_mode=False, default_map=_config_defaults(command))
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
