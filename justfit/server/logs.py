"""Log rate limiting for `justfit serve`: the same warning or error at most a few times a second.

A client that can make the server warn (timeouts, refused connections, a failing accept) could
otherwise grow the log without bound, tracebacks included. Records are "the same" when they share
logger, level and message template; once a key has passed `per_second` records in the current
second, later ones are dropped and counted, and the key's next record that passes says how many were
suppressed. Info records (one per request) are never dropped.
"""

import logging
import time
from typing import Callable, Dict, Tuple

LOG_PER_SECOND = 5


class RateLimit(logging.Filter):
    """A handler filter letting each (logger, level, template) through `per_second` times a second."""

    def __init__(self, per_second: int = LOG_PER_SECOND, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.per_second, self.clock = per_second, clock
        self.keys: Dict[Tuple[str, int, str], list] = {}  # key -> [window start, passed, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now, key = self.clock(), (record.name, record.levelno, str(record.msg))
        window = self.keys.get(key)
        if window is None or now - window[0] >= 1.0:
            suppressed = window[2] if window else 0
            self.keys[key] = [now, 1, 0]
            if len(self.keys) > 1024:  # templates are few; this only bounds a pathological caller
                self.keys = {key: self.keys[key]}
            if suppressed:
                record.msg = f"{record.msg} ({suppressed} similar lines suppressed)"
            return True
        if window[1] < self.per_second:
            window[1] += 1
            return True
        window[2] += 1
        return False


def install(per_second: int = LOG_PER_SECOND) -> RateLimit:
    """Rate-limit every handler of the root logger (uvicorn's and asyncio's records propagate there)."""
    limit = RateLimit(per_second)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
    return limit
