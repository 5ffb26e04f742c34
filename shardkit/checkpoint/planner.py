"""``torch.distributed.checkpoint.planner``'s names: planner interfaces and plan items."""

from ._core._planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem

__all__ = ["LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner", "WriteItem"]
