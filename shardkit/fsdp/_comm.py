"""The two collectives FSDP issues, with a no-op path for a world of one."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_flat", "all_reduce_flat", "group_info"]


def _collective(name: str, older_name: str):
    """torch's flat collective ``name`` (>= 2.13), else its older name. Looked up at each
    call, not at import: a profiler or byte counter that wraps ``torch.distributed``'s
    functions then sees FSDP's collectives whenever shardkit was imported."""
    return getattr(dist, name, None) or getattr(dist, older_name)


class _Done:
    """A finished piece of work (the world-of-one path)."""

    def wait(self) -> bool:
        return True


def group_info(group) -> tuple[object | None, int, int]:
    """(group, rank in it, its size); ``(None, 0, 1)`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def all_gather_flat(out: torch.Tensor, segment: torch.Tensor, group, world: int):
    """Every rank's ``segment`` end to end into ``out``; returns a waitable work handle."""
    if world == 1:
        out.copy_(segment)
        return _Done()
    return _collective("all_gather_single", "all_gather_into_tensor")(
        out, segment, group=group, async_op=True
    )


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group, world: int):
    """Sum ``full`` (world segments) over ranks; this rank's segment lands in ``out``."""
    if world == 1:
        out.copy_(full)
        return _Done()
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(
        out, full, op=dist.ReduceOp.SUM, group=group, async_op=True
    )


def all_reduce_flat(tensor: torch.Tensor, group, world: int):
    """Sum ``tensor`` over ranks in place; every rank ends with bitwise the same result."""
    if world == 1:
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
