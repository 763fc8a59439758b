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
    steps = [Step(0, "", ToolCall("run_python", {"code": "x"})), Step(1, "", ToolCall("final_answer", {"answer": "a"}))]
    assert "run_python(...) failed" in unfinished_reason(Result("a", steps, "tool_error"), 8)


def _scripted(tiny, replies, tools):
    """Drive an Agent's loop with the replies given as text instead of the model's (the real tokenizer and
    tool-call syntax parse them), so what the loop decides is exact."""
    from justfit import TurnStats
    from justfit_agents import Agent

    agent = Agent(tiny, tools=tools, tool_choice="required", max_steps=len(replies))
    loop, sent, events = agent._loop("Write and run fizzbuzz.py"), None, []
    replies = iter(replies)
    while True:
        try:
            item = loop.send(sent)
        except StopIteration:
            return events
        if hasattr(item, "kind"):
            events.append(item)
            sent = None
        else:
            sent = (tiny.tokenizer.encode(next(replies), add_special_tokens=False), TurnStats())


def _call(name, **arguments):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _run_python(output: str):
    def run_python(code: str) -> str:
        """Run Python.

        Args:
            code: the source
        """
        return output

    return run_python


def test_answer_after_a_failed_tool_call_is_not_a_finished_task(default_model_dir, tmp_path):
    """A coding agent whose run fails and that then calls final_answer has not reached its goal."""
    from tests.agents_support import TinyRuntime

    tiny = TinyRuntime(default_model_dir, tmp_path)
    events = _scripted(tiny, [_call("run_python", code="fizzbuzz.py"), _call("final_answer", answer="fizzbuzz.py")],
                       [_run_python("NameError: name 'fizzbuzz' is not defined\n[exit code 1]")])
    assert events[-1].result.stopped == "tool_error"
    events = _scripted(tiny, [_call("run_python", code="print(1)"), _call("final_answer", answer="1")],
                       [_run_python("1\n")])
    assert events[-1].result.stopped == "answer"


def test_unfinished_run_prints_no_answer_on_stdout(monkeypatch, tmp_path):
    """`justfit agent run` that did not finish exits 1 and leaves stdout empty: a tool's error is never
    printed where scripts read the answer."""
    import justfit
    from justfit_agents import cli, ready
    from justfit_agents.agent import Event, Result, Step, ToolCall

    steps = [Step(0, "", ToolCall("read_file", {"path": "a"}, "error: SandboxError: no file 'a'")),
             Step(1, "", ToolCall("read_file", {"path": "a"}, "error: SandboxError: no file 'a'"))]
    result = Result(steps[-1].call.result, steps, "repeat", {"steps": 2, "prompt_tokens": 0, "reused_tokens": 0,
                                                              "prefilled_tokens": 0, "turn_s": 0.0, "tool_s": 0.0})

    class Fake:
        def stream(self, task):
            yield Event("done", 1, result.answer, result=result)

    monkeypatch.setattr(justfit, "Runtime", lambda **kw: None)
    monkeypatch.setitem(ready.READY, "files", lambda rt, ws, **kw: Fake())
    r = CliRunner().invoke(cli.app, ["run", "files", "task", "--workspace", str(tmp_path)])
    assert r.exit_code == 1
    assert r.stdout == "", r.stdout
    assert "did not finish: the model repeated the same call read_file" in r.stderr


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
