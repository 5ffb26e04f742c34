"""async_save(): return at once; stage, write and commit on a background thread.

By default (zero-stall, see ``_zero_stall``) the call only flattens the state, records
which tensors an optimizer owns and clones the others (buffers: small); planning,
staging this rank's share into a reused CPU buffer, writing, the all-ranks agreement and
the commit run on a background thread over a private gloo group, so they never
interleave with the training loop's collectives; optimizer steps wait for staging. With
``zero_stall=False``, or when no tensor belongs to a known optimizer, planning and
staging run in the call. At most one save is in flight per process: a second call first
waits for the previous one to finish.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from ...runtime._groups import cached_group
from ._comm import Comm
from ._copy import copy_into
from ._flatten import Flat, flatten
from ._format import Metadata
from ._fs_rules import refuse_per_process
from ._planner import SavePlanner, WriteItem
from ._save import (
    SaveJob,
    begin_save,
    max_file_bytes,
    prepare,
    set_inflight,
    write_and_commit,
)
from ._storage import FileSystemWriter, StorageWriter
from ._torch_args import check_async_args
from ._zero_stall import STAGING_THREAD, STATS, Snapshot, Staging, copy_values, protect

__all__ = ["async_save"]

_ALIGN = 64


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


def _private_group(process_group: Any) -> Any:
    """A gloo group over the same ranks, created once (collectively) per rank set and
    world (a re-initialised world gets new ones)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    if len(ranks) == 1:
        return None
    return cached_group(ranks)


def _stage(job: SaveJob, snapshot: Snapshot | None) -> dict[tuple[str, tuple], torch.Tensor]:
    """Copy this rank's items into the reused buffer; check each protected source after."""
    items: list[WriteItem] = [i for _, items in job.files for i in items]
    offsets, total = [], 0
    for item in items:
        offsets.append(total)
        total += -(-item.nbytes // _ALIGN) * _ALIGN
    buf = _pool.take(total)
    staged = {}
    cuda = []
    with torch.no_grad():
        for item, off in zip(items, offsets):
            src = job.planner.resolve_data(item)
            dst = buf[off : off + item.nbytes].view(item.dtype).reshape(item.box.sizes)
            if src.device.type == "cuda":
                cuda.append(item.key)
                dst.copy_(src, non_blocking=True)
            else:
                copy_into(dst, src)
                if snapshot is not None:
                    snapshot.check(item.key)
            staged[(item.key, item.box.offsets)] = dst
    if cuda:
        torch.cuda.synchronize()
        if snapshot is not None:
            for key in cuda:
                snapshot.check(key)
    return staged


def _flat_fn(flat: Flat | None, error: BaseException | None):
    """``prepare``'s source of the flattened state (raising inside its agreement)."""

    def get() -> Flat:
        if error is not None:
            raise error
        assert flat is not None
        return flat

    return get


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
    zero_stall: bool = True,
    verify_replicas: bool = True,
) -> Future:
    """Like :func:`save`, but return at once and save in the background.

    The checkpoint holds the state as it was at the call, bit for bit. With
    ``zero_stall=True`` (the default), tensors that an optimizer owns (its parameters and
    state) are copied on the background thread while training continues; the next
    ``optimizer.step()`` of any optimizer waits until they are copied. Every other tensor
    is cloned before the call returns. Changing an optimizer's tensors in place outside
    ``optimizer.step()`` before they are copied is detected (through the tensors' version
    counters) and fails the save: ``result()`` raises :class:`CheckpointError`, nothing
    is committed. Optimizers are known once they have stepped or when they are in
    ``state_dict``. ``zero_stall=False`` copies this rank's share before returning.

    The first call creates a private gloo group (collectively); a call made while a
    previous save is still in flight waits for it first, so at most one staging copy
    exists per rank.

    ``incremental_base`` works as in :func:`save` (the comparison with the base runs in
    the background, on the staged copy).

    ``verify_replicas`` is as in :func:`save`, but compares plain tensors only, hashed
    whole before staging (staging copies only this rank's share, so the save's own
    checksums of the other ranks' pieces cannot be reused here); with ``zero_stall`` this
    runs on the background thread.

    ``no_dist`` and ``use_collectives`` are as in :func:`save`; torch's
    ``async_checkpointer_type`` and ``async_stager`` are accepted (shardkit stages and
    writes on one background thread of this process; other choices warn once).

    Returns:
        A Future whose result is the committed :class:`Metadata`; any error of the
        save itself (on any rank) comes out of ``result()``. A wrong argument (no
        ``checkpoint_id`` or ``storage_writer``, an object of the wrong type) raises at
        the call, as :func:`save` does (torch reports it from the Future).
    """
    if not isinstance(zero_stall, bool):
        raise TypeError(f"zero_stall must be True or False, got {zero_stall!r}")
    writer, planner, base = begin_save(
        checkpoint_id, storage_writer, planner, verify_replicas, incremental_base, no_dist
    )
    replicas = "before" if verify_replicas else "off"
    future: Future = Future()
    future.set_running_or_notify_cancel()
    try:
        local = check_async_args(async_checkpointer_type, async_stager, no_dist, use_collectives)
        comm = Comm(None, local=True) if local else Comm(_private_group(process_group))
        if isinstance(writer, FileSystemWriter):  # every rank sees the same URL: all raise
            refuse_per_process(writer.fs, writer.url, comm.world_size)
    except BaseException as exc:
        future.set_exception(exc)
        return future
    flat, error, snapshot = None, None, None
    try:
        flat = flatten(state_dict, for_save=True)
        snapshot = protect(flat) if zero_stall else None
        if snapshot is None:  # staged in the call: its values are taken now too
            copy_values(flat)
    except Exception as exc:  # reported inside prepare's agreement, so no rank hangs
        error = exc

    def plan(flat_fn):  # collective: every rank learns of a failure on any rank
        job = prepare(
            state_dict, planner, comm, writer.thread_count, max_file_bytes(writer),
            flat_fn=flat_fn, replicas=replicas, writer=writer,
        )  # fmt: skip
        job.base = base
        return job

    job, staged, staging = None, None, None
    if snapshot is None:  # blocking path: plan and stage in the call
        STATS.blocking_saves += 1
        try:
            job = plan(_flat_fn(flat, error))
            staged = _stage(job, None)
        except BaseException as exc:
            if job is None:  # planning failed on some rank: every rank knows
                future.set_exception(exc)
                return future
            error = exc  # staging failed here: the staging agreement tells the others
    else:
        STATS.staged_saves += 1
        staging = Staging()
        staging.start()

    released = threading.Event()

    def run() -> None:
        # Start working only once the caller has returned: a new thread that ran Python
        # at once would hold the GIL for a whole switch interval (5 ms) before the caller
        # could return from start().
        released.wait()
        nonlocal job, staged, error
        try:
            if staging is not None:
                try:
                    job = plan(_flat_fn(flat, None))
                    job.before_commit = snapshot.final
                    staged = _stage(job, snapshot)
                except BaseException as exc:
                    if job is None:  # planning failed: its agreement told every rank
                        raise
                    error = exc  # staging failed here: the agreement below tells the others
                finally:
                    staging.finish()
            comm.agree(error, "staging the checkpoint")
            md: Metadata = write_and_commit(
                job, writer, comm, lambda item: staged[(item.key, item.box.offsets)]
            )
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(md)
        finally:
            if snapshot is not None:
                snapshot.forget()

    set_inflight(future)
    threading.Thread(target=run, name=STAGING_THREAD, daemon=False).start()
    released.set()
    return future
