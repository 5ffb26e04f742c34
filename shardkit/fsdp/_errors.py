"""FSDP's error class (its own module: every other FSDP module may import it)."""

from __future__ import annotations

__all__ = ["FSDPUsageError"]


class FSDPUsageError(ValueError, RuntimeError):
    """A misuse of FSDP; both a ValueError and the RuntimeError torch / torch_xla raise."""
