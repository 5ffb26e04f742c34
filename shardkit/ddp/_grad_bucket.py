"""The view of one gradient bucket that a communication hook receives."""

from __future__ import annotations

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """A flat buffer holding several parameters' gradients, plus views into it.

    Same methods as ``torch.distributed.GradBucket``, so one hook serves both DDPs.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.Tensor],
        *,
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in launch order; stable across iterations."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D gradient tensor the hook communicates."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view per parameter into the bucket's original buffer, shaped like it."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (hooks count iterations on it)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor :meth:`buffer` returns (e.g. with a compressed copy)."""
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"GradBucket.set_buffer expects a tensor, got {type(buffer).__name__}")
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer: the new buffer has {buffer.numel()} elements, "
                f"the bucket {self._buffer.numel()}; hooks may change the dtype, not the size"
            )
        self._buffer = buffer

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
            f"dtype={self._buffer.dtype}, params={len(self._parameters)}, is_last={self._is_last})"
        )
