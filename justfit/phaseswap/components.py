"""Components: named pieces of a model (or of its state) with a byte size and load/unload.

A weight component is a set of parameter names of the loaded mlx-lm model. Unloading replaces those
parameters with empty arrays, dropping the last reference so MLX can free the buffers; loading reads
them again just in time from the model's safetensors folder (`model.justfit_path`) and applies the same
transforms `justfit.models.load` applied (dequantize to float32 where the model was dequantized, cast
fp16/bf16 to float32 on CPU), so a reloaded tensor is bit-identical to the one released.

Kinds: `embedding`, `lm-head`, `layers` (a group of decoder layers), `norm`, `draft-model`, `adapter`
(LoRA), `kv` (KV pages of a session or cache list). Roles say what a phase needs a component for:
with tied embeddings ONE component (`embed`, one tensor) carries both roles `input-embedding` and
`lm-head`, so releasing the head role never evicts the tensor the input embedding still uses.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ..atomic import atomic_write

ROLES = ("input-embedding", "layers", "norm", "lm-head", "drafter", "adapter", "kv")


@dataclass
class Component:
    """One named, separately loadable piece: its size, roles, dependencies and load/unload hooks."""

    name: str
    kind: str
    nbytes: int
    load: Callable[[], None]
    unload: Callable[[], None]
    roles: Tuple[str, ...] = ()
    depends: Tuple[str, ...] = ()
    resident: bool = True
    releasable: bool = True  # False when it cannot be reloaded exactly (then it is never unloaded)
    checkpointed: Callable[[], bool] = field(default=lambda: False)  # KV: already safe on disk
    last_used: float = field(default_factory=time.monotonic)

    def size(self) -> int:
        """Current bytes (KV components may grow between phases)."""
        return self.nbytes() if callable(self.nbytes) else self.nbytes


def _empty():
    import mlx.core as mx

    return mx.zeros((0,), dtype=mx.float32)


class WeightSource:
    """Reads named parameters of a loaded model back from its mlx-lm folder, transformed as loaded."""

    def __init__(self, model):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from ..models import layout

        self.model = model
        self.path = Path(getattr(model, "justfit_path", "") or "")
        self.params = {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())}
        self.transposed = layout.row_major_names(model)  # stored W^T in memory, W in the folder
        self.files: Dict[str, str] = {}
        config = self.path / "config.json"
        self.quant = json.loads(config.read_text()).get("quantization", {}) if config.exists() else {}
        for f in sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else []:
            for k in mx.load(str(f)):  # lazy: reads the header only
                self.files[k] = str(f)

    def can_reload(self, names: List[str]) -> bool:
        """True when every name is in the folder under the same name (mlx-lm sanitize kept it)."""
        return bool(self.files) and all(n in self.files for n in names)

    def fetch(self, names: List[str]) -> List[tuple]:
        """[(name, array)] read from disk and transformed exactly as justfit.models.load did."""
        import mlx.core as mx

        out, opened = [], {}
        for name in names:
            f = self.files[name]
            if f not in opened:
                opened[f] = mx.load(f)  # lazy; dropped at return so nothing keeps the file's arrays
            tensors = opened[f]
            arr = tensors[name]
            base = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and f"{base}.scales" in tensors and f"{base}.scales" not in self.params:
                q = {**self.quant, **self.quant.get(base, {})}
                arr = mx.dequantize(arr, tensors[f"{base}.scales"], tensors.get(f"{base}.biases"),
                                    q.get("group_size", 64), q.get("bits", 4), q.get("mode", "affine"))
            if name in self.transposed:
                arr = mx.contiguous(arr.T)
            shape, dtype = self.params[name]
            if arr.dtype != dtype and arr.dtype in (mx.float16, mx.bfloat16, mx.float32):
                arr = arr.astype(dtype)
            if tuple(arr.shape) != tuple(shape) or arr.dtype != dtype:
                raise RuntimeError(f"reloaded {name} has shape {arr.shape} {arr.dtype}, expected {shape} {dtype}")
            out.append((name, arr))
        return out


# Weight spill files belong to the process that wrote them (`<component>.<pid>.safetensors`): removed
# when it exits, normally or after an error such as a start refused by --memory-budget, and swept by
# the next process if it was killed. So a failed start never leaves half a gigabyte behind.
_SPILL_DIRS: set = set()


def _claim(folder: Path) -> None:
    """First spill into `folder` in this process: create it, sweep dead processes' files, clean at exit."""
    import atexit

    if folder in _SPILL_DIRS:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.safetensors"):
        if not _alive(f):
            f.unlink(missing_ok=True)
    if not _SPILL_DIRS:
        atexit.register(discard_spills)
    _SPILL_DIRS.add(folder)


def _alive(file: Path) -> bool:
    """Whether the process whose pid is in a spill file's name still runs."""
    import os

    parts = file.name.split(".")
    # <component>.<pid>.safetensors, or atomic_write's temp .<component>.<pid>.safetensors.<pid>.<hex>.tmp.safetensors
    field = -4 if file.name.startswith(".") and file.name.endswith(".tmp.safetensors") else -2
    try:
        pid = int(parts[field])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


def discard_spills() -> None:
    """Delete this process's weight spill files (and their folders once empty); runs at exit."""
    import os

    for folder in list(_SPILL_DIRS):
        for f in folder.glob(f"*.{os.getpid()}.*"):
            f.unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:
            pass  # other processes' files are still there
        _SPILL_DIRS.discard(folder)


def spill_folder(model, root) -> Optional[Path]:
    """Where released weights are kept as loaded (float32): root/weights/<hash of the folder's files>.
    A changed model folder gets a new hash, so a stale copy is never read."""
    import hashlib

    path = Path(getattr(model, "justfit_path", "") or "")
    if root is None or not path.is_dir():
        return None
    h = hashlib.sha256(str(path.resolve()).encode())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return Path(root) / "weights" / h.hexdigest()[:16]


def _weight_component(model, source: WeightSource, name: str, kind: str, prefixes: Tuple[str, ...],
                     roles: Tuple[str, ...], spill: Optional[Path] = None) -> Component:
    """A component over every parameter whose name starts with one of `prefixes`. With `spill`, the
    first release writes the tensors as loaded (one read, no dequantize, on reload); else reload
    re-derives them from the model folder."""
    import os

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    names = [k for k in source.params if k.startswith(prefixes)]
    nbytes = sum(_numel(source.params[k][0]) * source.params[k][1].size for k in names)
    file = spill / f"{name.replace('/', '_')}.{os.getpid()}.safetensors" if spill is not None else None

    def unload():
        if file is not None and not file.exists():
            params = dict(tree_flatten(model.parameters()))
            _claim(file.parent)
            # atomic: a torn write never looks like a valid copy
            atomic_write(file, lambda tmp: mx.save_safetensors(str(tmp), {k: params[k] for k in names}))
        model.update(tree_unflatten([(k, _empty()) for k in names]))

    def load():
        arrays = _read_spill(file, names, source.params) if file is not None and file.exists() else None
        arrays = arrays or source.fetch(names)
        mx.eval([a for _, a in arrays])
        model.update(tree_unflatten(arrays))

    return Component(name, kind, nbytes, load, unload, roles=roles, releasable=source.can_reload(names))


def _read_spill(file: Path, names, params):
    """[(name, array)] from a weight spill file, or None when it does not match (then re-derive)."""
    import mlx.core as mx

    try:
        tensors = mx.load(str(file))
    except Exception:
        return None
    if set(tensors) != set(names) or any(tuple(tensors[k].shape) != tuple(params[k][0]) or tensors[k].dtype != params[k][1]
                                         for k in names):
        return None
    return [(k, tensors[k]) for k in names]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _body(model):
    """The decoder stack (embed_tokens, layers, norm) of an mlx-lm model, or None if unrecognized."""
    inner = getattr(model, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return inner
    return None


def tied_embeddings(model) -> bool:
    """True when the LM head reuses the input embedding matrix (no separate lm_head weight)."""
    return _body(model) is not None and getattr(model, "lm_head", None) is None


def model_components(model, prefix: str = "", layers_per_group: int = 6, kind_override: Optional[str] = None,
                     roles_override: Optional[Tuple[str, ...]] = None, spill_root=None) -> List[Component]:
    """Split an mlx-lm model into components: embedding (+ head role when tied), layer groups, norm,
    separate LM head. Unrecognized architectures give one `weights` component with every role.
    `spill_root`: folder for float32 copies of released weights (fast reload), None to re-derive."""
    source = WeightSource(model)
    body = _body(model)
    p = prefix
    spill = spill_folder(model, spill_root)

    def weight_component(*args):
        return _weight_component(*args, spill=spill)

    if body is None or kind_override:
        roles = roles_override or ("input-embedding", "layers", "norm", "lm-head")
        return [weight_component(model, source, f"{p}weights", kind_override or "layers", ("",), roles)]
    tied = tied_embeddings(model)
    embed_roles = ("input-embedding", "lm-head") if tied else ("input-embedding",)
    comps = [weight_component(model, source, f"{p}embed", "embedding", ("model.embed_tokens.",), embed_roles)]
    n = len(body.layers)
    for lo in range(0, n, layers_per_group):
        hi = min(n, lo + layers_per_group)
        prefixes = tuple(f"model.layers.{i}." for i in range(lo, hi))
        comps.append(weight_component(model, source, f"{p}layers.{lo}-{hi - 1}", "layers", prefixes, ("layers",)))
    comps.append(weight_component(model, source, f"{p}norm", "norm", ("model.norm.",), ("norm",)))
    if not tied:
        comps.append(weight_component(model, source, f"{p}lm_head", "lm-head", ("lm_head.",), ("lm-head",)))
    covered = {k for c in comps for k in source.params if k.startswith(_prefixes_of(c, n, layers_per_group))}
    rest = tuple(k for k in source.params if k not in covered)
    if rest:  # anything else (e.g. vision towers) stays pinned with the layers role
        comps.append(Component(f"{p}other", "layers", sum(_numel(source.params[k][0]) * 4 for k in rest),
                               lambda: None, lambda: None, roles=("layers",), releasable=False))
    return comps


def _prefixes_of(c: Component, n_layers: int, per: int) -> Tuple[str, ...]:
    if c.kind == "embedding":
        return ("model.embed_tokens.",)
    if c.kind == "norm":
        return ("model.norm.",)
    if c.kind == "lm-head":
        return ("lm_head.",)
    lo, hi = (int(x) for x in c.name.rsplit(".", 1)[1].split("-"))
    return tuple(f"model.layers.{i}." for i in range(lo, hi + 1))
