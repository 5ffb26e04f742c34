"""Communication hooks for shardkit's and torch's DistributedDataParallel.

Submodules mirror ``torch.distributed.algorithms.ddp_comm_hooks``: ``default_hooks``,
``powerSGD_hook`` and ``debugging_hooks``. :func:`count_comm` counts the bytes hooks
hand to collectives.
"""

from . import debugging_hooks, default_hooks, powerSGD_hook
from ._comm import CommCounter, count_comm

__all__ = ["CommCounter", "count_comm", "debugging_hooks", "default_hooks", "powerSGD_hook"]
