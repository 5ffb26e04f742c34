"""The manager's flag agreement on its private gloo group (a no-op in a world of one).

Its JSON broadcasts go through ``runtime._json_broadcast.broadcast_json``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["flags_and_ranges"]


def flags_and_ranges(
    flags: list[bool], values: list[int], group: Any, size: int
) -> tuple[list[bool], list[tuple[int, int]]]:
    """OR of ``flags`` and the (min, max) of each of ``values`` over the group.

    One small ``all_reduce(MAX)`` of ``flags + values + [-v for v in values]``.
    """
    if group is None or size == 1:
        return list(flags), [(v, v) for v in values]
    n = len(values)
    t = torch.tensor([int(f) for f in flags] + values + [-v for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    out = t.tolist()
    k = len(flags)
    ranges = [(-out[k + n + i], out[k + i]) for i in range(n)]
    return [bool(v) for v in out[:k]], ranges
