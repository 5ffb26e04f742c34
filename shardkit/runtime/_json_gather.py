"""Every rank's JSON value over a process group: lengths, then padded bytes.

Never pickle (``all_gather_object`` unpickles what another rank sent). Shared by the
checkpoint layer's agreements and DDP's model-mismatch report, which sits beside the
checkpoint layer and cannot import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json"]


def all_gather_json(
    obj: Any,
    group: Any,
    *,
    device: torch.device,
    gather: Callable[[list[torch.Tensor], torch.Tensor], None] | None = None,
) -> list[Any]:
    """Every rank's ``obj`` (a JSON value), in group rank order.

    Args:
        device: where the exchanged tensors live (the group's backend decides).
        gather: ``dist.all_gather`` over ``group`` unless given (a caller's wrapper that
            explains a timeout, say).
    """
    if gather is None:

        def gather(outs: list[torch.Tensor], mine: torch.Tensor) -> None:
            dist.all_gather(outs, mine, group=group)

    raw = json.dumps(obj, separators=(",", ":")).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(device)
    outs = [torch.empty_like(buf) for _ in range(world)]
    gather(outs, buf)
    return [json.loads(bytes(o[:n].cpu().numpy())) for o, n in zip(outs, lengths)]
