"""The manager's calls into the checkpoint core (save / async_save / load of one step).

Kept apart from the manager so the core's signatures are used in exactly one place.
The manager's ``storage_options`` (an S3 endpoint, credentials) go to every core reader
and writer it creates.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from .._core._storage import FileSystemReader, FileSystemWriter

if TYPE_CHECKING:
    from ._manager import CheckpointManager

__all__ = ["load_step", "save_step", "save_step_async", "why_step_not_committed"]


def why_step_not_committed(store, step: int) -> str | None:
    """The core's check of ``step`` (committed metadata, every file with its size): None
    when it passes, else the first check it fails, naming the file."""
    from .._core._load import why_not_committed

    return why_not_committed(store.step_url(step), storage_options=store.storage_options)


def _writer(mgr: CheckpointManager, step: int) -> FileSystemWriter:
    store = mgr._store
    return FileSystemWriter(
        store.step_url(step),
        storage_options=store.storage_options,
        thread_count=getattr(mgr, "num_of_threads", 1),
        max_file_bytes=getattr(mgr, "max_file_bytes", None),
    )


def _reader(mgr: CheckpointManager, step: int) -> FileSystemReader:
    store = mgr._store
    return FileSystemReader(store.step_url(step), storage_options=store.storage_options)


def _base(mgr: CheckpointManager, base: int | None) -> str | None:
    return None if base is None else mgr._store.step_url(base)


def save_step(mgr: CheckpointManager, step: int, state_dict: dict, base: int | None = None) -> None:
    """Blocking save of ``step``, coordinated over the manager's private group; with a
    ``base`` step, an incremental save referencing its unchanged chunks."""
    from .._core._save import save

    save(
        state_dict,
        storage_writer=_writer(mgr, step),
        process_group=mgr._ctrl,
        incremental_base=_base(mgr, base),
        verify_replicas=mgr.verify_replicas,
    )


def save_step_async(
    mgr: CheckpointManager, step: int, state_dict: dict, base: int | None = None
) -> Future:
    """Stage ``state_dict`` and commit ``step`` in the background (async group)."""
    from .. import async_save

    return async_save(
        state_dict,
        storage_writer=_writer(mgr, step),
        process_group=mgr._async_group,
        incremental_base=_base(mgr, base),
        verify_replicas=mgr.verify_replicas,
        zero_stall=getattr(mgr, "zero_stall", True),
    )


def load_step(mgr: CheckpointManager, step: int, state_dict: dict, *, alone: bool = False) -> None:
    """In-place, resharding load of committed ``step``: collective, or ``alone`` on this
    rank (a tiered restore, where only some ranks read storage and agree afterwards)."""
    from .._core._load import load

    load(state_dict, storage_reader=_reader(mgr, step), process_group=mgr._ctrl, no_dist=alone)
