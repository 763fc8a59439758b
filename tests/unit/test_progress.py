"""Progress display: drawn on a terminal only; the spinner shows only for waits longer than its delay."""

import io
import sys
import time

from justfit.progress import LateBar, bar


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_late_bar_only_for_long_work(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _TTY())
    quick = LateBar("prefilling quick", after=5.0)
    for done in (512, 1024, 1536):
        quick(done, 2048)
    quick.close()
    assert "prefilling quick" not in sys.stderr.getvalue()
    slow = LateBar("prefilling slow", after=0.05)
    slow(512, 2048)
    time.sleep(0.1)
    slow(1024, 2048)  # past the delay: the bar shows from here
    slow(2048, 2048)  # done: it closes itself
    assert "prefilling slow" in sys.stderr.getvalue() and slow.progress is None


def test_bar_draws_on_a_terminal_and_stays_silent_in_a_pipe(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with bar(3, "converting x") as advance:
        for _ in range(3):
            advance()
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", _TTY())
    with bar(3, "converting y") as advance:
        for _ in range(3):
            advance()
    assert "converting y" in sys.stderr.getvalue()


def test_a_watched_lone_prefill_reports_progress_every_few_hundred_tokens():
    """A ~1k-token prompt prefilled alone reports progress before its end (the chat bar appears at the
    first report after 2 s), not only after a 2,048-token chunk that such a prompt never fills."""
    from justfit.engine.scheduler import PREFILL_STEP, PROGRESS_STEP, lone_chunk

    chunks, left = [], 1015
    while left:
        chunks.append(lone_chunk(left, 1015, PROGRESS_STEP))
        left -= chunks[-1]
    assert len(chunks) >= 3 and max(chunks) <= 512, chunks
    assert lone_chunk(1015, 1015) == 1014 and PREFILL_STEP == 2048  # unwatched prefills keep the big chunk

