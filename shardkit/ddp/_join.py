"""Uneven inputs: ``DistributedDataParallel.join()``.

While a join is open, every forward of a rank still training first all-reduces
``[1, sync]`` (one more active rank; whether this iteration's backward reduces
gradients). A rank whose inputs ran out all-reduces ``[0, 0]`` instead, in a loop: while
the sum says some rank is still active it shadows that iteration's collectives (buffer
broadcast from the highest active rank, zero-gradient bucket reductions through the same comm hook, the unused-
parameter flags), in the same order, so no collective is left unmatched. When the sum is
zero every rank is done; all then take the parameters and buffers of a rank that joined
last (it applied every update).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_hooks import _comm

__all__ = ["JoinState"]


class JoinState:
    """One open ``join()`` context of one DDP module."""

    def __init__(self, divide_by_initial_world_size: bool, throw_on_early_termination: bool):
        self.divide_by_initial = divide_by_initial_world_size
        self.throw = throw_on_early_termination

    @staticmethod
    def _reduce(ddp, values: list[int]) -> list[int]:
        device = ddp.reducer.buckets[0].buffer.device
        flags = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(flags, group=ddp.process_group)
        return flags.cpu().tolist()

    def _raise(self, ddp) -> None:
        raise RuntimeError(
            f"DDP.join(throw_on_early_termination=True): a rank of {ddp._world} ran out of "
            "inputs; every rank stops here"
        )

    def _exchange(self, ddp, active: bool, sync: bool) -> tuple[int, int, int]:
        """(active ranks, of which sync, the highest active group rank: buffers' source)."""
        rank = dist.get_rank(ddp.process_group)
        onehot = [int(active and r == rank) for r in range(ddp._world)]
        count, syncing, *who = self._reduce(ddp, [int(active), int(sync), *onehot])
        src = max((r for r, flag in enumerate(who) if flag), default=0)
        return count, syncing, src

    def announce(self, ddp, *, sync: bool) -> int:
        """A forward of a rank that still trains: count the active ranks.

        Returns the group rank to broadcast buffers from (an active one, as torch).
        """
        count, _, src = self._exchange(ddp, True, sync)
        if self.throw and count < ddp._world:
            self._raise(ddp)
        ddp.reducer.sum_divisor = None if self.divide_by_initial else count
        return src

    def shadow_until_all_joined(self, ddp) -> None:
        """This rank's inputs ran out: match the others' collectives, then sync the model."""
        joined_last = None
        while True:
            count, syncing, src = self._exchange(ddp, False, False)
            if joined_last is None:
                joined_last = count == 0
            if count == 0:
                break
            if self.throw:
                self._raise(ddp)
            if ddp.broadcast_buffers:
                buffers = list(ddp.module.buffers())
                if buffers:
                    ddp._broadcast(buffers, src=src)
            if syncing:
                ddp.reducer.shadow_backward()
        rank = dist.get_rank(ddp.process_group)
        (src,) = self._reduce_max(ddp, rank if joined_last else -1)
        ddp._broadcast([*ddp.module.parameters(), *ddp.module.buffers()], src=src)

    @staticmethod
    def _reduce_max(ddp, value: int) -> list[int]:
        device = ddp.reducer.buckets[0].buffer.device
        t = torch.tensor([value], dtype=torch.int64, device=device)
        _comm.record("all_reduce", t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group)
        return t.cpu().tolist()
