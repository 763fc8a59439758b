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
    assert "/reset" in err and "/help" in err and '"""' in err  # the help text, multi-line input included
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


def test_a_triple_quote_block_is_one_multi_line_turn(monkeypatch, capsys):
    rt = FakeRuntime()
    _type(monkeypatch, ['"""', "line one", "  line two", '"""', '"""one line"""', '"""first', 'last"""', "after"])
    repl(rt, None, {})
    assert [p[-1] for p in rt.prompts] == ["line one\n  line two", "one line", "first\nlast", "after"]


def test_ctrl_c_inside_a_block_drops_it(monkeypatch):
    rt = FakeRuntime()
    feed = iter(['"""', "half typed", KeyboardInterrupt, "next"])

    def fake_input(prompt=""):
        item = next(feed, EOFError)
        if isinstance(item, type) and issubclass(item, BaseException):
            raise item
        return item

    monkeypatch.setattr(builtins, "input", fake_input)
    repl(rt, None, {})
    assert [p[-1] for p in rt.prompts] == ["next"]


def test_piped_stdin_is_a_scripted_chat(monkeypatch):
    """`printf 'hi\\nwhat did I say?\\n' | justfit chat`: two turns, the second seeing the first; a block
    spans lines; /reset works as typed; nothing is drawn on stdout but the replies."""
    from typer.testing import CliRunner

    import justfit.runtime
    from justfit.cli import app

    rt = FakeRuntime()
    monkeypatch.setattr(justfit.runtime, "Runtime", lambda **kw: rt)
    r = CliRunner().invoke(app, ["chat"], input='hi\n\nwhat did I say?\n"""\na poem\nin two lines\n"""\n/reset\nnew\n')
    assert r.exit_code == 0, r.output
    assert rt.prompts == [["hi"], ["hi", "what did I say?"], ["hi", "what did I say?", "a poem\nin two lines"],
                          ["new"]]
    assert r.stdout == "ok\n" * 4


def test_piped_stdin_drives_a_session_turn_by_turn(monkeypatch):
    from typer.testing import CliRunner

    import justfit.runtime
    from justfit.cli import app

    rt = FakeRuntime()
    turns = []

    class Session:
        name, tokens, messages, kv_tokens, last_stats = "work", [], [], 0, None

        def stream(self, messages, **kw):
            turns.append([m["content"] for m in messages])
            return rt.stream(messages, **kw)

        def close(self):
            pass

    rt.session = lambda name: Session()
    monkeypatch.setattr(justfit.runtime, "Runtime", lambda **kw: rt)
    r = CliRunner().invoke(app, ["chat", "--session", "work"], input="one\ntwo\n")
    assert r.exit_code == 0, r.output
    assert turns == [["one"], ["two"]]


def test_a_turn_the_runtime_refuses_is_one_line_and_the_chat_goes_on(monkeypatch, capsys):
    """A turn refused with a UserError (the history filled the model's context) is said in one line, is not
    added to the history, and the next turn runs."""
    from justfit.errors import UserError

    class Full(FakeRuntime):
        def stream(self, messages, progress=None, **opts):
            if "long" in messages[-1]["content"]:
                raise UserError("prompt (8200 tokens) + max_tokens (256) exceeds the model's context of 8192 tokens")
            return super().stream(messages, progress, **opts)

    rt = Full()
    _type(monkeypatch, ["hello", "a long paste", "short again"])
    repl(rt, None, {})
    err = capsys.readouterr().err
    assert "exceeds the model's context" in err and "/reset" in err
    assert rt.prompts == [["hello"], ["hello", "short again"]]  # the refused turn left no trace
