"""Uneven inputs: DDP as a torch ``Joinable`` (``ddp.join()`` and ``Join([ddp, ...])``).

torch's :class:`~torch.distributed.algorithms.join.Join` counts the ranks still training
(each forward calls ``Join.notify_join_context``) and, on a rank whose inputs ran out,
calls our hook's ``main_hook`` once per iteration the others still run. Each forward
inside a join then all-reduces ``[active, sync, one-hot of active ranks]``; the joined
rank sends zeros and learns whether that iteration's backward reduces gradients and
which active rank to take buffers from, and shadows the same collectives (buffer
broadcast, zero-gradient bucket reductions through the same comm hook, the unused-
parameter flags) in the same order. ``post_hook`` gives every rank the parameters and
buffers of a rank that joined last (it applied every update).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from .comm_hooks import _comm

__all__ = ["DDPJoinHook", "exchange"]


def exchange(ddp, *, active: bool, sync: bool) -> tuple[int, int, int]:
    """(active ranks, of which syncing, the highest active group rank: buffers' source)."""
    rank = dist.get_rank(ddp.process_group)
    onehot = [int(active and r == rank) for r in range(ddp._world)]
    device = ddp.join_device
    flags = torch.tensor([int(active), int(sync), *onehot], dtype=torch.int64, device=device)
    _comm.record("all_reduce", flags)
    dist.all_reduce(flags, group=ddp.process_group)
    count, syncing, *who = flags.cpu().tolist()
    src = max((r for r, flag in enumerate(who) if flag), default=0)
    return count, syncing, src


class DDPJoinHook(JoinHook):
    """What a joined rank does for one DDP module while other ranks still train."""

    def __init__(self, ddp, divide_by_initial_world_size: bool) -> None:
        if not isinstance(divide_by_initial_world_size, bool):
            raise TypeError(
                "join: divide_by_initial_world_size must be True or False, got "
                f"{divide_by_initial_world_size!r}"
            )
        self.ddp = ddp
        ddp._join_divide_by_initial = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks still training."""
        ddp = self.ddp
        _count, syncing, src = exchange(ddp, active=False, sync=False)
        buffers = ddp._buffers_to_sync()  # as the ranks still training decide it
        if buffers:
            ddp._broadcast(buffers, src=src)
        ddp.require_forward_param_sync = bool(syncing)
        if syncing:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of a rank that joined last."""
        ddp = self.ddp
        ddp.reducer.sum_divisor = None
        ddp._join_config = _JoinConfig.construct_disabled_join_config()  # the join is over
        rank = dist.get_rank(ddp.process_group)
        src = torch.tensor([rank if is_last_joiner else -1], device=ddp.join_device)
        _comm.record("all_reduce", src)
        dist.all_reduce(src, op=dist.ReduceOp.MAX, group=ddp.process_group)
        synced = [p for _, p in ddp._named_params()]
        if ddp.forward_sync_buffers:
            synced += ddp._synced_buffers()
        ddp._broadcast(synced, src=int(src.item()))
