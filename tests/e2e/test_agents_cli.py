"""`justfit agent run`: mistakes are one-line user errors before any model loads; no MLX at import."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tests.agents_support import AGENTS
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


def test_unfinished_runs_give_a_reason():
    from justfit_agents.agent import Result, Step, ToolCall
    from justfit_agents.cli import unfinished_reason

    steps = [Step(0, "", ToolCall("read_file", {"path": "a"}))]
    assert unfinished_reason(Result("42", steps, "answer"), 8) == ""
    assert "within 8 steps" in unfinished_reason(Result("", steps, "max_steps"), 8)
    assert "repeated the same call read_file" in unfinished_reason(Result("x", steps, "repeat"), 8)
    assert "token limit" in unfinished_reason(Result("", steps, "length"), 8)


def test_agent_that_did_not_finish_exits_1_with_the_reason(default_model_dir, test_home, tmp_path):
    """The files agent must call a real tool first, so one step can never be an answer."""
    import os

    (tmp_path / "main.py").write_text("def main():\n    print('hi')\n")
    env = dict(os.environ, JUSTFIT_HOME=str(test_home))
    r = subprocess.run([sys.executable, "-m", "justfit", "agent", "run", "files", "Which file defines main?",
                        "--workspace", str(tmp_path), "--max-steps", "1", "--kv-bits", "16"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr
    assert "did not finish: no final answer within 1 steps" in r.stderr.splitlines()[-1]
