"""The manager's calls into the checkpoint core (save / async_save / load of one step).

Kept apart from the manager so the core's signatures are used in exactly one place.
The core's ``FileSystemWriter``/``FileSystemReader`` open their URL without fsspec
options, so when the manager has ``storage_options`` (an S3 endpoint, credentials) the
reader/writer is pointed at the manager's own configured filesystem object.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from ._errors import CheckpointError
from ._format import Metadata
from ._storage import FileSystemReader, FileSystemWriter

if TYPE_CHECKING:
    from ._manager import CheckpointManager

__all__ = ["is_committed_step", "load_step", "save_step", "save_step_async"]


def _bind(io, mgr: CheckpointManager):
    return bind_fs(io, mgr._store)


def bind_fs(io, store):
    """Point a core reader/writer at ``store``'s configured filesystem object."""
    if store.storage_options:
        io.fs = store.fs
    return io


def is_committed_step(store, step: int) -> bool:
    """The core's ``is_committed`` for one step: metadata parses, every file has its size."""
    url = store.step_url(step)
    if not store.storage_options:
        from ._load import is_committed

        return is_committed(url)
    reader = bind_fs(FileSystemReader(url), store)
    try:
        metadata = Metadata.from_json(reader.read_metadata(), f"{url}/metadata")
        return all(reader.file_size(n) == size for n, size in metadata.files.items())
    except (CheckpointError, FileNotFoundError):
        return False


def _writer(mgr: CheckpointManager, step: int) -> FileSystemWriter:
    return _bind(FileSystemWriter(mgr._store.step_url(step)), mgr)


def _reader(mgr: CheckpointManager, step: int) -> FileSystemReader:
    return _bind(FileSystemReader(mgr._store.step_url(step)), mgr)


def save_step(mgr: CheckpointManager, step: int, state_dict: dict) -> None:
    """Blocking save of ``step``, coordinated over the manager's private group."""
    from ._save import save

    save(state_dict, storage_writer=_writer(mgr, step), process_group=mgr._ctrl)


def save_step_async(mgr: CheckpointManager, step: int, state_dict: dict) -> Future:
    """Stage ``state_dict`` and commit ``step`` in the background (async group)."""
    from . import async_save

    return async_save(state_dict, storage_writer=_writer(mgr, step), process_group=mgr._async_group)


def load_step(mgr: CheckpointManager, step: int, state_dict: dict) -> None:
    """In-place, resharding load of committed ``step``."""
    from ._load import load

    load(state_dict, storage_reader=_reader(mgr, step), process_group=mgr._ctrl)
