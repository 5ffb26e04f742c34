"""Folded batch dims: flattening ``(batch, heads, ...)`` with heads sharded, without moving data.

``torch.matmul`` on 4-D tensors (eager attention: ``q @ k.transpose(2, 3)``) flattens the
leading dims into one batch dim, runs ``bmm`` and unflattens. With the heads sharded
and the batch not, each rank's rows of the flattened dim are not one contiguous run
(rank 0 holds rows 0, 1, 4, 5 of ``2 x 4``), so no chunk layout describes them and a
plain reshape would gather the heads.

A :class:`Folded` tensor is the flattened tensor with each rank keeping its own rows,
in its own order: its placement says "dim 0 chunked over the group's axes", which has
the right local sizes but not the right row identities, so it is only trusted by the
ops that never look at row identities when every operand is folded the same way:
``bmm`` (per-row), transposes and permutes that keep dim 0, ``detach`` / ``alias`` /
``clone``, and the view that unflattens dim 0 back into the recorded dims (which
restores a true layout). Any other op, and ``full_tensor`` / ``redistribute``, first
unflattens (exact, no communication) and then takes the normal path.
"""

from __future__ import annotations

import math

import torch

from .._placement import Placement
from .._sharded_tensor import ShardedTensor
from ..layout import mesh_coords
from ._common import is_st, local_under

aten = torch.ops.aten


class Folded(ShardedTensor):
    """A ShardedTensor whose dim 0 is a flattened group of dims (see the module doc)."""

    #: (group sizes, group specs): dim 0 is the flattening of dims with these sizes and specs
    _fold: tuple[tuple[int, ...], tuple]

    def unfolded(self) -> ShardedTensor:
        """The same values with dim 0 split back into the group's dims (no communication)."""
        sizes, specs = self._fold
        p = self._placement
        placement = Placement(p.mesh, tuple(specs) + p.spec[1:], p.partial)
        shape = tuple(sizes) + tuple(self.shape[1:])
        local = self._local_tensor.reshape(placement.box(shape).sizes)
        return ShardedTensor(local, placement, shape)

    def full_tensor(self) -> torch.Tensor:
        return self.view(self._shape_unfolded()).full_tensor().reshape(self.shape)

    def redistribute(self, partition_spec, mesh=None) -> ShardedTensor:
        raise ValueError(
            "this tensor's dim 0 is a flattened (batch, heads) group kept folded for bmm; "
            f"unflatten it to {self._shape_unfolded()} with view() before redistributing"
        )

    def _shape_unfolded(self) -> tuple[int, ...]:
        return tuple(self._fold[0]) + tuple(self.shape[1:])


def make(local, placement, shape, fold) -> Folded:
    out = Folded(local, placement, shape)
    out._fold = fold
    return out


def try_fold(st: ShardedTensor, out_shape: tuple):
    """A Folded result for ``st.view(out_shape)`` when the view merges ``st``'s leading
    dims into dim 0 of ``out_shape``, keeps the other dims, and the merged group holds a
    sharded dim that a chunk layout cannot keep; otherwise None."""
    in_shape = tuple(st.shape)
    p = st._placement
    if not out_shape or len(out_shape) >= len(in_shape):
        return None
    k = len(in_shape) - len(out_shape) + 1  # leading dims merged into dim 0
    if tuple(in_shape[k:]) != tuple(out_shape[1:]) or math.prod(in_shape[:k]) != out_shape[0]:
        return None
    specs = p.spec[:k]
    axes = tuple(a for s in specs for a in s)
    if not axes:
        return None
    mesh = p.mesh
    placement = Placement(mesh, (axes,) + p.spec[k:], p.partial)
    # the chunk layout must give every rank exactly as many rows as it holds
    for coord in mesh_coords(mesh.mesh_shape):
        held = p.box(in_shape, coord=coord).sizes[:k]
        if math.prod(held) != placement.box(out_shape, coord=coord).sizes[0]:
            return None
    local = st._local_tensor.reshape(placement.box(out_shape).sizes)
    return make(local, placement, out_shape, (tuple(in_shape[:k]), tuple(specs)))


def _materialize(value: Folded) -> ShardedTensor:
    """The folded tensor in a true chunk layout (the view rule gathers what it must)."""
    from ._views import plain_view

    return plain_view(value.unfolded(), tuple(value.shape))


def _unfold_all(value):
    if type(value) is Folded:
        return _materialize(value)
    if type(value) in (list, tuple):
        return type(value)(_unfold_all(v) for v in value)
    return value


def has_folded(args: tuple, kwargs: dict) -> bool:
    for a in args:
        if type(a) is Folded:
            return True
        if type(a) in (list, tuple) and any(type(x) is Folded for x in a):
            return True
    return any(type(v) is Folded for v in kwargs.values())


def dispatch_folded(func, args: tuple, kwargs: dict, dispatch):
    """Run ``func`` on folded operands: locally where the op keeps rows apart, otherwise
    on the operands brought to a true layout, through ``dispatch``."""
    out = _folded_op(func, args, kwargs)
    if out is not NotImplemented:
        return out
    args = tuple(_unfold_all(a) for a in args)
    kwargs = {k: _unfold_all(v) for k, v in kwargs.items()}
    return dispatch(func, args, kwargs)


def _folded_op(func, args, kwargs):
    if func is aten.bmm.default:
        return _bmm(func, args)
    st = args[0]
    if type(st) is not Folded:
        return NotImplemented
    p = st._placement
    if func in (aten.detach.default, aten.alias.default, aten.clone.default):
        return make(func(st._local_tensor, **kwargs), p, st.shape, st._fold)
    if func in (aten.transpose.int, aten.permute.default):
        order = list(range(st.ndim))
        if func is aten.transpose.int:
            d0, d1 = (d % st.ndim for d in args[1:3])
            order[d0], order[d1] = order[d1], order[d0]
        else:
            order = [d % st.ndim for d in args[1]]
        if order[0] != 0:
            return NotImplemented
        spec = tuple(p.spec[d] for d in order)
        shape = tuple(st.shape[d] for d in order)
        local = st._local_tensor.permute(order)
        return make(local, Placement(p.mesh, spec, p.partial), shape, st._fold)
    if func in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        sizes, specs = st._fold
        target = tuple(int(s) for s in args[1])
        if -1 in target or target != tuple(sizes) + tuple(st.shape[1:]):
            return NotImplemented
        return st.unfolded()
    return NotImplemented


def _as_folded(x, like: Folded):
    """``x`` (a true-layout or plain tensor of ``like``'s dim-0 size) folded like ``like``:
    its dim 0 is unflattened, laid out like the group (a local slice when ``x`` is
    replicated there), and folded again."""
    from ._views import plain_view

    sizes, specs = like._fold
    mesh = like._placement.mesh
    shape = tuple(sizes) + tuple(x.shape[1:])
    if is_st(x):
        x_spec = x._placement.spec[1:]
        partial = x._placement.partial
        x = plain_view(x, shape)
    else:
        x_spec, partial = ((),) * (x.ndim - 1), ()
        x = x.reshape(shape)
    used = {a for s in specs for a in s}
    rest = tuple(() if set(s) & used else s for s in x_spec)
    req = Placement(mesh, tuple(specs) + rest, tuple(q for q in partial if q[0] not in used))
    local = local_under(x, req)
    axes = tuple(a for s in specs for a in s)
    folded_shape = (math.prod(sizes),) + tuple(shape[len(sizes) :])
    placement = Placement(mesh, (axes,) + rest, req.partial)
    return make(
        local.reshape(placement.box(folded_shape).sizes), placement, folded_shape, like._fold
    )


def _bmm(func, args):
    a, b = args
    if type(a) is not Folded and type(b) is not Folded:
        return NotImplemented
    like = a if type(a) is Folded else b
    if type(a) is not Folded:
        a = _as_folded(a, like)
    if type(b) is not Folded:
        b = _as_folded(b, like)
    if a._fold != b._fold:
        return NotImplemented
    pa, pb = a._placement, b._placement
    if pa.partial or pb.partial or pa.spec[0] != pb.spec[0]:
        return NotImplemented
    (_, a_m, a_k), (_, b_k, b_n) = pa.spec, pb.spec
    if a_k != b_k or not set(a_m).isdisjoint(b_n):
        return NotImplemented
    partial = tuple((x, "sum") for x in a_k)
    out = Placement(pa.mesh, (pa.spec[0], a_m, b_n), partial)
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return make(func(a._local_tensor, b._local_tensor), out, shape, a._fold)
