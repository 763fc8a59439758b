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
