"""Session manifests: one JSON file per session under $JUSTFIT_HOME/sessions/ (FORMAT.md).

A manifest is the committed state of a session: its token ids, the sealed pages that hold their KV
(block hash + file checksum), the model/tokenizer fingerprints and KV format they are valid for, and the
messages to show on resume. Commits are atomic; the previous commit is kept as `<name>.prev.json` so a
damaged manifest falls back one turn instead of losing the session.

A manifest names its session and carries a commit number; a small counter file per session
(`sessions/.commits/<name>`) remembers the last number committed, so a manifest copied in from another
session or an older commit put back in place is refused instead of served as this session's history.
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

MANIFEST_FORMAT, MANIFEST_VERSION = "justfit-session", 2
READABLE_VERSIONS = (1, 2)  # version 1 has no commit number: it reads as commit 0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # used with fullmatch: no trailing newline
HEX64 = re.compile(r"[0-9a-f]{64}")
KV_FIELDS = {"name": str, "bits": int, "format": str, "group_size": int, "page_size": int,
             "quantized_kv_start": int, "page_format_version": int}
MAX_ID = 2**31 - 1


class ManifestError(Exception):
    """A manifest file that cannot be trusted (torn, edited, wrong version)."""


def warn(msg: str):
    """One line on stderr: something was lost or refused but the session goes on."""
    print(f"justfit: warning: {msg}", file=sys.stderr, flush=True)


def check_name(name) -> str:
    """A session name safe as a file name: letters, digits, '.', '_', '-', not starting with '.'."""
    if not isinstance(name, str) or "\x00" in name or not NAME_RE.fullmatch(name) or name.endswith((".prev", ".tmp")):
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
    commit: int = 0  # commits of this session so far, this one included (monotonic, see commit_counter)

    def to_bytes(self) -> bytes:
        doc = dict(asdict(self), format=MANIFEST_FORMAT, version=MANIFEST_VERSION)
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        doc["checksum"] = hashlib.sha256(body.encode()).hexdigest()
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, blob: bytes, vocab_size: Optional[int] = None) -> "Manifest":
        """Parse and check a manifest: checksum, version, then every field's type and range (FORMAT.md);
        ManifestError for anything else, so a damaged file is recovered from, never an internal error."""
        try:
            doc = json.loads(blob)
            checksum = doc.pop("checksum")
        except (ValueError, KeyError, AttributeError, TypeError, RecursionError):
            raise ManifestError("unreadable JSON") from None
        body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        if hashlib.sha256(body.encode()).hexdigest() != checksum:
            raise ManifestError("checksum mismatch")
        version = doc.pop("version", None)
        if doc.pop("format", None) != MANIFEST_FORMAT or not _is_type(version, int) or version not in READABLE_VERSIONS:
            raise ManifestError(f"not a version-{MANIFEST_VERSION} JustFit session manifest")
        if version == 1 and "commit" in doc:
            raise ManifestError("bad field commit (not in version 1)")
        try:
            m = cls(**doc)
        except TypeError as e:
            raise ManifestError(f"bad fields ({e})") from None
        m.check(vocab_size)
        return m

    def check(self, vocab_size: Optional[int] = None):
        """Explicit type and range checks of every field; ManifestError naming the first bad one."""
        _expect(isinstance(self.name, str) and NAME_RE.fullmatch(self.name) is not None, "name")
        for f in ("model_fingerprint", "tokenizer_fingerprint", "model"):
            _expect(isinstance(getattr(self, f), str), f)
        _expect(self.parent is None or isinstance(self.parent, str), "parent")
        _expect(_is_type(self.commit, int) and 0 <= self.commit < 2**62, "commit")
        for f in ("created", "updated"):
            v = getattr(self, f)
            _expect(_is_num(v) and v == v and abs(v) < 1e12, f)
        _expect(isinstance(self.kv, dict), "kv")
        for k, t in KV_FIELDS.items():  # page_size is needed here; the rest is compared with the runtime's
            _expect((k != "page_size" and k not in self.kv) or _is_type(self.kv.get(k), t), f"kv.{k}")
        _expect(self.kv["page_size"] > 0, "kv.page_size")
        _expect(isinstance(self.tokens, list), "tokens")
        limit = MAX_ID + 1 if vocab_size is None else vocab_size
        bad = next((i for i, t in enumerate(self.tokens) if not (_is_type(t, int) and 0 <= t < limit)), None)
        _expect(bad is None, "tokens", f"item {bad} is {self.tokens[bad]!r}" if bad is not None else "",
                "outside the vocabulary" if vocab_size is not None else "")
        _expect(isinstance(self.pages, list) and len(self.pages) <= len(self.tokens) // self.kv["page_size"],
                "pages", "more pages than tokens")
        for i, p in enumerate(self.pages):
            _expect(isinstance(p, dict) and isinstance(p.get("hash"), str) and HEX64.fullmatch(p["hash"]) is not None
                    and (p.get("sha256") is None or isinstance(p["sha256"], str) and HEX64.fullmatch(p["sha256"])),
                    f"pages[{i}]")
        op = self.open_page
        _expect(op is None or isinstance(op, dict) and isinstance(op.get("hash"), str)
                and HEX64.fullmatch(op["hash"]) is not None
                and (op.get("sha256") is None or isinstance(op["sha256"], str) and HEX64.fullmatch(op["sha256"]))
                and _is_type(op.get("tokens"), int) and 0 < op["tokens"] < self.kv["page_size"], "open_page")
        _expect(isinstance(self.messages, list), "messages")
        for i, msg in enumerate(self.messages):
            _expect(isinstance(msg, dict) and isinstance(msg.get("role"), str)
                    and (msg.get("content") is None or isinstance(msg.get("content"), (str, list)))
                    and _is_type(msg.get("end"), int) and 0 <= msg["end"] <= len(self.tokens), f"messages[{i}]")


def _is_type(v, t) -> bool:
    return isinstance(v, t) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _expect(ok: bool, field: str, *detail: str):
    if not ok:
        raise ManifestError(f"bad field {field}" + "".join(f" ({d})" for d in detail if d))


def counter_path(home: Path, name: str) -> Path:
    return sessions_dir(home) / ".commits" / check_name(name)


def commit_counter(home: Path, name: str) -> int:
    """The last commit number made of this session (0: none recorded, or the file is unreadable).
    It lives beside, not inside, the manifests, so putting back an older manifest does not roll it back."""
    try:
        text = counter_path(home, name).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if text.isdigit() and len(text) < 19 else 0


def _record_commit(home: Path, name: str, n: int):
    """Write the counter after its manifest is durable (no fsync of its own: a counter lost in a crash
    only lags one commit behind, which the readers accept; it is never ahead of the manifest)."""
    path = counter_path(home, name)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{n}\n", "ascii")
        os.rename(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the manifest is committed: a missing counter only weakens the check


def write_manifest(home: Path, m: Manifest):
    """Commit a manifest atomically, keeping the previous commit as <name>.prev.json (call under lock).
    Its commit number goes past both the one it was read with and the session's counter."""
    path = manifest_path(home, m.name)
    m.updated = time.time()
    m.commit = max(m.commit, commit_counter(home, m.name)) + 1
    tmp_dir = sessions_dir(home) / ".tmp"
    if path.exists():
        backup = tmp_dir / f"{path.name}.{os.getpid()}.prev"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        backup.unlink(missing_ok=True)
        try:
            os.link(path, backup)  # the current commit stays in place until the new one replaces it
            os.rename(backup, _prev_path(path))
        finally:
            backup.unlink(missing_ok=True)  # no partial file left when the disk is full or read-only
    atomic_write(path, m.to_bytes(), tmp_dir)
    _record_commit(home, m.name, m.commit)


def _load(path: Path, name: str, vocab_size: Optional[int], oldest: int) -> Manifest:
    """One manifest file, checked to be this session's and no older than commit `oldest`."""
    m = Manifest.from_bytes(path.read_bytes(), vocab_size)
    if m.name != name:
        raise ManifestError(f"it holds session {m.name!r}, copied in from another session")
    if m.commit < oldest:
        raise ManifestError(f"it is commit {m.commit}, but commit {oldest} was made before: an older copy "
                            "was put back")
    return m


def read_manifest(home: Path, name: str, vocab_size: Optional[int] = None) -> Optional[Manifest]:
    """The session's last good commit, or None when it does not exist. A damaged, unreadable or missing
    manifest whose previous commit survives falls back to it with a warning; both damaged: UserError.
    With vocab_size, token ids outside the vocabulary count as damage (never fed to the model). A
    manifest of another session, or older than the session's commit counter, is damage too."""
    path = manifest_path(home, name)
    prev = _prev_path(path)
    last = commit_counter(home, name)
    try:
        return _load(path, name, vocab_size, last)
    except FileNotFoundError:
        if not os.path.lexists(prev):
            return None
        reason = "missing"
    except OSError as e:  # a symlink loop, a folder in its place, no permission
        reason = f"unreadable: {e.strerror or e}"
    except ManifestError as e:
        reason = str(e)
    try:
        m = _load(prev, name, vocab_size, last - 1)
    except (OSError, ManifestError) as e:
        why = f"; {prev.name}: {e}" if os.path.lexists(prev) and isinstance(e, ManifestError) else ""
        raise UserError(f"session {name!r}: manifest {path} is damaged ({reason}) and has no good "
                        f"previous commit{why}; remove it with `justfit sessions rm {name}`") from None
    warn(f"session {name!r}: manifest is damaged ({reason}); resuming from the previous commit {prev.name}")
    return m


def list_manifests(home: Path) -> List[Manifest]:
    """Every readable session manifest under home (damaged ones are skipped)."""
    out = []
    for p in sorted(sessions_dir(home).glob("*.json")):
        if p.name.endswith(".prev.json"):
            continue
        try:
            m = Manifest.from_bytes(p.read_bytes())
        except (OSError, ManifestError):
            continue
        if m.name == p.name[:-len(".json")]:  # a copy of another session's manifest is not a session
            out.append(m)
    return out


def remove_manifest(home: Path, name: str) -> bool:
    """Delete a session's manifest and its backup; False when there was none. The commit counter stays,
    so an old copy of the removed session put back later is still refused."""
    path = manifest_path(home, name)
    found = os.path.lexists(path) or os.path.lexists(_prev_path(path))
    _prev_path(path).unlink(missing_ok=True)  # the backup first: a crash in between never resurrects it
    path.unlink(missing_ok=True)
    return found
