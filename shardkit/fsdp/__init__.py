"""Fully sharded data parallel (ZeRO-3 / ZeRO-2) training: ``from shardkit.fsdp import FSDP``.

Parameters, gradients and optimizer state are sharded over the ranks, one dim-0 slice
per parameter; see docs/fsdp.md for the design and for checkpoints.
"""

from . import wrap
from ._checkpoint_module import checkpoint_module
from ._consolidate import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts
from ._errors import FSDPUsageError
from ._fsdp import FSDP, FullyShardedDataParallel, XlaFullyShardedDataParallel

__all__ = [
    "FSDP",
    "FSDPUsageError",
    "FullyShardedDataParallel",
    "XlaFullyShardedDataParallel",
    "checkpoint_module",
    "consolidate_sharded_model_checkpoints",
    "consolidate_sharded_state_dicts",
    "wrap",
]
