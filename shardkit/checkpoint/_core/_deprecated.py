"""torch's deprecated ``save_state_dict`` / ``load_state_dict``, mapped onto save / load."""

from __future__ import annotations

import warnings
from typing import Any

from ._format import Metadata
from ._load import load
from ._planner import LoadPlanner, SavePlanner, warn_once
from ._save import save
from ._storage import StorageReader, StorageWriter

__all__ = ["save_state_dict", "load_state_dict"]


def _coordinator(coordinator_rank: int) -> None:
    if coordinator_rank != 0:
        warn_once(
            f"coordinator_rank={coordinator_rank} is ignored: rank 0 of the group always "
            "commits a shardkit checkpoint"
        )


def save_state_dict(
    state_dict: dict,
    storage_writer: StorageWriter,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: SavePlanner | None = None,
) -> Metadata:
    """Deprecated alias of :func:`save` with torch's positional signature (warns, as torch)."""
    warnings.warn(
        "save_state_dict is deprecated; call save(state_dict, storage_writer=...)",
        FutureWarning,
        stacklevel=2,
    )
    _coordinator(coordinator_rank)
    return save(
        state_dict,
        storage_writer=storage_writer,
        process_group=process_group,
        no_dist=no_dist,
        planner=planner,
    )


def load_state_dict(
    state_dict: dict,
    storage_reader: StorageReader,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: LoadPlanner | None = None,
) -> None:
    """Deprecated alias of :func:`load` with torch's positional signature (warns, as torch)."""
    warnings.warn(
        "load_state_dict is deprecated; call load(state_dict, storage_reader=...)",
        FutureWarning,
        stacklevel=2,
    )
    _coordinator(coordinator_rank)
    load(
        state_dict,
        storage_reader=storage_reader,
        process_group=process_group,
        no_dist=no_dist,
        planner=planner,
    )
