"""Rank and world of this process (mx.distributed, ring backend) and rank 0's decisions broadcast to all.

Every rank runs the same front with the same inputs; what must be identical everywhere (prompt token
ids, the sampling seed, stop) is decided on rank 0 and sent with collectives: an `all_sum` of an int
array that is zero on every rank but rank 0 is a broadcast. No transport of our own.
"""

import os
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

LAUNCH_ENV = ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass(frozen=True)
class World:
    """This process's place in the distributed group: rank 0 is the front (CLI / HTTP), others follow."""

    group: object  # mx.distributed.Group; None in a single process
    rank: int
    size: int

    @property
    def is_front(self) -> bool:
        return self.rank == 0


_WORLD: Optional[World] = None


def launched() -> bool:
    """True when a launcher (mlx.launch, mpirun) started this process as one of several ranks
    (`mlx.launch -n 1` writes an empty ring hostfile: one rank, nothing to join)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile is not None:
        return bool(hostfile) and os.path.isfile(hostfile) and os.path.getsize(hostfile) > 2
    return any(k in os.environ for k in LAUNCH_ENV)


def world() -> World:
    """The process-wide World: mx.distributed.init(backend="ring") under mlx.launch, else one rank."""
    global _WORLD
    if _WORLD is None:
        import mlx.core as mx

        if not launched():  # one process: no group at all (MLX would still parse an empty hostfile)
            _WORLD = World(None, 0, 1)
            return _WORLD
        backend = os.environ.get("JUSTFIT_DISTRIBUTED_BACKEND", "ring" if "MLX_HOSTFILE" in os.environ else "any")
        group = mx.distributed.init(backend=backend)
        _WORLD = World(group, group.rank(), group.size())
    return _WORLD


def broadcast_ints(values: Optional[Sequence[int]], w: Optional[World] = None) -> List[int]:
    """Rank 0's list of ints on every rank (others pass anything; their values are ignored)."""
    import mlx.core as mx

    w = w or world()
    if w.size == 1:
        return list(values)
    mine = list(values) if w.is_front else []
    n = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int32), group=w.group).item()
    padded = mx.array(mine + [0] * (n - len(mine)), dtype=mx.int64) if n else mx.zeros((1,), dtype=mx.int64)
    out = mx.distributed.all_sum(padded, group=w.group)
    return out.tolist()[:n]


def broadcast_json(obj, w: Optional[World] = None):
    """Rank 0's JSON-able object on every rank (others pass anything): its UTF-8 bytes as ints."""
    import json

    w = w or world()
    data = json.dumps(obj).encode() if w.is_front else b""
    return json.loads(bytes(broadcast_ints(list(data), w)).decode())


def broadcast_seed(w: Optional[World] = None) -> int:
    """A seed drawn on rank 0 and set on every rank's MLX PRNG, so unseeded sampling agrees."""
    import mlx.core as mx

    seed = broadcast_ints([random.SystemRandom().randrange(1 << 31)], w)[0]
    mx.random.seed(seed)
    return seed


def agree(flag: bool, w: Optional[World] = None) -> bool:
    """Rank 0's yes/no (stop, admit, reuse) on every rank."""
    return bool(broadcast_ints([int(flag)], w)[0])


def gather_strings(text: str, w: Optional[World] = None) -> List[str]:
    """Every rank's UTF-8 string on every rank, in rank order: all_sum of a zero-padded byte matrix."""
    import mlx.core as mx
    import numpy as np

    w = w or world()
    if w.size == 1:
        return [text]
    data = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)
    lengths = np.zeros(w.size, dtype=np.int32)
    lengths[w.rank] = data.size
    lengths = np.array(mx.distributed.all_sum(mx.array(lengths), group=w.group))
    rows = np.zeros((w.size, max(int(lengths.max()), 1)), dtype=np.int32)
    rows[w.rank, : data.size] = data
    rows = np.array(mx.distributed.all_sum(mx.array(rows), group=w.group))
    return [bytes(r[:n].astype(np.uint8)).decode() for r, n in zip(rows, lengths)]


def barrier(w: Optional[World] = None) -> None:
    """Return only when every rank reached this point (a one-int all_sum)."""
    import mlx.core as mx

    w = w or world()
    if w.size > 1:
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=w.group))


def quiet_followers() -> None:
    """Under a launcher, ranks other than 0 write nothing to stdout: the front prints each reply once."""
    import sys

    if launched() and not world().is_front:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
