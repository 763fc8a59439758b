"""Stored responses (`store: true`): one JSON file per response under JUSTFIT_HOME/responses, so
`previous_response_id`, GET and DELETE work across server restarts. RESPONSES_STORE.md is the format."""

import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Optional

from ..atomic import atomic_write

log = logging.getLogger("justfit.server")
VERSION = 1
ID_RE = re.compile(r"resp_[0-9a-f]{32}")
MAX_STORED = 1000  # responses kept; the least recently written are removed past it
TTL_S = 30 * 86400  # OpenAI keeps stored responses 30 days; so does JustFit


def new_id() -> str:
    return "resp_" + uuid.uuid4().hex


class ResponseStore:
    """Records {version, id, created_at, session, retention, messages, response} by response id."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, rid: str) -> Optional[Path]:
        """The record's file, or None for a string that is no response id (never a path outside)."""
        return self.folder / f"{rid}.json" if isinstance(rid, str) and ID_RE.fullmatch(rid) else None

    def save(self, record: dict):
        """Write a record whole or not at all, then trim the store to MAX_STORED."""
        atomic_write(self._path(record["id"]), json.dumps({"version": VERSION, **record}, ensure_ascii=False))
        files = sorted(self.folder.glob("resp_*.json"), key=lambda p: p.stat().st_mtime)
        for old in files[:-MAX_STORED]:
            old.unlink(missing_ok=True)

    def load(self, rid: str) -> Optional[dict]:
        """The record, or None when unknown, expired (then removed) or unreadable (logged)."""
        path = self._path(rid)
        if path is None or not path.exists():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("stored response %s is unreadable: %s", rid, e)
            return None
        if record.get("version") != VERSION:
            log.warning("stored response %s has format version %r, not %d", rid, record.get("version"), VERSION)
            return None
        if record.get("created_at", 0) + TTL_S < time.time():
            path.unlink(missing_ok=True)
            return None
        return record

    def delete(self, rid: str) -> bool:
        path = self._path(rid)
        if path is None or not path.exists():
            return False
        path.unlink(missing_ok=True)
        return True
