"""SPMD sharding: meshes, partition specs and ShardedTensor (``import shardkit.spmd as xs``)."""

from . import _rules, layout  # noqa: F401  (_rules registers the sharding rules)
from ._comm import CollectiveCounts, count_collectives
from ._dispatch import fallback_counts, register_rule, reset_fallback_counts
from ._errors import MeshError, PartitionSpecError, PartitionSpecTypeError
from ._mesh import HybridMesh, Mesh, get_1d_mesh, get_global_mesh, set_global_mesh
from ._module import shard_module
from ._placement import Placement
from ._sharded_tensor import (
    ShardedTensor,
    ShardingType,
    XLAShard,
    clear_sharding,
    mark_sharding,
    mark_sharding_with_gradients,
)
from ._spmd_fsdp import SpmdFullyShardedDataParallel
from .layout import Box

#: torch_xla's name for the sharded tensor type, so ``isinstance`` checks keep working.
XLAShardedTensor = ShardedTensor

__all__ = [
    "Box",
    "CollectiveCounts",
    "HybridMesh",
    "Mesh",
    "MeshError",
    "PartitionSpecError",
    "PartitionSpecTypeError",
    "Placement",
    "ShardedTensor",
    "ShardingType",
    "SpmdFullyShardedDataParallel",
    "XLAShard",
    "XLAShardedTensor",
    "clear_sharding",
    "count_collectives",
    "fallback_counts",
    "get_1d_mesh",
    "get_global_mesh",
    "layout",
    "mark_sharding",
    "mark_sharding_with_gradients",
    "register_rule",
    "reset_fallback_counts",
    "set_global_mesh",
    "shard_module",
]
