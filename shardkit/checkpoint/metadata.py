"""``torch.distributed.checkpoint.metadata``'s name: a checkpoint's :class:`Metadata`."""

from ._core._format import Metadata

__all__ = ["Metadata"]
