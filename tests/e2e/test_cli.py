"""The justfit CLI: through typer's runner and as a real subprocess with piped stdin."""

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from justfit.cli import app

runner = CliRunner()


def _justfit(args, home, stdin=None, extra_env=None):
    env = dict(os.environ, JUSTFIT_HOME=str(home), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "justfit", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=600)


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("chat", "models", "info", "bench"):
        assert cmd in r.output


def test_info_reports_backend_versions_home(test_home):
    r = runner.invoke(app, ["info"], env={"JUSTFIT_HOME": str(test_home)})
    assert r.exit_code == 0, r.output
    for key in ("backend", "mlx-lm", "blas", "weights", str(test_home)):
        assert key in r.output


def test_models_list_shows_the_cached_default(default_model_dir, test_home):
    r = runner.invoke(app, ["models", "list"], env={"JUSTFIT_HOME": str(test_home)})
    assert r.exit_code == 0
    assert "SmolLM2-135M-Instruct" in r.output and "MB" in r.output


def test_chat_prompt_one_shot(default_model_dir, test_home):
    r = runner.invoke(app, ["chat", "--prompt", "What is the capital of France?", "--max-tokens", "16",
                            "--temp", "0", "--kv-bits", "16"], env={"JUSTFIT_HOME": str(test_home)})
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "tok/s" in r.stderr and "peak" in r.stderr


def test_chat_piped_stdin_subprocess(default_model_dir, test_home):
    r = _justfit(["chat", "--max-tokens", "16", "--kv-bits", "16"], test_home,
                 stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "prompt" in r.stderr.splitlines()[-1]


def test_chat_piped_lines_are_turns_of_one_chat(default_model_dir, test_home):
    """Two piped lines are two turns: the second's prompt holds the first turn (reused from the cache)."""
    r = _justfit(["chat", "--max-tokens", "8", "--json"], test_home,
                 stdin="My name is Ana.\nWhat is my name?\n")
    assert r.returncode == 0, r.stderr
    first, second = [json.loads(line) for line in r.stdout.splitlines()]
    assert second["stats"]["prompt_tokens"] > first["stats"]["prompt_tokens"] + first["stats"]["generated_tokens"]
    assert second["stats"]["reused_tokens"] >= first["stats"]["prompt_tokens"]


def test_chat_repl_commands_via_stdin_script(default_model_dir, test_home):
    # The REPL driven directly through input(): history, /stats, /reset.
    from justfit.chat import repl

    from justfit.turns import TurnStats

    class FakeRT:
        last_stats = TurnStats()

        def stream(self, messages, **opts):
            from justfit.runtime import Chunk

            self.seen = list(messages)
            yield Chunk(f"turns={sum(m['role'] == 'user' for m in messages)}", 1)

    lines = iter(["hi", "again", "/stats", "/reset", "fresh", "/exit"])
    import builtins

    rt = FakeRT()
    orig = builtins.input
    builtins.input = lambda prompt="": next(lines)
    try:
        repl(rt, None, {})
    finally:
        builtins.input = orig
    assert [m["content"] for m in rt.seen if m["role"] == "user"] == ["fresh"]  # /reset cleared history
