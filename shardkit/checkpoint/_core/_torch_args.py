"""torch.distributed.checkpoint's spellings: arguments accepted so torch code runs unchanged.

Each is honoured where it means something here; one that cannot change anything in
shardkit's format warns once, naming what it does in torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from ._errors import CheckpointError
from ._format import METADATA_FILE
from ._planner import warn_once
from ._storage import DEFAULT_MAX_FILE_BYTES
from ._storage import FileSystemWriter as _BaseWriter

__all__ = ["FileSystemWriter", "check_no_dist", "check_async_args"]


def check_no_dist(no_dist: bool, use_collectives: bool) -> bool:
    """Whether a save runs as a world of one (torch's ``no_dist``).

    ``use_collectives=False`` (torch: each rank writes its own metadata) is refused in a
    multi-rank group: shardkit's commit is one metadata file agreed by every rank.
    """
    if no_dist:
        return True
    if not use_collectives and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            raise ValueError(
                "save(use_collectives=False) is not supported across ranks: a shardkit "
                "checkpoint commits one metadata file that every rank agreed on. Drop the "
                "argument, or pass no_dist=True with one checkpoint_id per rank"
            )
    return False


def check_async_args(checkpointer_type: Any, stager: Any, no_dist: bool, collectives: bool):
    """:func:`check_no_dist` for ``async_save``, warning once about torch-only choices."""
    kind = getattr(checkpointer_type, "value", checkpointer_type)
    if kind not in (None, "thread"):
        warn_once(
            f"async_save(async_checkpointer_type={checkpointer_type!r}): shardkit always "
            "stages and writes on one background thread of this process"
        )
    if stager is not None:
        warn_once(
            "async_save(async_stager=...) is ignored: shardkit stages into CPU copies itself "
            "(see async_save(zero_stall=...))"
        )
    return check_no_dist(no_dist, collectives)


class FileSystemWriter(_BaseWriter):
    """Writes a checkpoint directory, accepting torch's ``FileSystemWriter`` options.

    Args:
        path: the checkpoint directory or URL.
        thread_count: files each rank writes in parallel.
        sync_files: fsync every file and the directory before the commit (local paths).
        overwrite: when False, refuse (``CheckpointError``, a RuntimeError as torch's) to
            save where a committed checkpoint already is.
        storage_options: fsspec options for ``path``.
        max_file_bytes: most tensor bytes per data file (default 4 GiB); a rank's share
            then spans several files. None: no cap.
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
            serialization_format, _extensions: torch's; shardkit always writes
            ``thread_count`` safetensors files per rank and stages itself, so a non-default
            value warns once and changes nothing.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        storage_options: dict | None = None,
        serialization_format: Any = None,
        _extensions: Iterable[Any] | None = None,
        max_file_bytes: int | None = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        super().__init__(
            path,
            thread_count=thread_count,
            sync_files=sync_files,
            storage_options=storage_options,
            max_file_bytes=max_file_bytes,
        )
        ignored = {
            "single_file_per_rank": (single_file_per_rank, True),
            "per_thread_copy_ahead": (per_thread_copy_ahead, 10_000_000),
            "cache_staged_state_dict": (cache_staged_state_dict, False),
            "_extensions": (_extensions, None),
        }
        fmt = getattr(serialization_format, "name", serialization_format)
        if fmt not in (None, "TORCH_SAVE", "SAFETENSORS"):
            ignored["serialization_format"] = (serialization_format, None)
        for name, (value, default) in ignored.items():
            if value != default:
                warn_once(
                    f"FileSystemWriter({name}={value!r}) has no effect in shardkit: each rank "
                    "writes thread_count safetensors files and stages its own copies"
                )
        self.single_file_per_rank = bool(single_file_per_rank)
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = bool(cache_staged_state_dict)
        self.overwrite = bool(overwrite)

    def _check_overwrite(self) -> None:
        # checked at every file, never cached: one writer serves many saves (torch's
        # ``save(..., checkpoint_id=step_dir, storage_writer=writer)`` loop), and the
        # directory may hold a checkpoint by the next save
        if self.overwrite:
            return
        if METADATA_FILE in self.list_files():
            raise CheckpointError(
                f"a checkpoint already exists at {self!r} and FileSystemWriter(overwrite=False); "
                "save to a new path, or pass overwrite=True"
            )

    def write_file(self, name: str, parts: Iterable[memoryview]) -> None:
        """Write one data file (refused with ``overwrite=False`` over a checkpoint)."""
        self._check_overwrite()
        super().write_file(name, parts)

    def commit(self, metadata: bytes) -> None:
        """Write the metadata file last, atomically."""
        self._check_overwrite()
        super().commit(metadata)
