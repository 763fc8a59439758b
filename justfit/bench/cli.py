"""The `justfit bench` command group; each workload registers one command here."""

import typer

app = typer.Typer(help="Benchmarks against mlx-lm in the same process. --json prints one JSON object.", no_args_is_help=True)

from .sessions import sessions  # noqa: E402

app.command("sessions")(sessions)

from .agent import agent  # noqa: E402

app.command("agent")(agent)
