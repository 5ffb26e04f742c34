"""Collectives used by the DDP reducer and the hooks, with byte accounting.

Every gradient byte shardkit hands to a collective goes through here, so
:func:`count_comm` can report what a hook really sends, whichever DDP (shardkit's or
torch's) calls the hook. Without a process group (a world of one) the collectives
complete at once and nothing is counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "all_reduce",
    "all_reduce_async",
    "broadcast",
    "count_comm",
    "done",
    "group_size",
    "resolve_group",
]

_lock = threading.Lock()
_active: list[CommCounter] = []


class CommCounter:
    """Payload bytes and calls handed to collectives while a :func:`count_comm` is open.

    ``bytes`` is what each rank contributes (``numel * element_size``), not the
    transport's traffic: a ring all-reduce moves about ``2 (W-1) / W`` times that.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.bytes_by_op: Counter[str] = Counter()

    def __repr__(self) -> str:
        return (
            f"CommCounter(bytes={self.bytes}, calls={self.calls}, by_op={dict(self.bytes_by_op)})"
        )


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count the collectives shardkit DDP and its hooks launch inside the block."""
    counter = CommCounter()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


def record(op: str, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    with _lock:
        for counter in _active:
            counter.bytes += nbytes
            counter.calls += 1
            counter.bytes_by_op[op] += nbytes


def resolve_group(process_group):
    """The group to use: the one given, else the world; None when there is no world."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_size(process_group) -> int:
    group = resolve_group(process_group)
    return 1 if group is None else dist.get_world_size(group)


def done(value) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def all_reduce_async(
    tensor: torch.Tensor, process_group, *, average: bool = False
) -> torch.futures.Future:
    """Sum ``tensor`` in place over the group; the future's value is ``tensor``.

    With ``average`` the tensor is divided by the group size first, which keeps
    fp16 / bf16 sums from overflowing.
    """
    group = resolve_group(process_group)
    if group is None:
        return done(tensor)
    if average:
        tensor.div_(dist.get_world_size(group))
    record("all_reduce", tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def all_reduce(tensor: torch.Tensor, process_group) -> torch.Tensor:
    """Blocking in-place sum, for values needed before the hook can go on."""
    group = resolve_group(process_group)
    if group is not None:
        record("all_reduce", tensor)
        dist.all_reduce(tensor, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, process_group, *, src_group_rank: int = 0) -> None:
    """Blocking broadcast from the group's ``src_group_rank``."""
    group = resolve_group(process_group)
    if group is None:
        return
    record("broadcast", tensor)
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_group_rank), group=group)
