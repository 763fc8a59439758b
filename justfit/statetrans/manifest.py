"""Session manifests: one JSON file per session under $JUSTFIT_HOME/sessions/ (FORMAT.md).

A manifest is the committed state of a session: its token ids, the sealed pages that hold their KV
(block hash + file checksum), the model/tokenizer fingerprints and KV format they are valid for, and the
messages to show on resume. Commits are atomic; the previous commit is kept as `<name>.prev.json` so a
damaged manifest falls back one turn instead of losing the session.
"""

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from ..errors import UserError
from .store import atomic_write

MANIFEST_FORMAT, MANIFEST_VERSION = "justfit-session", 1
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ManifestError(Exception):
    """A manifest file that cannot be trusted (torn, edited, wrong version)."""


def warn(msg: str):
    """One line on stderr: something was lost or refused but the session goes on."""
    print(f"justfit: warning: {msg}", file=sys.stderr, flush=True)


def check_name(name) -> str:
    """A session name safe as a file name: letters, digits, '.', '_', '-', not starting with '.'."""
    if not isinstance(name, str) or "\x00" in name or not NAME_RE.match(name) or name.endswith((".prev", ".tmp")):
        raise UserError(f"invalid session name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit (no paths)")
    return name


def sessions_dir(home: Path) -> Path:
    return Path(home) / "sessions"


def manifest_path(home: Path, name: str) -> Path:
    return sessions_dir(home) / f"{check_name(name)}.json"


def _prev_path(path: Path) -> Path:
    return path.with_name(path.name[:-len(".json")] + ".prev.json")


@dataclass
class Manifest:
    name: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    kv: dict
    tokens: List[int] = field(default_factory=list)
    pages: List[dict] = field(default_factory=list)  # [{"hash", "sha256", "bytes"}] for tokens[:len*P]
    messages: List[dict] = field(default_factory=list)  # [{"role", "content", "end"}]
    open_page: Optional[dict] = None  # {"hash", "sha256", "tokens"}: the partial last page, full precision
    model: str = ""
    parent: Optional[str] = None
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        doc = dict(asdict(self), format=MANIFEST_FORMAT, version=MANIFEST_VERSION)
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        doc["checksum"] = hashlib.sha256(body.encode()).hexdigest()
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Manifest":
        try:
            doc = json.loads(blob)
            checksum = doc.pop("checksum")
        except (ValueError, KeyError, AttributeError, TypeError):
            raise ManifestError("unreadable JSON") from None
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        if hashlib.sha256(body.encode()).hexdigest() != checksum:
            raise ManifestError("checksum mismatch")
        if doc.pop("format", None) != MANIFEST_FORMAT or doc.pop("version", None) != MANIFEST_VERSION:
            raise ManifestError("not a version-1 JustFit session manifest")
        try:
            m = cls(**doc)
        except TypeError as e:
            raise ManifestError(f"bad fields ({e})") from None
        if len(m.pages) > len(m.tokens) // int(m.kv["page_size"]):
            raise ManifestError("more pages than tokens")
        return m


def write_manifest(home: Path, m: Manifest):
    """Commit a manifest atomically, keeping the previous commit as <name>.prev.json (call under lock)."""
    path = manifest_path(home, m.name)
    m.updated = time.time()
    tmp_dir = sessions_dir(home) / ".tmp"
    if path.exists():
        backup = tmp_dir / f"{path.name}.{os.getpid()}.prev"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        backup.unlink(missing_ok=True)
        os.link(path, backup)  # the current commit stays in place until the new one replaces it
        os.rename(backup, _prev_path(path))
    atomic_write(path, m.to_bytes(), tmp_dir)


def read_manifest(home: Path, name: str) -> Optional[Manifest]:
    """The session's last good commit, or None when it does not exist; a damaged manifest falls back to
    the previous commit with a warning, and to a UserError when both are damaged."""
    path = manifest_path(home, name)
    if not path.exists():
        return None
    try:
        return Manifest.from_bytes(path.read_bytes())
    except ManifestError as e:
        reason = str(e)
    prev = _prev_path(path)
    try:
        m = Manifest.from_bytes(prev.read_bytes())
    except (OSError, ManifestError):
        raise UserError(f"session {name!r}: manifest {path} is damaged ({reason}) and has no good "
                        f"previous commit; remove it with `justfit sessions rm {name}`") from None
    warn(f"session {name!r}: manifest is damaged ({reason}); resuming from the previous commit")
    return m


def list_manifests(home: Path) -> List[Manifest]:
    """Every readable session manifest under home (damaged ones are skipped)."""
    out = []
    for p in sorted(sessions_dir(home).glob("*.json")):
        if p.name.endswith(".prev.json"):
            continue
        try:
            out.append(Manifest.from_bytes(p.read_bytes()))
        except (OSError, ManifestError):
            continue
    return out


def remove_manifest(home: Path, name: str) -> bool:
    """Delete a session's manifest and its backup; False when there was none."""
    path = manifest_path(home, name)
    found = path.exists()
    path.unlink(missing_ok=True)
    _prev_path(path).unlink(missing_ok=True)
    return found
