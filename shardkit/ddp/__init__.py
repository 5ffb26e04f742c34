"""Data parallel training with pluggable gradient communication (``shardkit.ddp``).

``DistributedDataParallel`` mirrors torch's DDP; the hooks in ``shardkit.ddp.comm_hooks``
mirror ``torch.distributed.algorithms.ddp_comm_hooks`` and run on either DDP.
"""

from . import comm_hooks
from ._ddp import DistributedDataParallel
from ._grad_bucket import GradBucket
from ._reducer import assign_buckets
from .comm_hooks import CommCounter, count_comm

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "CommCounter",
    "DistributedDataParallel",
    "GradBucket",
    "assign_buckets",
    "comm_hooks",
    "count_comm",
]
