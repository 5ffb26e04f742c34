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
import torch.distributed as dist

__all__ = ["ranks_differ", "value_fingerprint"]


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


def ranks_differ(
    values: list[int], group=None, *, device: torch.device | None = None
) -> list[bool]:
    """For each of ``values``, whether it differs between the ranks of ``group``
    (collective: one all-reduce of ``2 * len(values)`` int64s; every rank gets the same
    answer)."""
    from ._collective import collective_device

    n = len(values)
    both = torch.tensor(
        [*values, *(-v for v in values)],
        dtype=torch.int64,
        device=device or collective_device(group),
    )
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    out = both.tolist()
    return [out[i] != -out[n + i] for i in range(n)]
