"""``torch.distributed.checkpoint.default_planner``'s names: the default planners."""

from ._core._planner import DefaultLoadPlanner, DefaultSavePlanner

__all__ = ["DefaultLoadPlanner", "DefaultSavePlanner"]
