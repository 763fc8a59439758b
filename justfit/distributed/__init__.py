"""Scale-out over MLX's own distributed layer (mx.distributed, `mlx.launch`): one model over N ranks.

`shard_model(model, group)` cuts a loaded mlx-lm model for this rank (tensor parallel via mlx-lm's
`model.shard`, else the layer pipeline plug-in); `world()` is this process's rank and world size;
rank 0's decisions reach the other ranks through collectives (world.py). Docs: docs/distributed.md.
"""

from .shard import Sharding, choose, shard_model
from .world import World, agree, barrier, broadcast_ints, broadcast_seed, gather_strings, launched, quiet_followers, world

__all__ = ["Sharding", "World", "agree", "barrier", "broadcast_ints", "broadcast_seed", "choose", "gather_strings",
           "launched", "quiet_followers", "shard_model", "world"]
