"""Progress on stderr with rich: a bar for counted work, a spinner for a long wait (a long prefill).
Both draw only when stderr is a terminal, so logs, pipes and tests stay clean."""

import sys
import threading
from contextlib import contextmanager


def _console():
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def bar(total: int, label: str):
    """`with bar(n, "converting") as advance: ... advance()`; a transient rich bar on a terminal."""
    if not sys.stderr.isatty():
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=_console(), transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n=1: progress.advance(task, n)


class LateSpinner:
    """A spinner that appears only when a wait outlasts `after` seconds and vanishes when it ends."""

    def __init__(self, label: str, after: float = 2.0):
        self.label, self.after, self.lock = label, after, threading.Lock()
        self.status, self.done, self.timer = None, False, None

    def __enter__(self):
        if sys.stderr.isatty():
            self.timer = threading.Timer(self.after, self._show)
            self.timer.daemon = True
            self.timer.start()
        return self

    def _show(self):
        with self.lock:
            if not self.done:
                self.status = _console().status(self.label)
                self.status.start()

    def stop(self):
        """End the wait (idempotent): cancel the timer, clear the spinner if it is showing."""
        with self.lock:
            self.done = True
            if self.timer is not None:
                self.timer.cancel()
            if self.status is not None:
                self.status.stop()
                self.status = None

    def __exit__(self, *exc):
        self.stop()
