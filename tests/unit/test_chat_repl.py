"""The REPL handles its /commands itself: /help lists them, an unknown /command says so, and neither is
ever sent to the model; the banner names the model."""

import builtins
from types import SimpleNamespace

from justfit.chat import repl, session_chat
from justfit.turns import Chunk


class FakeRuntime:
    """Records what reaches the model; replies 'ok'."""

    def __init__(self):
        self.model = SimpleNamespace(justfit_path="/home/u/.cache/justfit/models/SmolLM2-135M-Instruct")
        self.model_spec = "default"
        self.prompts = []
        self.last_stats = None

    def stream(self, messages, progress=None, **opts):
        self.prompts.append([m["content"] for m in messages if m["role"] == "user"])
        yield Chunk("ok", 1)


def _type(monkeypatch, lines):
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


def test_commands_stay_local_and_banner_names_the_model(monkeypatch, capsys):
    rt = FakeRuntime()
    _type(monkeypatch, ["/help", "/nope please", "/stats", "hello", " /not a command", "/exit", "after exit"])
    repl(rt, None, {})
    err = capsys.readouterr().err
    assert [p[-1] for p in rt.prompts] == ["hello", " /not a command"]
    assert "SmolLM2-135M-Instruct" in err.splitlines()[0]
    assert "/reset" in err and "/help" in err  # the help text
    assert "unknown command '/nope'" in err


def test_session_repl_handles_commands_too(monkeypatch, capsys):
    class Session:
        name, tokens, messages, kv_tokens = "work", [], [], 0

        def __init__(self, rt):
            self.rt = rt
            self.last_stats = None

        def stream(self, messages, **kw):
            return self.rt.stream(messages, **kw)

        def close(self):
            pass

    rt = FakeRuntime()
    rt.session = lambda name: Session(rt)
    _type(monkeypatch, ["/help", "/what", "hi"])
    session_chat(rt, "work", None, None, {})
    err = capsys.readouterr().err
    assert [p[-1] for p in rt.prompts] == ["hi"]
    assert "SmolLM2-135M-Instruct" in err and "session 'work'" in err and "unknown command '/what'" in err
