"""ShardedTensor: a torch.Tensor whose global shape spans a mesh, holding one local shard."""

from __future__ import annotations

import dis
import functools
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import EllipsisType

import torch

from . import _dispatch
from ._mesh import Mesh
from ._placement import Placement
from ._redistribute import redistribute_local
from .layout import Box, PartitionSpec

__all__ = [
    "ShardedTensor",
    "ShardingType",
    "XLAShard",
    "mark_sharding",
    "mark_sharding_with_gradients",
    "clear_sharding",
    "keep_grad_placement",
]


class ShardingType(IntEnum):
    """How a tensor is laid out, with torch_xla's names and values."""

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


@dataclass
class XLAShard:
    """One shard of a :class:`ShardedTensor` on this process (torch_xla's ``XLAShard``).

    ``data`` is a detached copy, padded with zeros to the size of the largest shard as
    XLA pads; ``indices`` are its slices of the global tensor (``...`` when the tensor is
    replicated); ``unpadded_data`` drops the padding.
    """

    data: torch.Tensor
    indices: EllipsisType | list[slice]
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """``data`` without the padding; assigning to it writes into ``data`` (as
        torch_xla's setter; the shard's tensor itself is not changed)."""
        if self.indices is Ellipsis:
            return self.data
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]

    @unpadded_data.setter
    def unpadded_data(self, value: torch.Tensor) -> None:
        target = self.unpadded_data
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"XLAShard.unpadded_data: a tensor of shape {tuple(target.shape)} is needed, "
                f"got {tuple(value.shape)}"
            )
        target.copy_(value)


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))


def _global_strides(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of the global tensor laid out in the local shard's dim order.

    Autograd formulas pick their kernels from the strides they see (mm backward, for
    example, keeps a transposed weight's gradient transposed); reporting the local
    layout keeps those choices the ones single-device torch makes. The order comes from
    the raw strides, not ``is_contiguous()``, which ignores dims of size 0 or 1: a rank
    whose uneven shard has one row must report the same order as the others, or
    autograd takes another path there (``AccumulateGrad`` copying instead of stealing
    the gradient) and the ranks call different collectives.
    """
    if local.ndim != len(shape):
        return _contiguous_strides(tuple(shape))
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

    #: DistributedDataParallel refuses it as a parameter (DDP replicates whole tensors)
    _shardkit_sharded = True

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
        strides: Sequence[int] | None = None,
    ) -> ShardedTensor:
        # rules pass torch.Size or tuples of ints; anything else (SymInts, numpy ints) is
        # converted
        shape = (
            global_shape
            if type(global_shape) is torch.Size
            else torch.Size(int(s) for s in global_shape)
        )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_global_strides(local, shape) if strides is None else strides,
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
        """The mesh the tensor is laid out on."""
        return self._placement.mesh

    @property
    def partition_spec(self) -> tuple:
        """The spec in user form: axis names, ``None`` and tuples."""
        return self._placement.user_spec

    @property
    def placement(self) -> Placement:
        """How the tensor is laid out: mesh, normalized spec and pending sums."""
        return self._placement

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's shape (torch_xla's ``XLAShardedTensor.mesh_shape``)."""
        return self._placement.mesh.mesh_shape

    @property
    def global_tensor(self) -> torch.Tensor:
        """The whole tensor, detached (torch_xla's attribute); a collective: call it on
        every rank. Use :meth:`full_tensor` to keep the autograd graph."""
        return self.full_tensor().detach()

    @property
    def sharding_type(self) -> ShardingType:
        """MAXIMAL on one device, REPLICATED when no dim is split, TILED when every mesh
        axis of size > 1 splits a dim, PARTIAL when the shards are also replicated."""
        mesh = self._placement.mesh
        used = {a for axes in self._placement.spec for a in axes}
        if mesh.size() == 1:
            return ShardingType.MAXIMAL
        if not used:
            return ShardingType.REPLICATED
        if all(a in used for a, n in enumerate(mesh.mesh_shape) if n > 1):
            return ShardingType.TILED
        return ShardingType.PARTIAL

    @property
    def local_shards(self) -> list[XLAShard]:
        """This process's shard as torch_xla's ``local_shards`` (one device per process).

        Pending sums are resolved first (a collective when there are any).
        """
        from .. import runtime

        placement = self._placement.without_partial()
        local = _local_under(self, placement).detach()
        kind = self.sharding_type
        rank = runtime.global_ordinal()
        device = f"{local.device.type.upper()}:{rank}"
        if kind in (ShardingType.REPLICATED, ShardingType.MAXIMAL):
            replica = rank if kind is ShardingType.REPLICATED else 0
            return [XLAShard(local.clone(), Ellipsis, device, replica)]
        box = placement.box(self.shape)
        largest = placement.box(self.shape, coord=(0,) * self.mesh.ndim).sizes
        data = local.new_zeros(largest)
        data[tuple(slice(0, n) for n in box.sizes)] = local
        replica = 0 if kind is ShardingType.TILED else self.replica_rank()
        return [XLAShard(data, list(box.slices()), device, replica)]

    def load_local_shards_(self, shards: Sequence[XLAShard]) -> None:
        """Write this process's shard back from :attr:`local_shards`-style shards."""
        placement = self._placement.without_partial()
        box = placement.box(self.shape)
        whole = self.sharding_type in (ShardingType.REPLICATED, ShardingType.MAXIMAL)
        mine = None if whole else list(box.slices())
        for shard in shards:
            indices = None if shard.indices is Ellipsis else list(shard.indices)
            if indices == mine:
                value = shard.unpadded_data
                if tuple(value.shape) != box.sizes:
                    raise ValueError(
                        f"shard data of shape {tuple(value.shape)} does not fit this rank's "
                        f"shard {box.sizes}"
                    )
                self._local_tensor = value.to(self.dtype).clone()
                self._placement = placement
                return
        raise ValueError(
            f"none of the {len(shards)} shards has this rank's indices "
            f"{'...' if mine is None else mine}; pass the shards local_shards returned here"
        )

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

    def tolist(self):
        """The full tensor's values as nested lists (torch refuses ``tolist`` for tensor
        subclasses). Collective, as :meth:`full_tensor`: call it on every rank."""
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False):
        """The full tensor as a numpy array (torch refuses ``numpy`` for tensor
        subclasses). Collective, as :meth:`full_tensor`: call it on every rank."""
        return self.full_tensor().numpy(force=force)

    def requires_grad_(self, requires_grad: bool = True) -> ShardedTensor:
        """As torch's; a leaf that starts requiring grad (``nn.Parameter(st)``, a deep
        copy of a sharded module, ``from_local(...).requires_grad_()``) gets its gradient
        laid out like itself, as :func:`mark_sharding` does (see ``keep_grad_placement``)."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            keep_grad_placement(self)
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a ShardedTensor cannot be pickled; save it with shardkit.checkpoint.save, "
            "or pickle st.full_tensor()"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch.dispatch(func, args, kwargs or {})

    def __setitem__(self, key, value) -> None:
        """``st[key] = value``: with ints and slices, each rank writes the selected
        entries of its own shard (torch's slice-then-copy would write into a copy of a
        sharded dim's slice and be lost); other keys take torch's indexing path."""
        from ._setitem import basic_key, write_basic

        index = basic_key(key, self.shape)
        if index is None:
            return super().__setitem__(key, value)
        if torch.is_grad_enabled() and (
            self.requires_grad or (isinstance(value, torch.Tensor) and value.requires_grad)
        ):
            whole = [slice(0, n, 1) for n in self.shape]
            spec = self._placement.spec
            if all(not axes or k == w for k, w, axes in zip(index, whole, spec)):
                return super().__setitem__(key, value)  # a view of the shard: autograd sees it
            raise NotImplementedError(
                "st[key] = value selecting part of a sharded dim, under autograd: write under "
                "torch.no_grad(), or build the result out of place (torch.where, torch.cat)"
            )
        write_basic(self, index, value)


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
        # a pending sum's addend: each rank's gradient is the sum's gradient, replicated
        # (as DTensor's to_local); kept pending, the ranks' copies would be summed again
        return ShardedTensor(grad, ctx.placement.without_partial(), ctx.shape)


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


_WARNED_SITES: set[tuple[str, int]] = set()


def _result_discarded() -> tuple[str, int] | None:
    """``(file, line)`` of the code that called mark_sharding when it drops the call's result (a bare
    ``xs.mark_sharding(t, ...)`` statement, as torch_xla code writes it), else None.

    Reads the caller's bytecode: the instruction after the call is ``POP_TOP``.
    """
    try:
        frame = sys._getframe(3)
        if _pops_result(frame.f_code, frame.f_lasti):
            return frame.f_code.co_filename, frame.f_lineno
    except (ValueError, AttributeError):  # no such frame, or an unusual interpreter
        return None
    return None


@functools.lru_cache(maxsize=1024)
def _pops_result(code, lasti: int) -> bool:
    for ins in dis.get_instructions(code):
        if ins.offset > lasti:
            return ins.opname == "POP_TOP"
    return False


def _warn_if_discarded(t: torch.Tensor) -> None:
    site = _result_discarded()
    if site is None or site in _WARNED_SITES:
        return
    _WARNED_SITES.add(site)
    fix = (
        "for a module's parameters, shard them in place with "
        "xs.shard_module(module, mesh, {name_pattern: spec}) (it keeps tied weights)"
        if isinstance(t, torch.nn.Parameter)
        else "assign the result: t = xs.mark_sharding(t, mesh, spec)"
    )
    warnings.warn(
        f"{site[0]}:{site[1]}: the result of xs.mark_sharding is discarded, so the tensor "
        "stays unsharded. Unlike torch_xla, shardkit cannot annotate a tensor in place: "
        f"mark_sharding returns a new ShardedTensor; {fix}",
        UserWarning,
        stacklevel=3,
    )


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> ShardedTensor:
    """Shard a tensor that every rank holds in full; each rank keeps only its slice.

    Returns a new tensor and leaves ``t`` as it is (torch_xla annotates ``t`` in place):
    assign the result. A bare ``xs.mark_sharding(t, ...)`` statement warns once per line.
    A leaf tensor (such as a parameter) gives a leaf ShardedTensor with the same
    ``requires_grad``; otherwise gradients flow back to ``t``.
    """
    out = _mark_sharding(t, mesh, partition_spec)
    _warn_if_discarded(t)
    return out


def _mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec) -> ShardedTensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_sharding expects a torch.Tensor, got {type(t).__name__}")
    placement = Placement.from_user(mesh, partition_spec, t.ndim)
    if isinstance(t, ShardedTensor):
        if t._placement == placement:
            return t
        raise ValueError(
            f"mark_sharding: the tensor is already sharded as {t.partition_spec} on {t.mesh}, "
            f"not {tuple(partition_spec)} on {mesh}; resharding moves data, so say so: "
            "st.redistribute(spec), or xs.clear_sharding(st) first (as torch_xla, which "
            "refuses to re-annotate)"
        )
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


class _WithGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st, dst):
        ctx.dst = dst
        local = redistribute_local(st._local_tensor, st.shape, st._placement, dst)
        return ShardedTensor(local, dst, st.shape)

    @staticmethod
    def backward(ctx, grad):
        dst = ctx.dst.without_partial()
        return ShardedTensor(_local_under(grad, dst), dst, grad.shape), None


def mark_sharding_with_gradients(
    t: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec
) -> ShardedTensor:
    """Like :func:`mark_sharding` for intermediate tensors, and the gradient that flows
    back through the result keeps the same sharding (torch_xla's API of that name).

    When ``t`` is a ShardedTensor its gradient arrives sharded by ``partition_spec``;
    a plain ``t`` is whole on every rank, so its gradient arrives whole.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"mark_sharding_with_gradients expects a torch.Tensor, got {type(t).__name__}"
        )
    if not isinstance(t, ShardedTensor):
        t = _FromLocal.apply(t, Placement.replicated(mesh, t.ndim), tuple(t.shape))
    elif mesh != t.mesh:
        raise ValueError(
            f"mark_sharding_with_gradients: the tensor lives on {t.mesh}, not on {mesh}; "
            "gather it with full_tensor() first"
        )
    dst = Placement.from_user(mesh, partition_spec, t.ndim)
    return _WithGradients.apply(t, dst)


def keep_grad_placement(param: ShardedTensor) -> None:
    """Make ``param.grad`` always come back with ``param``'s placement.

    Rules pick each gradient's placement by cost, so a gradient may arrive, for example,
    as a sum still pending over the data axis; this post-accumulate hook resolves it and
    lays it out like the parameter, which is what optimizers and checkpoints expect.
    """
    if param.__dict__.get("_keeps_grad_placement") == id(param):
        return  # hooked already (a copy's flag, copied with __dict__, names the original)
    param.__dict__["_keeps_grad_placement"] = id(param)

    def hook(p: torch.Tensor) -> None:
        grad = p.grad
        target = p._placement.without_partial()
        if isinstance(grad, ShardedTensor) and grad._placement != target:
            local = redistribute_local(grad._local_tensor, grad.shape, grad._placement, target)
            p.grad = ShardedTensor(local, target, grad.shape)

    strides = param.stride()

    def same_strides(grad: torch.Tensor) -> torch.Tensor:
        # AccumulateGrad keeps a gradient whose strides are the parameter's and copies
        # any other (into the gradient's own layout, resolving a pending sum on the
        # way). A gradient's global strides follow each rank's local layout, which
        # uneven shards can make differ between ranks: then one rank would copy
        # (all-reduce) while another keeps it (reduce-scatter below), a collective
        # mismatch. The layout lives in the local tensor; report the parameter's.
        if isinstance(grad, ShardedTensor) and grad.stride() != strides:
            return ShardedTensor(grad._local_tensor, grad._placement, grad.shape, strides=strides)
        return grad

    param.register_hook(same_strides)
    param.register_post_accumulate_grad_hook(hook)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a ShardedTensor (a plain tensor passes through)."""
    return t.full_tensor() if isinstance(t, ShardedTensor) else t
