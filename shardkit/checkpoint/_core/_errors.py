"""Checkpoint error types."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (a failed rank, a failed commit, ...)."""


class CorruptCheckpointError(CheckpointError):
    """The stored bytes are not what the metadata promises.

    Raised for a checksum mismatch, a truncated, replaced or missing file, an unreadable
    metadata file or an unknown format version. The message names the file, and where it
    applies the key and the chunk.
    """
