"""Where models live: resolve a --model spec to an mlx-lm folder, converting GGUF files once."""

import hashlib
import json
from pathlib import Path
from typing import Optional

from ..config import home as home_dir
from ..config import writable_home
from ..errors import UserError
from . import default


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def models_dir(home: Optional[Path] = None) -> Path:
    return home_dir(home) / "models"


def gguf_cache_name(path) -> str:
    """Cache name for a GGUF: its stem plus a short hash of size and first/last MiB."""
    path = Path(path)
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{path.stem}-{h.hexdigest()[:10]}"


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def import_gguf(path, home=None, log=_log) -> Path:
    """Convert a GGUF into $JUSTFIT_HOME/models/ unless already there; return the folder."""
    from .convert import convert_gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"no such GGUF file: {path}")
    out = writable_home(home) / "models" / gguf_cache_name(path)
    if is_model_folder(out):
        return out
    return convert_gguf(path, out, log=log)


def default_model(home=None, log=_log) -> Path:
    """The default model's folder, downloading and converting it on first use."""
    from .convert import convert_gguf

    import fcntl

    out = models_dir(home) / default.NAME
    if is_model_folder(out):
        return out
    root = writable_home(home)
    (root / "downloads").mkdir(parents=True, exist_ok=True)
    with open(root / "downloads" / ".default.lock", "w") as lock:  # one process fetches; the others wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_model_folder(out):
            return out
        gguf = default.fetch_default_gguf(root / "downloads", log)
        try:
            return default.record_source(convert_gguf(gguf, out, log=log))  # records the verified source's sha256
        finally:
            gguf.unlink(missing_ok=True)


def resolve(spec: str, home=None, log=_log) -> str:
    """Turn 'default', a folder, a .gguf file or an HF repo id into something mlx_lm.load accepts."""
    if spec in (None, "", "default"):
        return str(default_model(home, log))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not is_model_folder(path):
            raise UserError(f"{path} is not a model folder (no config.json and *.safetensors)")
        return str(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"{path} is not a model: pass an mlx-lm folder, a .gguf file or an HF repo id")
        return str(import_gguf(path, home, log))
    cached = models_dir(home) / spec
    if is_model_folder(cached):
        return str(cached)
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") != 1
    if looks_local:
        raise UserError(f"no such model file or folder: {spec}")
    return spec  # an HF repo id; mlx-lm downloads it where the hub is reachable


def list_models(home=None) -> list:
    """Cached models: name, size in bytes, path."""
    root = models_dir(home)
    rows = []
    for folder in sorted(root.glob("*")) if root.is_dir() else []:
        if is_model_folder(folder):
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            info = folder / "justfit.json"
            source = json.loads(info.read_text()).get("source", "") if info.is_file() else ""
            rows.append({"name": folder.name, "bytes": size, "path": str(folder), "source": source})
    return rows


def scan_models_dir(folder) -> list:
    """(name, path) of every model in `folder`: each mlx-lm folder by its name, each .gguf file by its stem
    (left unconverted: a server converts it into the cache on first use)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"--models-dir {folder}: no such folder")
    rows = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and is_model_folder(path):
            rows.append((path.name, str(path)))
        elif path.is_file() and path.suffix.lower() == ".gguf":
            rows.append((path.stem, str(path)))
    return rows
