"""ShardedTensor: a torch.Tensor whose global shape spans a mesh, holding one local shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _dispatch
from ._mesh import Mesh
from ._placement import Placement
from ._redistribute import redistribute_local
from .layout import Box, PartitionSpec

__all__ = ["ShardedTensor", "mark_sharding", "clear_sharding", "keep_grad_placement"]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))


def _global_strides(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of the global tensor laid out in the local shard's dim order.

    Autograd formulas pick their kernels from the strides they see (mm backward, for
    example, keeps a transposed weight's gradient transposed); reporting the local
    layout keeps those choices the ones single-device torch makes.
    """
    if local.ndim != len(shape) or local.is_contiguous():
        return _contiguous_strides(shape)
    order = sorted(range(local.ndim), key=lambda d: local.stride(d), reverse=True)
    strides, acc = [0] * local.ndim, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(strides)


class ShardedTensor(torch.Tensor):
    """A global tensor laid out over a :class:`Mesh` by a partition spec.

    Its ``shape``, ``dtype`` and ``requires_grad`` are those of the global tensor; the
    rank's own piece is :meth:`local_tensor`. Every torch op works on it: ops with a
    sharding rule run on the local shards, and any other op runs through a counted,
    logged fallback that gathers, computes and re-shards.
    """

    _local_tensor: torch.Tensor
    _placement: Placement
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        placement: Placement,
        global_shape: Sequence[int],
        *,
        requires_grad: bool = False,
    ) -> ShardedTensor:
        shape = torch.Size(int(s) for s in global_shape)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_global_strides(local, shape),
            dtype=local.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        out._local_tensor = local
        out._placement = placement
        return out

    # -- construction ----------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor,
        mesh: Mesh,
        partition_spec: PartitionSpec,
        global_shape: Sequence[int],
    ) -> ShardedTensor:
        """Wrap this rank's shard of a tensor of ``global_shape`` (no communication).

        ``local`` must have exactly the shape the spec gives this rank; gradients flow
        back to ``local``.
        """
        global_shape = tuple(int(s) for s in global_shape)
        placement = Placement.from_user(mesh, partition_spec, len(global_shape))
        expected = placement.box(global_shape).sizes
        if tuple(local.shape) != expected:
            raise ValueError(
                f"local shard of shape {tuple(local.shape)} does not match the shape "
                f"{expected} that spec {placement.user_spec} gives rank "
                f"{mesh.rank_at(mesh.coord())} of global shape {global_shape}"
            )
        return _FromLocal.apply(local, placement, global_shape)

    # -- accessors -------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self._placement.mesh

    @property
    def partition_spec(self) -> tuple:
        """The spec in user form: axis names, ``None`` and tuples."""
        return self._placement.user_spec

    @property
    def placement(self) -> Placement:
        return self._placement

    def local_tensor(self) -> torch.Tensor:
        """This rank's shard (differentiable). Pending partial reductions are not applied."""
        return _ToLocal.apply(self)

    def local_box(self) -> Box:
        """Where this rank's shard sits in the global index space."""
        return self._placement.box(self.shape)

    def replica_rank(self) -> int:
        """Index of this rank among the ranks holding the same shard (0 for the first)."""
        from .layout import replica_axes

        mesh, coord = self.mesh, self.mesh.coord()
        index = 0
        for axis in replica_axes(self._placement.spec, mesh.ndim):
            index = index * mesh.mesh_shape[axis] + coord[axis]
        return index

    def redistribute(
        self, partition_spec: PartitionSpec, mesh: Mesh | None = None
    ) -> ShardedTensor:
        """The same global tensor under another spec, moving only the bytes needed."""
        if mesh is not None and mesh != self.mesh:
            raise ValueError(
                f"redistribute to another mesh ({mesh}) is not supported; the tensor lives on "
                f"{self.mesh}. Gather with full_tensor() and mark_sharding on the new mesh"
            )
        dst = Placement.from_user(self.mesh, partition_spec, self.ndim)
        return _Redistribute.apply(self, dst)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable)."""
        replicated = _Redistribute.apply(self, Placement.replicated(self.mesh, self.ndim))
        return _ToLocal.apply(replicated)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"spec={self.partition_spec}, partial={self._placement.partial}, "
            f"mesh={self.mesh}, local={self._local_tensor!r})"
        )

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a ShardedTensor cannot be pickled; save it with shardkit.checkpoint.save, "
            "or pickle st.full_tensor()"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch.dispatch(func, args, kwargs or {})


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, placement, global_shape):
        ctx.placement = placement
        return ShardedTensor(local.view_as(local), placement, global_shape)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, ShardedTensor):
            return _local_under(grad, ctx.placement), None, None
        return grad[ctx.placement.box(grad.shape).slices()], None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st):
        ctx.placement, ctx.shape = st._placement, st.shape
        return st._local_tensor.view_as(st._local_tensor)

    @staticmethod
    def backward(ctx, grad):
        return ShardedTensor(grad, ctx.placement, ctx.shape)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, dst):
        ctx.src = st._placement
        local = redistribute_local(st._local_tensor, st.shape, st._placement, dst)
        return ShardedTensor(local, dst, st.shape)

    @staticmethod
    def backward(ctx, grad):
        src = ctx.src.without_partial()
        return ShardedTensor(_local_under(grad, src), src, grad.shape), None


def _local_under(st: ShardedTensor, placement: Placement) -> torch.Tensor:
    return redistribute_local(st._local_tensor, st.shape, st._placement, placement)


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> ShardedTensor:
    """Shard a tensor that every rank holds in full; each rank keeps only its slice.

    A leaf tensor (such as a parameter) gives a leaf ShardedTensor with the same
    ``requires_grad``; otherwise gradients flow back to ``t``.
    """
    if isinstance(t, ShardedTensor):
        return t.redistribute(partition_spec, mesh)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_sharding expects a torch.Tensor, got {type(t).__name__}")
    placement = Placement.from_user(mesh, partition_spec, t.ndim)
    if t.is_leaf:
        local = t.detach()[placement.box(t.shape).slices()].clone()
        st = ShardedTensor(local, placement, t.shape, requires_grad=t.requires_grad)
        if isinstance(t, torch.nn.Parameter):
            st = torch.nn.Parameter(st, requires_grad=t.requires_grad)
        if st.requires_grad:
            keep_grad_placement(st)
        return st
    replicated = _FromLocal.apply(t, Placement.replicated(mesh, t.ndim), tuple(t.shape))
    return _Redistribute.apply(replicated, placement)


def keep_grad_placement(param: ShardedTensor) -> None:
    """Make ``param.grad`` always come back with ``param``'s placement.

    Rules pick each gradient's placement by cost, so a gradient may arrive, for example,
    as a sum still pending over the data axis; this post-accumulate hook resolves it and
    lays it out like the parameter, which is what optimizers and checkpoints expect.
    """

    def hook(p: torch.Tensor) -> None:
        grad = p.grad
        target = p._placement.without_partial()
        if isinstance(grad, ShardedTensor) and grad._placement != target:
            local = redistribute_local(grad._local_tensor, grad.shape, grad._placement, target)
            p.grad = ShardedTensor(local, target, grad.shape)

    param.register_post_accumulate_grad_hook(hook)


def clear_sharding(st: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a ShardedTensor (a plain tensor passes through)."""
    return st.full_tensor() if isinstance(st, ShardedTensor) else st
