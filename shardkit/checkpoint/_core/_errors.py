"""Checkpoint error types."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpointError", "StateDictMismatchError"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (a failed rank, a failed commit, ...)."""


class CorruptCheckpointError(CheckpointError):
    """The stored bytes are not what the metadata promises.

    Raised for a checksum mismatch, a truncated, replaced or missing file, an unreadable
    metadata file or an unknown format version. The message names the file, and where it
    applies the key and the chunk.
    """


class StateDictMismatchError(CheckpointError, ValueError):
    """A state dict and a checkpoint (or a model) disagree: a key is missing or unexpected,
    or a shape differs.

    torch raises ``RuntimeError`` for these and shardkit used to raise ``ValueError``;
    this class is both, so either ``except`` clause catches it. The message names the
    key, both shapes, and the rank where it applies.
    """
