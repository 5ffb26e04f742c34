"""Rank 0's JSON value on every rank of a process group: its length, then its bytes.

Never pickle (``broadcast_object_list`` unpickles what rank 0 sent). Shared by the
checkpoint layer's CheckpointManager (its coordinator's answers) and the state-dict
helpers (``broadcast_from_rank0``'s header); see ``_json_gather.py`` for the all-gather.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ._collective import collective_device

__all__ = ["broadcast_json"]


def broadcast_json(obj: Any, group: Any = None, *, device: torch.device | None = None) -> Any:
    """Group rank 0's ``obj`` (a JSON value) on every rank; the others pass anything.

    A collective over ``group`` (None: the default group), even in a group of one.

    Args:
        device: where the exchanged tensors live; default: :func:`collective_device`.
    """
    if device is None:
        device = collective_device(group)
    root = dist.get_rank(group) == 0
    raw = json.dumps(obj).encode() if root else b""
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(size, group_src=0, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if root:
        buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    dist.broadcast(buf, group_src=0, group=group)
    return json.loads(bytes(buf.cpu().numpy()))
