"""Removing the files of superseded saves, in the background, after a commit."""

from __future__ import annotations

import os
import threading
import warnings

from ._format import METADATA_FILE, Metadata
from ._storage import FileSystemWriter, StorageWriter

__all__ = ["OWN_PREFIXES", "join_cleanups", "remove_superseded"]

#: the names a save of ours writes into a checkpoint directory
OWN_PREFIXES = ("data-", "objects-", f"{METADATA_FILE}.tmp-")


def _modified_before(path: str, when: float) -> bool:
    try:
        return os.stat(path).st_mtime < when
    except OSError:  # gone already
        return False


_cleanups: list[threading.Thread] = []


def join_cleanups() -> None:
    """Wait for background deletions of superseded files started by earlier saves."""
    while _cleanups:
        _cleanups.pop().join()


def remove_superseded(writer: StorageWriter, metadata: Metadata, started: float) -> None:
    """Delete the files the new metadata does not name, in the background.

    The list is taken now, right after the commit; deleting ~1 GiB takes a noticeable
    part of a save on ext4, and nothing needs to wait for it. A local file modified
    after this save started is kept: it belongs to a save running beside this one
    (processes saving into one directory with ``no_dist=True``), whose commit may
    come after this one and would otherwise name deleted files.
    """

    def remove(stale: list[str]) -> None:
        try:
            writer.remove_files(stale)
        except Exception as exc:  # the new checkpoint is committed; leftovers are harmless
            warnings.warn(f"could not remove files of superseded saves: {exc}", stacklevel=2)

    try:
        stale = [
            n for n in writer.list_files() if n.startswith(OWN_PREFIXES) and n not in metadata.files
        ]
        if isinstance(writer, FileSystemWriter) and writer.local:
            stale = [n for n in stale if _modified_before(writer.join(n), started)]
    except Exception as exc:
        warnings.warn(f"could not list files of superseded saves: {exc}", stacklevel=3)
        return
    if stale:
        thread = threading.Thread(target=remove, args=(stale,), name="shardkit-ckpt-cleanup")
        thread.start()
        _cleanups[:] = [t for t in _cleanups if t.is_alive()] + [thread]
