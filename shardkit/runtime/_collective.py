"""Which device a process group's collectives take their tensors on.

One rule for every shardkit collective outside a training step (JSON exchanges, flags,
a state dict broadcast from rank 0), read from the group's backend configuration
(``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``, ``"cpu:gloo,cuda:nccl"``...):

* a group with a CPU backend (gloo, or the ``cpu:`` part of a mixed group) takes small
  control traffic on the CPU: it is what gloo serves, and it costs no host-to-device copy
  nor a GPU synchronisation;
* a group whose only backend is NCCL takes everything on this rank's current CUDA device
  (NCCL serves CUDA tensors only);
* bulk tensor data (``bulk=True``: a model's weights) goes on the CUDA device whenever
  the group has NCCL for CUDA, mixed groups included, since NCCL moves it far faster.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["collective_device", "ranks_differ"]


def _backends(group: Any) -> dict[str, str]:
    """``{device type: backend}`` of ``group`` (None: the default group)."""
    try:
        spec = dist.get_backend_config(group)
    except (AttributeError, RuntimeError, ValueError):  # a group torch keeps no config of
        spec = str(dist.get_backend(group))
    out: dict[str, str] = {}
    for part in str(spec).lower().split(","):
        device, sep, name = part.strip().rpartition(":")
        if not sep:  # a bare backend name, as dist.get_backend gives it
            device = "cuda" if name == "nccl" else "cpu"
        out.setdefault(device, name)
    return out


def collective_device(group: Any = None, *, bulk: bool = False) -> torch.device:
    """The device for tensors sent over ``group``'s collectives (None: the default group).

    CPU when the group has a CPU backend, else this rank's current CUDA device when the
    group runs NCCL. With ``bulk=True`` (large tensor data) the CUDA device wins whenever
    the group has NCCL, so ``"cpu:gloo,cuda:nccl"`` sends JSON bytes and flags through
    gloo on the CPU but weights through NCCL. See the module docstring.
    """
    backends = _backends(group)
    if backends.get("cuda") == "nccl" and (bulk or "cpu" not in backends):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_differ(
    values: list[int], group=None, *, device: torch.device | None = None
) -> list[bool]:
    """For each of ``values``, whether it differs between the ranks of ``group``
    (collective: one all-reduce of ``2 * len(values)`` int64s; every rank gets the same
    answer)."""
    n = len(values)
    both = torch.tensor(
        [*values, *(-v for v in values)],
        dtype=torch.int64,
        device=device or collective_device(group),
    )
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    out = both.tolist()
    return [out[i] != -out[n + i] for i in range(n)]
