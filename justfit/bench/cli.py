"""The `justfit bench` command group; each workload registers one command here."""

import typer

app = typer.Typer(help="Benchmarks against mlx-lm in the same process. --json prints one JSON object.", no_args_is_help=True)

from .agent import agent  # noqa: E402
from .batch import batch  # noqa: E402
from .chat import chat  # noqa: E402
from .kv import kv  # noqa: E402
from .phases import phases  # noqa: E402
from .scale import scale  # noqa: E402
from .serve import serve  # noqa: E402
from .sessions import sessions  # noqa: E402

app.command("kv")(kv)
app.command("chat")(chat)
app.command("sessions")(sessions)
app.command("phases")(phases)
app.command("agent")(agent)
app.command("batch")(batch)
app.command("serve")(serve)
app.command("scale")(scale)
