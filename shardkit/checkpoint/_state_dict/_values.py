"""Value conversions for the state-dict helpers: gather, offload, and re-shard a full
value like the tensor it is loaded into."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ...spmd import ShardedTensor, mark_sharding
from ...spmd._comm import exchange_label
from .._core._errors import StateDictMismatchError
from .._core._planner import on_rank

__all__ = ["is_sharded", "export_value", "import_value", "check_compatible"]


def is_sharded(value: object) -> bool:
    """A torch ``DTensor`` or a shardkit ``ShardedTensor``."""
    return isinstance(value, (DTensor, ShardedTensor))


_SAME_CALL = (
    "the state-dict helpers gather sharded values key by key, so every rank must pass the "
    "same model, submodules and StateDictOptions (ignore_frozen_params, full_state_dict)"
)


def export_value(value: object, *, full: bool, cpu: bool, key: str) -> object:
    """A value as it goes into a returned state dict (detached, gathered / offloaded).

    A shardkit ``ShardedTensor``'s gather compares ``key`` across the ranks at no extra
    cost, so a rank that gathers another key of the same shape raises instead of
    returning that key's values (a torch ``DTensor``'s gather has no such check)."""
    if not isinstance(value, torch.Tensor):
        return value
    with torch.no_grad():
        value = value.detach()
        if full and is_sharded(value):
            with exchange_label({"state dict key": key}, _SAME_CALL):
                value = value.full_tensor()
        if cpu and not is_sharded(value):
            value = value.cpu()
    return value


def _device(value: torch.Tensor, target: torch.Tensor) -> torch.device:
    """Where a value for ``target`` lives: the target's device, or the value's own where
    the target is on the meta device (it is materialised there, as torch does)."""
    return value.device if target.device.type == "meta" else target.device


def _local_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The plain full ``value`` laid out like the sharded ``target`` (no communication)."""
    value = value.to(device=_device(value, target), dtype=target.dtype)
    if isinstance(target, DTensor):
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    assert isinstance(target, ShardedTensor)
    return mark_sharding(value, target.mesh, target.partition_spec)


def import_value(value: object, target: object) -> object:
    """``value`` converted so it can be copied into ``target``.

    A full value meant for a sharded target is sliced locally; a sharded value meant for a
    plain target is gathered; a plain value moves to the target's device (its own device
    for a meta target) and is cast to the target's dtype, as ``copy_`` would.
    """
    if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
        return value
    with torch.no_grad():
        value = value.detach()
        if is_sharded(target) and not is_sharded(value):
            return _local_like(value, target)
        if is_sharded(value) and not is_sharded(target):
            value = value.full_tensor()
        if isinstance(value, ShardedTensor) and isinstance(target, DTensor):
            return _local_like(value.full_tensor(), target)
        if isinstance(value, DTensor) and isinstance(target, ShardedTensor):
            return _local_like(value.full_tensor(), target)
        if not is_sharded(value):
            value = value.to(device=_device(value, target), dtype=target.dtype)
    return value


def check_compatible(key: str, value: object, target: object, *, what: str) -> None:
    """Raise :class:`StateDictMismatchError` naming ``key`` and both shapes on a shape
    mismatch (dtypes are cast, as torch's ``load_state_dict``)."""
    if not isinstance(target, torch.Tensor):
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{what} key {key!r}: expected a tensor of shape {tuple(target.shape)} and dtype "
            f"{target.dtype}, got {type(value).__name__}"
        )
    if tuple(value.shape) != tuple(target.shape):
        raise StateDictMismatchError(
            f"{on_rank()}{what} key {key!r}: size mismatch, the state dict has "
            f"{tuple(value.shape)} but the model expects {tuple(target.shape)}"
        )
