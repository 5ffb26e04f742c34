"""DDP's error classes: communication-hook mistakes, and a module with nothing to train."""

from __future__ import annotations

__all__ = ["CommHookError", "ModelMismatchError", "NothingToTrainError"]


class CommHookError(TypeError, ValueError, RuntimeError):
    """A communication hook mistake: registered twice, mis-annotated, or a bad return.

    torch raises RuntimeError, ValueError or TypeError for these; this class is all
    three, so ``except`` clauses written for torch's DDP catch it.
    """


class NothingToTrainError(ValueError, RuntimeError):
    """DDP around a module with no parameter that requires grad.

    torch raises RuntimeError; shardkit raised ValueError (a wrong argument). This class
    is both, so either ``except`` clause catches it.
    """


class ModelMismatchError(ValueError, RuntimeError):
    """DDP's ranks hold different parameters (count, sizes or dtypes).

    torch raises RuntimeError; a wrong model is a ValueError here. This class is both.
    """
