"""FSDP's error classes (their own module: every other FSDP module may import it)."""

from __future__ import annotations

__all__ = ["FSDPUsageError", "ModelMismatchError"]


class FSDPUsageError(ValueError, RuntimeError):
    """A misuse of FSDP; both a ValueError and the RuntimeError torch / torch_xla raise."""


class ModelMismatchError(FSDPUsageError):
    """FSDP's ranks hold different parameters (names, order, shapes, dtypes or
    ``requires_grad``) in the module they wrap: each rank would keep rows of a different
    tensor, or the collectives would not match. DDP raises its class of the same name."""
