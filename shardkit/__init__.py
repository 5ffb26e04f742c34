"""shardkit: SPMD sharding, FSDP, DDP communication hooks and distributed checkpointing.

Subpackages are imported on demand: ``import shardkit.spmd as xs``,
``import shardkit.checkpoint as dist_cp``, ``from shardkit.fsdp import FSDP``.
"""

from ._torch_floor import check_torch_version
from ._version import __version__

check_torch_version()

__all__ = ["__version__"]
