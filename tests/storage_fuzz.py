"""Fault injection for the session store: damage one on-disk file of a saved session (bytes, fields
with a recomputed checksum, links, deletions), then restore it as a user would and classify the
outcome: recovered (history of the last or previous commit, K/V matching a fresh recompute),
refused (one-line UserError), crash (any other exception), lost (history silently gone) or wrong
(a history or K/V that was never committed)."""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from justfit.errors import UserError

WRONG_VALUES = [None, "x", -1, 2**31, 10**12, [], {}, 1.5, True, [[1]], ["a"], {"a": 1}, "", 0]
FIELDS = ["name", "model_fingerprint", "tokenizer_fingerprint", "kv", "kv.page_size", "kv.bits", "kv.name",
          "tokens", "tokens.0", "tokens.-1", "pages", "pages.0", "pages.0.hash", "pages.0.sha256", "pages.-1.hash",
          "messages", "messages.0", "messages.0.role", "messages.0.content", "messages.-1.end", "created", "parent",
          "model", "updated", "open_page", "open_page.tokens", "open_page.hash"]
BYTE_KINDS = ["truncate", "bitflip", "zero", "append", "empty", "random", "delete"]


def _resign(doc: dict) -> bytes:
    """A manifest document with a valid checksum again (an edit a checksum cannot catch)."""
    doc.pop("checksum", None)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    doc["checksum"] = hashlib.sha256(body.encode()).hexdigest()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _set(doc, dotted: str, value):
    keys = dotted.split(".")
    obj = doc
    for k in keys[:-1]:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    last = keys[-1]
    if isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value


def damage_bytes(path: Path, kind: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes()) if path.exists() else bytearray()
    n = len(data)
    if kind == "truncate" and n:
        data = data[: rng.randrange(n)]
    elif kind == "bitflip" and n:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif kind == "zero" and n:
        a, k = rng.randrange(n), rng.randint(1, 4096)
        data[a:a + k] = bytes(len(data[a:a + k]))
    elif kind == "append":
        data += os.urandom(rng.randint(1, 64))
    elif kind == "empty":
        data = bytearray()
    elif kind == "random":
        data = bytearray(os.urandom(max(1, n)))
    elif kind == "delete":
        path.unlink(missing_ok=True)
        return f"{kind} {path.name}"
    path.write_bytes(bytes(data))
    return f"{kind} {path.name}"


def damage_manifest_field(path: Path, rng: random.Random, vocab: int) -> str:
    doc = json.loads(path.read_bytes())
    choice = rng.random()
    if choice < 0.12:
        doc["model_fingerprint"] = "0" * 16
        what = "wrong model fingerprint"
    elif choice < 0.24:
        bad = rng.choice([vocab, vocab + 1, 2**31 - 1, 2**31, -1, 10**9])
        doc["tokens"][rng.randrange(len(doc["tokens"]))] = bad
        what = f"token id {bad}"
    elif choice < 0.30:
        doc.pop(rng.choice(["kv", "tokens", "pages", "messages", "name"]), None)
        what = "missing field"
    else:
        field, value = rng.choice(FIELDS), rng.choice(WRONG_VALUES)
        try:
            _set(doc, field, value)
        except (IndexError, KeyError, TypeError, ValueError):
            doc[field.split(".")[0]] = value
        what = f"{field}={value!r}"
    path.write_bytes(_resign(doc))
    return f"edit {path.name}: {what}"


def damage_links(home: Path, name: str, rng: random.Random) -> str:
    s = home / "sessions" / f"{name}.json"
    kind = rng.choice(["loop", "dir", "delete-current", "swap-pages", "delete-page"])
    if kind == "loop":
        s.unlink()
        os.symlink(s.name, s)
    elif kind == "dir":
        s.unlink()
        s.mkdir()
    elif kind == "delete-current":
        s.unlink()
    else:
        pages = sorted((home / "store").rglob("*.safetensors"))
        a, b = rng.sample(pages, 2)
        if kind == "swap-pages":
            shutil.copyfile(b, a)
        else:
            a.unlink()
    return kind


def inject(home: Path, name: str, rng: random.Random, vocab: int) -> str:
    """Apply one random fault to a saved session under home; returns what was done."""
    sessions = home / "sessions"
    r = rng.random()
    if r < 0.35:
        target = rng.choice([sessions / f"{name}.json", sessions / f"{name}.prev.json"])
        return damage_manifest_field(target, rng, vocab)
    if r < 0.55:
        return damage_links(home, name, rng)
    pages = sorted((home / "store").rglob("*.safetensors"))
    target = rng.choice(pages + [sessions / f"{name}.json", sessions / f"{name}.prev.json"])
    return damage_bytes(target, rng.choice(BYTE_KINDS), rng)


def classify(open_session, expected, logits_of, tol: float = 1e-3):
    """('recovered'|'refused'|'crash'|'lost'|'wrong', detail). `expected` maps each committed history
    (tuple of token ids) to the reference logits after it; logits_of(session) gives the restored ones."""
    import numpy as np

    try:
        s = open_session()
    except UserError as e:
        text = str(e)
        return ("refused", text) if "\n" not in text and text else ("crash", f"multi-line error {text!r}")
    except Exception as e:  # noqa: BLE001 - anything else is what this harness is for
        return "crash", f"{type(e).__name__}: {e}"
    try:
        hist = tuple(s.tokens)
        if not hist:
            return "lost", "restored an empty session"
        if hist not in expected:
            return "wrong", f"history of {len(hist)} tokens was never committed"
        try:
            got = logits_of(s)
        except UserError as e:
            return "refused", str(e)
        except Exception as e:  # noqa: BLE001
            return "crash", f"{type(e).__name__}: {e}"
        diff = float(np.max(np.abs(got - expected[hist])))
        if diff > tol:
            return "wrong", f"K/V differs from a fresh recompute (max |dlogit| {diff:.3g})"
        return "recovered", f"{len(hist)} tokens, max |dlogit| {diff:.2g}"
    finally:
        try:
            s.close()
        except Exception:  # noqa: BLE001
            pass
