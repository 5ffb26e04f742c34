"""``torch.distributed.checkpoint.stateful``'s name: the :class:`Stateful` protocol."""

from ._core._flatten import Stateful

__all__ = ["Stateful"]
