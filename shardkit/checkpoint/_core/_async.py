"""async_save(): block only to stage this rank's share into reused CPU buffers.

Planning and staging run in the caller's thread; writing, the all-ranks agreement and
the commit run on a background thread over a private gloo group, so they never
interleave with the training loop's collectives. At most one save is in flight per
process: a second call first waits for the previous one to finish.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from ... import runtime
from ._comm import Comm
from ._copy import copy_into
from ._format import Metadata
from ._planner import DefaultSavePlanner, SavePlanner, WriteItem
from ._save import (
    SaveJob,
    base_reader,
    max_file_bytes,
    prepare,
    resolve_writer,
    set_inflight,
    wait_for_inflight,
    write_and_commit,
)
from ._storage import StorageWriter
from ._torch_args import check_async_args

__all__ = ["async_save"]

_ALIGN = 64
_groups: dict[tuple[int, ...], Any] = {}


class _StagingPool:
    """One reusable byte buffer per process (pinned when CUDA is present)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None  # free the old buffer before allocating the larger one
            self.buf = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        return self.buf


_pool = _StagingPool()
# exit: drop our references so the private groups' gloo threads stop before finalization
runtime.at_teardown(_groups.clear)


def _private_group(process_group: Any) -> Any:
    """A gloo group over the same ranks, created once (collectively) per rank set."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    if len(ranks) == 1:
        return None
    if ranks not in _groups:
        # only the group's own ranks take part when it is a subgroup of the world
        subgroup = len(ranks) != dist.get_world_size()
        _groups[ranks] = dist.new_group(
            list(ranks), backend="gloo", use_local_synchronization=subgroup
        )
    return _groups[ranks]


def _stage(job: SaveJob) -> dict[tuple[str, tuple], torch.Tensor]:
    items: list[WriteItem] = [i for _, items in job.files for i in items]
    offsets, total = [], 0
    for item in items:
        offsets.append(total)
        total += -(-item.nbytes // _ALIGN) * _ALIGN
    buf = _pool.take(total)
    staged = {}
    cuda = False
    with torch.no_grad():
        for item, off in zip(items, offsets):
            src = job.planner.resolve_data(item)
            dst = buf[off : off + item.nbytes].view(item.dtype).reshape(item.box.sizes)
            if src.device.type == "cuda":
                cuda = True
                dst.copy_(src, non_blocking=True)
            else:
                copy_into(dst, src)
            staged[(item.key, item.box.offsets)] = dst
    if cuda:
        torch.cuda.synchronize()
    return staged


def async_save(
    state_dict: dict,
    *,
    checkpoint_id: str | os.PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    incremental_base: str | os.PathLike | None = None,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
) -> Future:
    """Like :func:`save`, but return once this rank's share is staged in CPU memory.

    The caller may change its tensors as soon as this returns. The first call creates a
    private gloo group (collectively); a call made while a previous save is still in
    flight waits for it first, so at most one staging copy exists per rank.

    ``incremental_base`` works as in :func:`save` (the comparison with the base runs in
    the background, on the staged copy).

    ``no_dist`` and ``use_collectives`` are as in :func:`save`; torch's
    ``async_checkpointer_type`` and ``async_stager`` are accepted (shardkit stages on the
    calling thread and writes on one background thread; other choices warn once).

    Returns:
        A Future whose result is the committed :class:`Metadata`; any error (on any
        rank) comes out of ``result()``.
    """
    writer = resolve_writer(checkpoint_id, storage_writer)
    planner = planner if planner is not None else DefaultSavePlanner()
    if not isinstance(planner, SavePlanner):
        raise TypeError(f"planner must be a SavePlanner, got {type(planner).__name__}")
    base = base_reader(writer, incremental_base)
    wait_for_inflight()
    runtime.init()  # join the world the environment describes (torchrun, SLURM)
    future: Future = Future()
    future.set_running_or_notify_cancel()
    try:
        local = check_async_args(async_checkpointer_type, async_stager, no_dist, use_collectives)
        comm = Comm(None, local=True) if local else Comm(_private_group(process_group))
        job = prepare(state_dict, planner, comm, writer.thread_count, max_file_bytes(writer))
        job.base = base
        staged = _stage(job)
    except BaseException as exc:
        future.set_exception(exc)
        return future

    released = threading.Event()

    def run() -> None:
        # Start working only once the caller has returned: a new thread that ran Python
        # at once would hold the GIL for a whole switch interval (5 ms) before the caller
        # could return from start().
        released.wait()
        try:
            md: Metadata = write_and_commit(
                job, writer, comm, lambda item: staged[(item.key, item.box.offsets)]
            )
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(md)

    set_inflight(future)
    threading.Thread(target=run, name="shardkit-async-save", daemon=False).start()
    released.set()
    return future
