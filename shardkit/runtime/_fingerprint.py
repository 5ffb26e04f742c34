"""A cheap fingerprint of tensor values, to tell whether the ranks hold the same ones.

Wrappers that keep each rank's own copy of a parameter (FSDP without
``sync_module_states``, ``shard_module``, ``SpmdFullyShardedDataParallel``) silently mix
the ranks' values when the ranks were not seeded alike. Hashing every byte would cost a
pass over the model; different random initialisations already differ in each tensor's
first and last element, so those are what is compared. A heuristic: it misses values
that differ only in between, and it is only ever used to warn.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

__all__ = ["value_fingerprint"]


def value_fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """crc32 of each tensor's first and last element (empty and meta tensors left out)."""
    ends: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and t.device.type != "meta":
            t = t.detach()  # indexing makes views: no copy of a non-contiguous tensor
            first, last = t[(0,) * t.dim()], t[(-1,) * t.dim()]
            ends.setdefault(t.dtype, []).extend((first.reshape(1), last.reshape(1)))
    crc = 0
    for dtype in sorted(ends, key=str):
        joined = torch.cat(ends[dtype]).cpu()
        crc = zlib.crc32(joined.view(torch.uint8).numpy().tobytes(), crc)
    return crc
