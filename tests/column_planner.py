"""A custom save planner for tests: every 2-d box is stored as several column chunks."""

import shardkit.checkpoint as dcp


class ColumnPlanner(dcp.DefaultSavePlanner):
    """Stores every 2-d box as column pieces of the given widths (the rest last), or as
    two halves when no widths are given: a custom global plan whose chunks fill each
    destination row side by side."""

    def __init__(self, widths=None):
        super().__init__()
        self.widths = widths

    def create_global_plan(self, plans):
        out = super().create_global_plan(plans)
        for plan in out:
            split = []
            for item in plan.items:
                (r, c), (nr, nc) = item.box.offsets, item.box.sizes
                edges = [0]
                for w in self.widths if self.widths is not None else [nc // 2]:
                    edges.append(min(nc, edges[-1] + w))
                edges.append(nc)
                for a, b in zip(edges, edges[1:]):
                    if b > a:
                        box = type(item.box)((r, c + a), (nr, b - a))
                        split.append(dcp.WriteItem(item.key, box, item.shape, item.dtype))
            plan.items[:] = split
        return out
