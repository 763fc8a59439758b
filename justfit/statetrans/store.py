"""Content-addressed page store: one safetensors file per sealed page, written once, atomically.

Layout (FORMAT.md): `$JUSTFIT_HOME/store/<model-fingerprint>/pages/<h[:2]>/<h>.safetensors`, `h` the
page's chained block hash. Every write is temp file -> fsync -> rename -> fsync(dir), so a reader sees
either no file or a whole one; a checksum in the header (and the manifest's file checksum) catches the
rest. No MLX here: arrays are numpy, so crash tests can drive this module in a bare subprocess.
"""

import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import UserError
from ..atomic import atomic_write, fsync_dir  # noqa: F401  (the one helper; re-exported for the store's callers)

PAGE_FORMAT, PAGE_VERSION = "justfit-kv-page", "1"
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32,
          "U8": np.uint8}
TAGS = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
        np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}
ITEMSIZE = {tag: np.dtype(t).itemsize for tag, t in DTYPES.items()}
WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


class CorruptPage(Exception):
    """A page file that is missing, torn or fails its checksum (the caller recomputes from tokens)."""


class StoreWriteError(UserError):
    """The store cannot be written (disk full, read-only): sessions continue in memory."""


def write_error(path, e: OSError) -> StoreWriteError:
    return StoreWriteError(f"cannot write the session store at {path}: {e.strerror or e}; "
                           "the session continues in memory (set JUSTFIT_HOME to a writable disk to persist it)")


def encode_page(tensors: Dict[str, object], metadata: Dict[str, str]) -> bytes:
    """safetensors bytes for named arrays (np arrays, or (uint16 array, 'BF16')); header carries a
    sha256 of the data section as metadata `data_sha256`."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        a = tensors[name]
        tag = None
        if isinstance(a, tuple):
            a, tag = a
        a = np.ascontiguousarray(a)
        tag = tag or TAGS[a.dtype]
        raw = a.tobytes()
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    data = b"".join(chunks)
    meta = dict(metadata, data_sha256=hashlib.sha256(data).hexdigest())
    header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def decode_header(blob, check_data: bool = True) -> Tuple[dict, int]:
    """(header dict, data start) of safetensors bytes (or a read-only mmap), checking structure and the
    data checksum (check_data=False: the caller already matched the whole file's sha256)."""
    if len(blob) < 8:
        raise CorruptPage("truncated (no header)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise CorruptPage("truncated (header longer than file)")
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError:
        raise CorruptPage("unreadable header") from None
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != PAGE_FORMAT or meta.get("version") != PAGE_VERSION:
        raise CorruptPage("not a version-1 JustFit page")
    start, end = 8 + n, 8
    if not all(isinstance(v, str) for v in meta.values()):
        raise CorruptPage("metadata values must be strings")
    for name, e in header.items():
        if not _tensor_entry_ok(e):
            raise CorruptPage(f"bad tensor entry {name!r}")
        lo, hi = e["data_offsets"]
        size = math.prod(e["shape"]) * ITEMSIZE[e["dtype"]]
        if hi - lo != size or lo < 0 or start + hi > len(blob):
            raise CorruptPage(f"tensor {name!r} out of bounds (truncated?)")
        end = max(end, hi)
    if start + end != len(blob):
        raise CorruptPage("file length does not match its header (truncated or extended)")
    if check_data and hashlib.sha256(memoryview(blob)[start:]).hexdigest() != meta.get("data_sha256"):
        raise CorruptPage("checksum mismatch")
    header["__metadata__"] = meta
    return header, start


def _tensor_entry_ok(e) -> bool:
    """A header entry is {"dtype": known tag, "shape": [ints >= 0], "data_offsets": [lo <= hi]} (typed check)."""
    return (isinstance(e, dict) and e.get("dtype") in DTYPES and _ints(e.get("shape")) and len(e["shape"]) <= 8
            and _ints(e.get("data_offsets"), 2) and e["data_offsets"][0] <= e["data_offsets"][1])


def _ints(xs, n=None) -> bool:
    """A list (of n items) of ints in [0, 2^48), bools excluded."""
    return isinstance(xs, list) and (n is None or len(xs) == n) and all(
        type(x) is int and 0 <= x < 2**48 for x in xs)


class PageFile:
    """A verified page file, mapped read-only so its tensors can be read lazily (even if evicted meanwhile)
    from the same pages of the OS cache the verification read: one pass over the file, no staging copy."""

    def __init__(self, mm: mmap.mmap, header: dict, start: int):
        self.mm, self.header, self.start = mm, header, start
        self.meta = header["__metadata__"]

    def names(self):
        return [n for n in self.header if n != "__metadata__"]

    def read(self, name: str):
        """(numpy array, dtype tag) of one tensor: a view of the mapped file (copy it before close())."""
        e = self.header[name]
        lo, hi = e["data_offsets"]
        dtype = np.dtype(DTYPES[e["dtype"]])
        a = np.frombuffer(self.mm, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=self.start + lo)
        return a.reshape(e["shape"]), e["dtype"]

    def close(self):
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # an array still views it: the mapping goes with the last view
                pass
            self.mm = None

    def __del__(self):
        self.close()


class PageStore:
    """The pages of one model fingerprint under `root`, a lock shared with the manifests, a disk cap."""

    def __init__(self, root: Path, lock_path: Path, disk_cap: Optional[int] = None):
        self.root, self.lock_path, self.disk_cap = Path(root), Path(lock_path), disk_cap
        self.sessions_cap: Optional[int] = None  # session quota in bytes (quota.py), run after each commit
        self.known = set()  # hashes this process has seen on disk (skips a stat per checkpoint)

    def path(self, h: str) -> Path:
        return self.root / "pages" / h[:2] / f"{h}.safetensors"

    def has(self, h: str) -> bool:
        if h in self.known:
            return True
        if self.path(h).is_file():
            self.known.add(h)
            return True
        return False

    @contextmanager
    def lock(self):
        """Exclusive inter-process lock (flock) around page commits, manifest commits and eviction."""
        try:
            self.lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise write_error(self.lock_path.parent, e) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def has_valid(self, h: str) -> bool:
        """has(), except that a file this process has not seen yet must be a valid page of hash h: a torn
        or wrong file at the path counts as absent, so the next write replaces it. A page this process
        knows is only checked to still exist (another process may have evicted it: it is written again)."""
        if h in self.known:
            if os.path.exists(self.path(h)):
                return True
            self.known.discard(h)
        if self.valid_sha256(h) is None:
            return False
        self.known.add(h)
        return True

    def write(self, h: str, tensors: Dict[str, object], metadata: Dict[str, str]) -> Tuple[str, int]:
        """Commit one page; (sha256 of the file, bytes written). A file already at the path is kept (0 bytes
        written) only when it is a valid page of hash h; anything else there is replaced."""
        path = self.path(h)
        if os.path.lexists(path):
            sha = self.valid_sha256(h)
            if sha is not None:
                self.known.add(h)
                return sha, 0
        blob = encode_page(tensors, dict(metadata, format=PAGE_FORMAT, version=PAGE_VERSION, block_hash=h))
        try:
            atomic_write(path, blob, self.root / "tmp")
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise write_error(self.root, e) from None
            raise
        self.known.add(h)
        return hashlib.sha256(blob).hexdigest(), len(blob)

    def valid_sha256(self, h: str) -> Optional[str]:
        """sha256 of the file at h's path when it is a whole, checksummed page of hash h; None otherwise
        (missing, torn, damaged, another page's file)."""
        try:
            blob = self.path(h).read_bytes()
            header, _ = decode_header(blob)
        except (OSError, CorruptPage):
            self.known.discard(h)
            return None
        if header["__metadata__"].get("block_hash") != h:
            self.known.discard(h)
            return None
        return hashlib.sha256(blob).hexdigest()

    def open(self, h: str, sha256: Optional[str] = None) -> PageFile:
        """Verify a page in one pass over its bytes and keep it mapped for lazy reads: with the manifest's
        `sha256` of the whole file, that digest (it covers header and data); without one, the header's
        data checksum. Structure and block hash are checked either way; CorruptPage with a short reason."""
        path = self.path(h)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.known.discard(h)
            raise CorruptPage("missing") from None
        except OSError as e:
            raise CorruptPage(f"unreadable ({e.strerror})") from None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CorruptPage("truncated (no header)")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise CorruptPage(f"unreadable ({e})") from None
        finally:
            os.close(fd)  # the mapping keeps the file's pages
        try:
            if sha256 is not None and hashlib.sha256(mm).hexdigest() != sha256:
                raise CorruptPage("checksum mismatch")
            header, start = decode_header(mm, check_data=sha256 is None)
            if header["__metadata__"].get("block_hash") != h:
                raise CorruptPage("holds another page")
        except BaseException:
            mm.close()
            raise
        try:
            os.utime(path)  # LRU clock for disk eviction
        except OSError:
            pass
        self.known.add(h)
        pf = PageFile(mm, header, start)
        pf.sha256 = hashlib.sha256(mm).hexdigest() if sha256 is None else sha256
        return pf

    def discard(self, h: str):
        """Remove a page found corrupt so a later checkpoint writes it again (under lock)."""
        try:
            with self.lock():
                self.path(h).unlink(missing_ok=True)
        except (OSError, StoreWriteError):
            pass
        self.known.discard(h)

    def pages(self):
        """[(hash, bytes, mtime)] of every page file on disk."""
        out = []
        for sub in _scandir(self.root / "pages"):
            for e in _scandir(Path(sub.path)):
                if e.name.endswith(".safetensors"):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out.append((e.name[:-len(".safetensors")], st.st_size, st.st_mtime))
        return out

    def usage(self) -> int:
        return sum(n for _, n, _ in self.pages())

    def evict(self, cap: int, keep=()) -> int:
        """Delete least recently used pages not in `keep` until the store holds at most `cap` bytes
        (call under lock()); `keep` may be a callable, asked only when over the cap. Returns bytes freed."""
        pages = sorted(self.pages(), key=lambda p: p[2])
        total, freed = sum(n for _, n, _ in pages), 0
        if total <= cap:
            return 0
        keep = set(keep() if callable(keep) else keep)
        for h, n, _ in pages:
            if total - freed <= cap:
                break
            if h in keep:
                continue
            try:
                self.path(h).unlink()
            except FileNotFoundError:
                pass
            self.known.discard(h)
            freed += n
        return freed


def _scandir(path: Path):
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
