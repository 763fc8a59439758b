"""`justfit agent run`: mistakes are one-line user errors before any model loads; no MLX at import."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from .agents_support import AGENTS
from justfit.errors import UserError


def test_cli_module_does_not_import_mlx():
    code = f"import sys; sys.path.insert(0, {str(AGENTS)!r}); import justfit_agents.cli; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("args,msg", [(["nope", "task"], "no ready agent 'nope'"),
                                      (["files", "task", "--workspace", "/no/such/dir"], "is not a folder")])
def test_cli_user_errors(args, msg):
    from justfit_agents.cli import app

    result = CliRunner().invoke(app, ["run", *args])
    assert isinstance(result.exception, UserError) and msg in str(result.exception)


def test_cli_help_lists_options():
    from justfit_agents.cli import app

    root = typer.Typer()
    root.add_typer(app, name="agent")
    out = CliRunner().invoke(root, ["agent", "run", "--help"]).output
    assert "--workspace" in out and "--session" in out and "--allow" in out
