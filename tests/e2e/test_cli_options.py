"""What a newcomer meets on the command line: --version, -h everywhere, sampling flags, --json, the config
file and its precedence, `models pull|list|rm`, and one-line errors for the inputs that used to leak."""

import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from justfit.cli import app, sampling_options

runner = CliRunner()


def _run(args, home, env=None):
    """The real console entry point (config file, error handling) in a subprocess."""
    full = dict(os.environ, JUSTFIT_HOME=str(home), **(env or {}))
    return subprocess.run([sys.executable, "-m", "justfit", *args], env=full, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)


def _commands(command, path=()):
    yield path
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _commands(sub, path + (name,))


def test_version_and_short_help_on_every_command():
    from justfit import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"justfit {__version__}"
    paths = list(_commands(typer.main.get_command(app)))
    assert ("models", "pull") in paths and ("agent", "run") in paths and ("bench", "kv") in paths
    for path in paths:
        r = runner.invoke(app, [*path, "-h"])
        assert r.exit_code == 0 and "Usage" in r.output, (path, r.output)


@pytest.mark.parametrize("args, message", [
    (["--seed", "-2"], "--seed"),
    (["--prompt", "  "], "--prompt is empty"),
    (["--kv-bits", "8", "--kv-format", "rotated"], "rotated is 4-bit only"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "2"], "--min-p"),
    (["--repetition-penalty", "0.5"], "--repetition-penalty"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),  # the engine's own check, run before loading
])
def test_bad_chat_options_are_one_line_errors(tmp_path, args, message):
    r = _run(["chat", "-p", "hi", *args] if "--prompt" not in args else ["chat", *args], tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "models").exists()  # rejected before any model was fetched


def test_sampling_options_follow_the_engine_contract():
    opts = sampling_options(16, 0.0, 1.0, 0, 0.0, 1.0, None, None)
    assert opts == dict(max_tokens=16, temperature=0.0, top_p=1.0, seed=None)  # filters that are off stay out
    opts = sampling_options(16, 0.7, 0.9, 40, 0.05, 1.1, ["\n\n"], 7)
    assert opts == dict(max_tokens=16, temperature=0.7, top_p=0.9, seed=7, top_k=40, min_p=0.05,
                        repetition_penalty=1.1, stop=["\n\n"])


def test_config_file_errors_name_the_file_and_key(tmp_path):
    (tmp_path / "config.toml").write_text("[chat]\ntmep = 0.5\n")
    r = _run(["chat", "-p", "hi"], tmp_path)
    assert r.returncode == 2 and "config.toml: [chat] has no option 'tmep'" in r.stderr
    (tmp_path / "config.toml").write_text("[chat\n")
    r = _run(["info"], tmp_path)
    assert r.returncode == 2 and "is not valid TOML" in r.stderr


def test_config_file_env_and_flags_precedence(default_model_dir, test_home, tmp_path):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / default_model_dir.name).symlink_to(default_model_dir)
    (home / "config.toml").write_text('[chat]\nmax_tokens = 3\nmodel = "no-such/model/here"\n')
    q = ["chat", "-p", "What is the capital of France?", "--json", "--temp", "0", "--kv-bits", "16"]
    # env (JUSTFIT_MODEL) beats the file's model; the file's max_tokens beats the built-in 512
    r = _run(q, home, env={"JUSTFIT_MODEL": "default"})
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["stats"]["generated_tokens"] == 3 and reply["stopped"] is False and reply["text"]
    # a flag beats both; --seed -1 means "no fixed seed" (llama.cpp's convention), not an error
    r = _run([*q, "--max-tokens", "5", "--seed", "-1"], home, env={"JUSTFIT_MODEL": "default"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["generated_tokens"] == 5
    # without the env var the file's model is used, and named in the error
    r = _run(q, home)
    assert r.returncode == 2 and "no-such/model/here" in r.stderr


def test_models_pull_list_rm(tmp_path):
    from statetrans_util import tiny_model_folder

    folder = tiny_model_folder(tmp_path / "src")
    home = tmp_path / "home"
    env = {"JUSTFIT_HOME": str(home)}
    r = runner.invoke(app, ["models", "pull", str(folder)], env=env)
    assert r.exit_code == 0, r.output
    assert (home / "models" / folder.name / "config.json").is_file()
    r = runner.invoke(app, ["models", "list"], env=env)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert folder.name in r.output and f"{size / 1e6:.1f} MB" in r.output
    r = runner.invoke(app, ["models", "pull", str(folder)], env=env)
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(app, ["models", "rm", "nope"], env=env)
    assert r.exit_code == 2 and "no cached model named 'nope'" in r.output and folder.name in r.output
    r = runner.invoke(app, ["models", "rm", folder.name], env=env)
    assert r.exit_code == 0 and not (home / "models" / folder.name).exists()
    r = runner.invoke(app, ["models", "pull", str(tmp_path / "missing.gguf")], env=env)
    assert r.exit_code == 2 and "no such model" in r.output


def test_probe_out_unwritable_fails_before_the_sweep(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = _run(["probe", "--out", str(blocker / "sub"), "--budgets", "2:4:2", "--contexts", "8"], tmp_path)
    assert r.returncode == 2 and "cannot write to output folder" in r.stderr
    assert "loading" not in r.stderr  # nothing was loaded or swept


class _CtrlCAfter:
    """Wraps a runtime: the user presses Ctrl-C after `n` chunks of the reply."""

    def __init__(self, rt, n):
        self.rt, self.n = rt, n

    def stream(self, messages, **opts):
        for i, chunk in enumerate(self.rt.stream(messages, **opts)):
            if i == self.n:
                raise KeyboardInterrupt
            yield chunk

    @property
    def last_stats(self):
        return self.rt.last_stats


def test_stats_after_ctrl_c_shows_the_stopped_turn(runtime16, capsys):
    from justfit.chat import ChatOutput

    out = ChatOutput()
    text = out.reply(runtime16, _CtrlCAfter(runtime16, 4), [{"role": "user", "content": "Count to twenty."}],
                     {"max_tokens": 32})
    assert text and out.last["stopped"] is True
    assert out.last["generated_tokens"] >= 4 and out.last["prompt_tokens"] > 0
    out.show_stats()
    err = capsys.readouterr().err
    assert "stopped by Ctrl-C" in err.splitlines()[-1] and " 0 tok |" not in err.splitlines()[-1]
