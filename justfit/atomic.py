"""The one atomic-write helper: a file appears whole or not at all, even across a crash or kill -9."""

import os
from pathlib import Path
from typing import Callable, Optional, Union


def fsync_dir(path: Path):
    """Make a rename in `path` durable (best effort: some filesystems refuse fsync on folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Union[str, Path], data: Union[bytes, str, Callable[[Path], None]],
                 tmp_dir: Optional[Path] = None) -> Path:
    """Write `path` all-or-nothing: a temp file (in tmp_dir, default the same folder), fsync, rename,
    fsync the folder. `data` is bytes, text (UTF-8), or a function that writes the temp path itself
    (e.g. mx.save_safetensors). On any error the temp file is removed and the old file stays."""
    path = Path(path)
    tmp_dir = Path(tmp_dir) if tmp_dir is not None else path.parent
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp{path.suffix}"
    try:
        if callable(data):
            data(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        else:
            with open(tmp, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
        path.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
