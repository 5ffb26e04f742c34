"""shardkit: SPMD sharding, FSDP, DDP communication hooks and distributed checkpointing.

Subpackages are imported on demand: ``import shardkit.spmd as xs``,
``import shardkit.checkpoint as dist_cp``, ``from shardkit.fsdp import FSDP``.
"""

from ._version import __version__

__all__ = ["__version__"]
