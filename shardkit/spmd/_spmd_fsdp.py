"""Fully sharded data parallelism expressed as SPMD sharding (like XLA's FSDPv2).

Every parameter is stored sharded along its first dim over the ``'fsdp'`` mesh axis and
the batch is sharded over the same axis. Right before a submodule runs, its own
parameters are all-gathered (one gather per parameter, layer by layer, never the whole
model at once); their gradients flow back through the gather, so each arrives as this
rank's shard, already summed over the batch shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._mesh import Mesh
from ._module import check_across_ranks
from ._sharded_tensor import ShardedTensor, mark_sharding

__all__ = ["SpmdFullyShardedDataParallel"]


class SpmdFullyShardedDataParallel(nn.Module):
    """Shard ``module``'s parameters and batch over a mesh axis; gather per layer.

    Args:
        module: the model; its parameters are replaced in place by sharded ones.
        mesh: the device mesh; it must have an axis named ``shard_axis``.
        shard_axis: the mesh axis parameters and batch are sharded over.
        extra_data_axis: another mesh axis the batch (only) is also split over, for
            data parallelism across FSDP groups; parameters stay replicated over it.

    Plain tensor inputs are sharded along dim 0 (the batch); ShardedTensor inputs are
    used as given. A parameter shared by several modules (tied weights) stays shared.
    Gathered parameters stay alive until backward has used them (like ZeRO-2's
    ``reshard_after_forward=False``).
    """

    _shardkit_wrapper = True
    #: DistributedDataParallel refuses to wrap it: its parameters are shards
    _shardkit_sharded = True

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        *,
        shard_axis: str = "fsdp",
        extra_data_axis: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        for axis in (shard_axis, extra_data_axis):
            if axis is not None and axis not in mesh.axis_labels:
                raise ValueError(
                    f"mesh axis {axis!r} not in the mesh's axes {mesh.axis_labels}; "
                    f"build the mesh with an axis named {axis!r} or pass shard_axis="
                )
        if extra_data_axis == shard_axis:
            raise ValueError(f"extra_data_axis {extra_data_axis!r} must differ from shard_axis")
        self.module = module
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.extra_data_axis = extra_data_axis
        self._handles = []
        # a parameter owned by several modules (tied embeddings) is sharded once and the
        # one sharded parameter set on every owner, so the tie holds and its gradient
        # sums what flows back through each owner's gather
        check_across_ranks(
            [p for p in module.parameters() if not isinstance(p, ShardedTensor)],
            "SpmdFullyShardedDataParallel",
            layout=repr(
                (
                    shard_axis,
                    extra_data_axis,
                    [(n, tuple(p.shape)) for n, p in module.named_parameters()],
                )
            ),
        )
        sharded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, new)
        for sub in module.modules():
            names = [n for n, p in sub.named_parameters(recurse=False) if p is not None]
            for name in names:
                param = sub._parameters[name]
                if id(param) not in sharded:
                    spec = (shard_axis,) + (None,) * (param.ndim - 1) if param.ndim else ()
                    sharded[id(param)] = (param, mark_sharding(param, mesh, spec))
                setattr(sub, name, sharded[id(param)][1])
            if names:
                self._handles.append(sub.register_forward_pre_hook(_gather_hook(names)))
                self._handles.append(sub.register_forward_hook(_release_hook(names)))

    def _batch_spec(self, ndim: int) -> tuple:
        axes = (self.extra_data_axis, self.shard_axis) if self.extra_data_axis else self.shard_axis
        return (axes,) + (None,) * (ndim - 1)

    def _shard_input(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor) and value.ndim:
            return mark_sharding(value, self.mesh, self._batch_spec(value.ndim))
        return value

    def forward(self, *args, **kwargs):
        args = tuple(self._shard_input(a) for a in args)
        kwargs = {k: self._shard_input(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)


def _gather_hook(names: Sequence[str]):
    def hook(module: nn.Module, args) -> None:
        for name in names:
            param = module._parameters[name]
            # an instance attribute shadows the parameter for the duration of forward
            module.__dict__[name] = param.redistribute((None,) * param.ndim)

    return hook


def _release_hook(names: Sequence[str]):
    def hook(module: nn.Module, args, output) -> None:
        for name in names:
            module.__dict__.pop(name, None)

    return hook
