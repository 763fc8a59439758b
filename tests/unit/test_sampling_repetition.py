"""The repetition penalty looks back far enough to catch a repeated sentence, not only the last 20 tokens
(with a 20-token window a greedy long story looped on one paragraph despite the penalty)."""

import pytest

from justfit.engine.sampling import Chooser, Sampling
from justfit.errors import UserError


def test_a_token_from_a_sentence_ago_is_still_penalized():
    import mlx.core as mx

    def logits():  # fresh each time: mlx-lm's processor writes into the array it is given
        return mx.array([[0.0] * 5 + [2.0] + [0.0] * 10])

    seen = [5] + [7] * 60  # token 5 appeared 61 tokens back, as a repeated sentence's first word does
    got = Chooser(Sampling(repetition_penalty=1.1)).logits(logits(), seen)
    assert got[0, 5].item() == pytest.approx(2.0 / 1.1)
    far = [5] + [7] * 400  # beyond the window it is left alone
    assert Chooser(Sampling(repetition_penalty=1.1)).logits(logits(), far)[0, 5].item() == pytest.approx(2.0)


def test_the_window_is_checked():
    with pytest.raises(UserError, match="repetition_window"):
        Sampling(repetition_penalty=1.1, repetition_window=0)


def test_the_frequency_penalty_counts_every_repeat_in_the_window():
    import mlx.core as mx

    seen = [5, 9, 5, 9, 5] + [7] * 60  # a phrase said three times, a sentence ago
    got = Chooser(Sampling(frequency_penalty=0.5)).logits(mx.array([[0.0] * 5 + [2.0] + [0.0] * 10]), seen)
    assert got[0, 5].item() == pytest.approx(2.0 - 3 * 0.5)


def test_chat_uses_both_penalties_by_default(monkeypatch):
    """A count-based penalty beside the multiplicative one: with the latter alone a phrase whose tokens were
    all penalized alike went on looping ('a dragon, a dragon, ...')."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import justfit.runtime
    from justfit.cli import app
    from justfit.turns import Chunk

    seen = {}

    class FakeRuntime:
        model, last_stats = SimpleNamespace(justfit_path="m"), None

        def stream(self, messages, progress=None, **opts):
            seen.update(opts)
            yield Chunk("ok", 1)

    monkeypatch.setattr(justfit.runtime, "Runtime", lambda **kw: FakeRuntime())
    r = CliRunner().invoke(app, ["chat", "-p", "Write a long story about a dragon"])
    assert r.exit_code == 0, r.output
    assert seen["repetition_penalty"] == 1.1 and seen["frequency_penalty"] == 0.1
    seen.clear()
    CliRunner().invoke(app, ["chat", "-p", "hi", "--frequency-penalty", "0", "--repetition-penalty", "1"])
    assert "frequency_penalty" not in seen and "repetition_penalty" not in seen  # both off
