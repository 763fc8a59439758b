"""Progress display: drawn on a terminal only; the spinner shows only for waits longer than its delay."""

import io
import sys
import time

from justfit.progress import LateSpinner, bar


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_late_spinner_only_for_long_waits(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _TTY())
    with LateSpinner("prefilling quick", after=5.0):
        time.sleep(0.05)
    assert "prefilling quick" not in sys.stderr.getvalue()
    with LateSpinner("prefilling slow", after=0.05) as wait:
        time.sleep(0.5)
        wait.stop()
    assert "prefilling slow" in sys.stderr.getvalue()


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
