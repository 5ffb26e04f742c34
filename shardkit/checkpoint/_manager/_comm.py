"""The manager's control traffic on its private gloo group: JSON broadcasts and flags.

JSON, not pickle, so no rank ever unpickles what another sent. Every helper is a
no-op in a world of one.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_flags", "broadcast_json", "flags_and_ranges"]


def broadcast_json(value: Any, group: Any, size: int) -> Any:
    """Group rank 0's ``value`` on every rank (others pass anything)."""
    if group is None or size == 1:
        return value
    coordinator = dist.get_rank(group) == 0
    raw = json.dumps(value).encode() if coordinator else b""
    length = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(length, group_src=0, group=group)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if coordinator:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    dist.broadcast(buf, group_src=0, group=group)
    return json.loads(bytes(buf.numpy()))


def agree_flags(flags: list[bool], group: Any, size: int) -> list[bool]:
    """Element-wise OR of ``flags`` over the group: one small ``all_reduce(MAX)``."""
    if group is None or size == 1:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


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
