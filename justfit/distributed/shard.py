"""Choose and apply the sharding of one loaded model over the world: tensor parallel or pipeline.

Tensor parallel (`model.shard(group)`, mlx-lm's own) when the model has it and its query heads, KV heads
and FFN width divide by N: each rank then holds 1/N of every layer and 1/N of the KV heads. Otherwise
pipeline stages of layers (pipeline.py): each rank holds 1/N of the layers and their KV.
`JUSTFIT_SHARDING=tensor|pipeline` forces a choice (an impossible one is a user error).
"""

import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional

from ..errors import UserError
from .world import World, broadcast_seed, world

CHOICES = ("auto", "tensor", "pipeline")


@dataclass
class Sharding:
    """How this rank's model was cut: kind ('single', 'tensor', 'pipeline'), world, and its part."""

    kind: str
    rank: int = 0
    world_size: int = 1
    layers: List[int] = field(default_factory=list)  # global layer indices this rank runs
    kv_heads: int = 0  # KV heads per layer on this rank

    def tag(self) -> str:
        """Short id for fingerprints and file names: '' for one rank, e.g. 'tp2r0', 'pp2r1'."""
        return "" if self.kind == "single" else f"{'tp' if self.kind == 'tensor' else 'pp'}{self.world_size}r{self.rank}"

    def as_dict(self) -> dict:
        return asdict(self)


def _attn(layer):
    return getattr(layer, "self_attn", None) or getattr(layer, "attention", None)


def kv_heads(model) -> int:
    """KV heads per layer as the model computes them now (after any sharding)."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    layer = getattr(layers[0], "layer", layers[0])  # a pipeline Stage wraps the layer
    attn = _attn(layer)
    return int(getattr(attn, "n_kv_heads", 0) or getattr(attn, "num_key_value_heads", 0))


def can_tensor(model, size: int) -> Optional[str]:
    """None when mlx-lm's `model.shard` can split this model over `size` ranks, else why not."""
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm's {type(model).__module__.rsplit('.', 1)[-1]} has no shard()"
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        attn, mlp = _attn(layer), getattr(layer, "mlp", None)
        heads = (getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None))
        if None in heads:
            return "the attention's head counts are not known"
        if any(h % size for h in heads):
            return f"{heads[0]} query / {heads[1]} KV heads do not divide by {size}"
        width = getattr(getattr(mlp, "gate_proj", None), "weight", None)
        if width is not None and width.shape[0] % size:
            return f"the FFN width {width.shape[0]} does not divide by {size}"
    return None


def choose(model, size: int, forced: str = "auto") -> str:
    """'single', 'tensor' or 'pipeline' for `size` ranks; a forced choice that cannot work is a UserError."""
    if forced not in CHOICES:
        raise UserError(f"JUSTFIT_SHARDING must be one of {', '.join(CHOICES)}, not {forced!r}")
    if size == 1:
        return "single"
    from . import pipeline as pipe

    why_not = {"tensor": can_tensor(model, size), "pipeline": pipe.can_pipeline(model, size)}
    if forced != "auto":
        if why_not[forced]:
            raise UserError(f"cannot shard this model {forced}-parallel over {size} ranks: {why_not[forced]}")
        return forced
    for kind in ("tensor", "pipeline"):
        if not why_not[kind]:
            return kind
    raise UserError(f"cannot shard this model over {size} ranks: tensor parallel: {why_not['tensor']}; "
                    f"pipeline: {why_not['pipeline']}")


def shard_model(model, group=None, kind: Optional[str] = None) -> Sharding:
    """Cut `model` in place for this rank of `group` (default: the launched world) and agree on a
    sampling seed; one process leaves the model untouched. Returns what this rank holds.
    Each shard gets its own model fingerprint (whole model's + tag), so StateTrans keeps its pages apart
    and a 1-rank run never restores a shard's pages, nor the reverse."""
    import mlx.core as mx

    w = world() if group is None else World(group, group.rank(), group.size())
    n_layers = len(model.model.layers) if hasattr(model, "model") else len(model.layers)
    kind = choose(model, w.size, kind or os.environ.get("JUSTFIT_SHARDING", "auto"))
    layers = list(range(n_layers))
    if kind != "single":
        from ..statetrans.hashing import model_fingerprint

        base = model_fingerprint(model)  # of the whole model, before the cut
    if kind == "tensor":  # mlx-lm's sharding cuts nn.Linear weights [out, in]: back to that layout for the cut
        from ..models import layout

        restore = layout.standard(model)
        model.shard(w.group)
        if restore:
            layout.row_major(model)
    elif kind == "pipeline":
        from .pipeline import pipeline

        layers = list(pipeline(model, w.group))
    if kind != "single":
        mx.eval(model.parameters())
        broadcast_seed(w)
        model.justfit_fingerprint = f"{base}-{Sharding(kind, w.rank, w.size).tag()}"
    return Sharding(kind, w.rank, w.size, layers, kv_heads(model))
