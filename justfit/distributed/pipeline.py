"""Layer pipelining for mlx-lm llama-family models, plugged in without forking mlx-lm's model file.

mlx-lm pipelines DeepSeek models with `model.model.pipeline(group)` (models/pipeline.py); its llama has
no such method. We do the same split from outside: rank r keeps a contiguous run of layers (rank 0 the
LAST ones, rank N-1 the first, as mlx-lm does), `model.model.layers` becomes that run with its first
layer wrapped to `recv` the hidden state from rank r+1 and its last layer wrapped to `send` it to rank
r-1, then `all_gather` so every rank holds rank 0's final hidden state and computes the same logits.
The LlamaModel loop, its mask and the per-layer caches (one per local layer) are unchanged, so each
rank's KV pool holds only its own layers' KV.
"""

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn


class Stage(nn.Module):
    """One decoder layer with the pipeline's hand-offs around it (receive before, send/gather after)."""

    def __init__(self, layer, group, recv_from: Optional[int] = None, send_to: Optional[int] = None,
                 gather: bool = False):
        super().__init__()
        self.layer = layer
        self._group, self._recv_from, self._send_to, self._gather = group, recv_from, send_to, gather
        self.use_sliding = getattr(layer, "use_sliding", False)  # read by LlamaModel's mask choice

    def __call__(self, x, *args, **kwargs):
        if self._recv_from is not None:  # only the shape and dtype of the local embedding are used
            x = mx.distributed.recv_like(x, self._recv_from, group=self._group)
        h = self.layer(x, *args, **kwargs)
        if self._send_to is not None:
            h = mx.distributed.send(h, self._send_to, group=self._group)
        if self._gather:
            h = mx.distributed.all_gather(h, group=self._group)[: h.shape[0]]
            # Evaluate the hand-offs now: a caller that evaluates only the KV state of a prefill chunk
            # would otherwise skip the send on one rank and leave the next rank waiting in recv.
            mx.eval(h)
        return h


def split_layers(n_layers: int, size: int) -> List[int]:
    """Layers per rank, even split, low ranks take the extra ones (mlx-lm's rule)."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def layer_range(n_layers: int, rank: int, size: int) -> range:
    """Global indices of the layers `rank` runs: rank size-1 the first layers, rank 0 the last."""
    split = split_layers(n_layers, size)
    start = sum(split[rank + 1:])
    return range(start, start + split[rank])


def can_pipeline(model, size: int) -> Optional[str]:
    """None when `model` can be pipelined over `size` ranks, else the reason it cannot."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, list) or not layers:
        return "the model has no model.layers list"
    if len(layers) < size:
        return f"{len(layers)} layers cannot fill {size} pipeline stages"
    if any(getattr(layer, "use_sliding", False) for layer in layers):
        return "sliding-window layers are not supported by the pipeline plug-in"
    if any(isinstance(layer, Stage) for layer in layers):
        return "the model is already pipelined"
    return None


def pipeline(model, group) -> range:
    """Keep only this rank's layers in `model.model.layers`, wrapped with the hand-offs; returns their
    global indices. A one-rank group leaves the model unchanged."""
    rank, size = group.rank(), group.size()
    n = len(model.model.layers)
    keep = layer_range(n, rank, size)
    if size == 1:
        return keep
    reason = can_pipeline(model, size)
    if reason:
        raise ValueError(f"cannot pipeline this model over {size} ranks: {reason}")
    local = model.model.layers[keep.start:keep.stop]
    stages = []
    for i, layer in enumerate(local):
        first, last = i == 0, i == len(local) - 1
        stages.append(Stage(layer, group,
                            recv_from=rank + 1 if first and rank < size - 1 else None,
                            send_to=rank - 1 if last and rank > 0 else None,
                            gather=last))
    model.model.layers = stages  # the dropped layers' weights are freed with their last reference
    return keep
