"""Progress on stderr with rich: a bar for counted work, one that shows up late (long prefills), and a
spinner for work that cannot be counted (a download run by pip). All draw only when stderr is a
terminal, so logs, pipes and tests stay clean."""

import sys
import time
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


@contextmanager
def spinner(label: str):
    """`with spinner("downloading"): ...`: a transient rich spinner with the elapsed time, on a terminal."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=_console(),
                  transient=True) as progress:
        progress.add_task(label, total=None)
        yield


class LateBar:
    """A `progress(done, total)` callback (the engine calls it after each prefill chunk) whose bar
    appears only once the work has taken `after` seconds, so short prefills draw nothing."""

    def __init__(self, label: str, after: float = 2.0):
        self.label, self.after, self.start = label, after, time.perf_counter()
        self.progress, self.task = None, None

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None:
            if done >= total or time.perf_counter() - self.start < self.after or not sys.stderr.isatty():
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), console=_console(), transient=True)
            self.task = self.progress.add_task(self.label, total=total)
            self.progress.start()
        self.progress.update(self.task, completed=done)
        if done >= total:
            self.close()

    def close(self) -> None:
        """Clear the bar if it is showing (idempotent)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
