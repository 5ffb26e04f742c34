"""DDP's error class for communication-hook mistakes."""

from __future__ import annotations

__all__ = ["CommHookError"]


class CommHookError(TypeError, ValueError, RuntimeError):
    """A communication hook mistake: registered twice, mis-annotated, or a bad return.

    torch raises RuntimeError, ValueError or TypeError for these; this class is all
    three, so ``except`` clauses written for torch's DDP catch it.
    """
