"""SPMD sharding: meshes, partition specs and ShardedTensor (``import shardkit.spmd as xs``)."""

from . import _rules, layout  # noqa: F401  (_rules registers the sharding rules)
from ._comm import CollectiveCounts, count_collectives
from ._dispatch import fallback_counts, register_rule, reset_fallback_counts
from ._mesh import Mesh
from ._module import shard_module
from ._placement import Placement
from ._sharded_tensor import ShardedTensor, clear_sharding, mark_sharding
from ._spmd_fsdp import SpmdFullyShardedDataParallel
from .layout import Box

__all__ = [
    "Box",
    "CollectiveCounts",
    "Mesh",
    "Placement",
    "ShardedTensor",
    "SpmdFullyShardedDataParallel",
    "clear_sharding",
    "count_collectives",
    "fallback_counts",
    "layout",
    "mark_sharding",
    "register_rule",
    "reset_fallback_counts",
    "shard_module",
]
