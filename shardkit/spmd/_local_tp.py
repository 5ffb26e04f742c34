"""Tensor parallelism with plain local activations (``shard_module(..., activations="local")``).

A column-parallel linear (weight split over its output features) returns this rank's
columns of its output as a plain tensor; the next row-parallel linear (weight split over
its input features) takes them, and one all-reduce of its output makes the activation
whole again. Everything between the two runs on plain local tensors, and everything
else on plain replicated ones, so no op but these linears goes through the
``ShardedTensor`` dispatcher. This is the Megatron layout, and what torch's
``ColwiseParallel`` / ``RowwiseParallel`` do with their default local outputs.

In backward, the gradient of a column-parallel layer's input is each rank's share of a
sum: one all-reduce per input makes it whole. Column-parallel layers that read the same
tensor in one forward of the sharded module, or of their parent module (q, k and v in
attention; gate and up in the MLP), share that one all-reduce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import _comm
from ._mesh import Mesh
from ._sharded_tensor import ShardedTensor, mark_sharding

__all__ = ["apply_local"]

COLUMN, ROW = "column", "row"


@dataclass
class _Region:
    """Inputs of column-parallel layers during one forward of the sharded module or of a
    column-parallel layer's parent (the parent's forward runs again, alone, when
    activation checkpointing recomputes it), so the layers reading one tensor share the
    backward all-reduce of its gradient."""

    mesh: Mesh
    depth: int = 0
    entered: dict = field(default_factory=dict)

    def start(self, *_args, **_kwargs) -> None:
        if self.depth == 0:
            self.entered.clear()
        self.depth += 1

    def stop(self, *_args, **_kwargs) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.entered.clear()

    def watch(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.start)
        module.register_forward_hook(self.stop, always_call=True)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if not self.depth:  # a layer called on its own: nothing to share with
            return _EnterRegion.apply(x, self.mesh)
        # keyed by id: the entry holds ``x``, so no other tensor takes its id meanwhile
        hit = self.entered.get(id(x))
        if hit is not None and hit[1] == x._version:
            return hit[2]
        entered = _EnterRegion.apply(x, self.mesh)
        self.entered[id(x)] = (x, x._version, entered)
        return entered


class _EnterRegion(torch.autograd.Function):
    """Identity forward; backward sums the ranks' shares of the input gradient."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _comm.all_reduce(grad.contiguous(), ctx.mesh, (0,)), None


class _LeaveRegion(torch.autograd.Function):
    """Forward sums the ranks' partial outputs; backward passes the (replicated) gradient."""

    @staticmethod
    def forward(ctx, partial, mesh):
        if partial.is_contiguous():
            ctx.mark_dirty(partial)  # reduced in place: F.linear's fresh output
        else:
            partial = partial.contiguous()
        return _comm.all_reduce(partial, mesh, (0,))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _plain(x):
    """A plain tensor: a ShardedTensor input is made whole (no traffic if replicated)."""
    return x.full_tensor() if isinstance(x, ShardedTensor) else x


def _column_forward(linear: nn.Linear, region: _Region, x: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.local_tensor()
    return F.linear(region.enter(_plain(x)), linear.weight.local_tensor(), bias)


def _row_forward(linear: nn.Linear, region: _Region, x: torch.Tensor) -> torch.Tensor:
    x = _plain(x)
    weight = linear.weight.local_tensor()
    if x.shape[-1] != weight.shape[-1]:
        if x.shape[-1] != linear.in_features:
            raise ValueError(
                f"row-parallel {linear} got an input of {x.shape[-1]} features: it takes "
                f"this rank's {weight.shape[-1]} (a column-parallel layer's local output) "
                f"or all {linear.in_features}"
            )
        box = linear.weight.local_box()
        x = x[..., box.offsets[1] : box.offsets[1] + box.sizes[1]]
    out = _LeaveRegion.apply(F.linear(x, weight), region.mesh)
    return out if linear.bias is None else out + linear.bias


def linear_role(module: nn.Module, leaf: str, spec: tuple) -> str | None:
    """``COLUMN`` or ``ROW`` for a linear's weight split over one axis along dim 0 or 1, the
    role a bias split along dim 0 implies (``COLUMN``), None for a replicated tensor; a
    ValueError for anything local activations cannot run."""
    if all(not axes for axes in spec):
        return None
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"activations='local' shards only nn.Linear layers; a {type(module).__name__} "
            f"parameter matched spec {spec}. Use activations='sharded' for this model"
        )
    if leaf == "bias" and spec == ((0,),):
        return COLUMN
    if leaf == "weight" and spec in (((0,), ()), ((), (0,))):
        return COLUMN if spec[0] else ROW
    raise ValueError(
        f"activations='local' splits a linear's weight over its output features "
        f"(spec ('axis', None)) or its input features ((None, 'axis')), and a column-"
        f"parallel bias over dim 0; got {leaf} spec {spec}"
    )


def apply_local(module: nn.Module, mesh: Mesh, roles: dict[nn.Linear, str]) -> None:
    """Shard each linear of ``roles`` and give it its local forward; other parameters
    stay plain tensors."""
    region = getattr(module, "_shardkit_local_region", None)
    if region is None:
        region = _Region(mesh)
        region.watch(module)
        module._shardkit_local_region = region
    elif region.mesh != mesh:
        raise ValueError(f"module is already tensor-parallel over {region.mesh}, not {mesh}")
    parents = {
        id(child): parent
        for parent in module.modules()
        if parent is not module
        for child in parent.children()
    }
    axis = mesh.axis_labels[0]
    for linear, role in roles.items():
        if "forward" in vars(linear):  # sharded before, by an earlier call
            continue
        specs = {"weight": (axis, None) if role == COLUMN else (None, axis)}
        if role == COLUMN:
            specs["bias"] = (axis,)
            parent = parents.get(id(linear))
            if parent is not None and not getattr(parent, "_shardkit_watched", False):
                region.watch(parent)
                parent._shardkit_watched = True
        for leaf, spec in specs.items():
            param = getattr(linear, leaf)
            if param is not None and not isinstance(param, ShardedTensor):
                setattr(linear, leaf, mark_sharding(param, mesh, spec))
        forward = _column_forward if role == COLUMN else _row_forward
        linear.forward = functools.partial(forward, linear, region)
