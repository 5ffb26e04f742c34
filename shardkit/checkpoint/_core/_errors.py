"""Checkpoint error types."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "ReplicaMismatchWarning",
    "StateDictMismatchError",
    "UsageError",
    "damage_is_corruption",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (a failed rank, a failed commit, ...)."""


class CorruptCheckpointError(CheckpointError):
    """The stored bytes are not what the metadata promises.

    Raised for a checksum mismatch, a truncated, replaced or missing file, an unreadable
    metadata file or an unknown format version. The message names the file, and where it
    applies the key and the chunk.
    """


class ReplicaMismatchWarning(UserWarning):
    """A replicated tensor (plain, or a replicated shard) differed between ranks at save.

    The save keeps one rank's copy whole (never a mix of copies; the message names the
    rank) and warns on every rank. Turn it into an error with
    ``warnings.filterwarnings("error", category=ReplicaMismatchWarning)`` on every rank:
    the save then fails on every rank, removes the files it wrote and commits nothing.
    ``verify_replicas=False`` skips the check.
    """


class StateDictMismatchError(CheckpointError, ValueError):
    """A state dict and a checkpoint (or a model) disagree: a key is missing or unexpected,
    or a shape differs.

    torch raises ``RuntimeError`` for these and shardkit used to raise ``ValueError``;
    this class is both, so either ``except`` clause catches it. The message names the
    key, both shapes, and the rank where it applies.
    """


class UsageError(CheckpointError, ValueError):
    """A call that torch refuses with ``RuntimeError`` (no ``checkpoint_id`` and no storage,
    no optimizers where only optimizers are asked for); a ``ValueError`` too, shardkit's
    class for a caller's mistake."""


@contextlib.contextmanager
def damage_is_corruption(message: str) -> Iterator[None]:
    """Turn any error of the block into a ``CorruptCheckpointError``: ``message``, then the
    error's type and first line. For reading input that is already known to be damaged
    when it fails at all: a damaged pickle or archive fails in many ways (``KeyError``,
    ``UnicodeDecodeError``, torch's ``RuntimeError``, ...), none of them a bug of ours."""
    try:
        yield
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise CorruptCheckpointError(f"{message} ({type(exc).__name__}: {first})") from exc
