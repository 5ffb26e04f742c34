"""Rules for padding and advanced indexing: ``constant_pad_nd``, ``index.Tensor`` and
``index_put`` (the backward of indexing).

Padding keeps every dim it does not pad sharded. Indexing with plain (replicated) index
tensors keeps the indexed tensor's other dims sharded; a sharded indexed dim stays
sharded when every rank's part of the result reads only rows it holds, which every rank
checks for every rank from the index values it already has (so all agree without
talking), as happens with Hugging Face's mask building (``mask[batch_idx, kv_idx]``).
"""

from __future__ import annotations

import torch

from .._dispatch import Declined, register_rule
from .._redistribute import redistribute_local
from ._common import Placement, is_partial_leader, is_st, local_under, move_cost, wrap

aten = torch.ops.aten


@register_rule(aten.constant_pad_nd.default)
def _constant_pad(func, args, kwargs):
    st, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    p = st._placement
    padded = {st.ndim - 1 - i // 2 for i, n in enumerate(pad) if n}
    spec = tuple(() if d in padded else axes for d, axes in enumerate(p.spec))
    # padding an addend with zeros keeps the sum; any other value must be added once
    partial = p.partial if value == 0 and all(op == "sum" for _, op in p.partial) else ()
    req = Placement(p.mesh, spec, partial)
    local = func(local_under(st, req), pad, value)
    shape = list(st.shape)
    for i in range(0, len(pad), 2):
        d = st.ndim - 1 - i // 2
        shape[d] += pad[i] + pad[i + 1]
    return wrap(local, req, tuple(shape))


def _index_layout(indices):
    """(first indexed dim, number of indexed dims), or None when the indexed dims are not
    one adjacent block (torch then moves the result dims to the front)."""
    present = [i for i, t in enumerate(indices) if t is not None]
    if not present or present != list(range(present[0], present[-1] + 1)):
        return None
    return present[0], len(present)


def _checked_indices(indices):
    """``(indices, start, count)``: the index tensors as plain tensors (a replicated one as
    its whole local tensor) and :func:`_index_layout`'s block, or Declined when a rule
    cannot take them (sharded, not adjacent, or boolean masks)."""
    if any(is_st(t) and not t._placement.is_replicated() for t in indices if t is not None):
        return Declined("sharded index tensors")
    indices = [t._local_tensor if is_st(t) else t for t in indices]  # replicated: the whole tensor
    layout = _index_layout(indices)
    if layout is None:
        return Declined("indexed dims that are not adjacent")
    if any(t.dtype == torch.bool for t in indices if t is not None):
        return Declined("boolean mask indices (data-dependent shape)")
    return indices, *layout


@register_rule(aten.index.Tensor)
def _index(func, args, kwargs):
    st = args[0]
    if not is_st(st):
        return Declined("only the indexed tensor may be sharded (a sharded index tensor)")
    checked = _checked_indices(list(args[1]))
    if isinstance(checked, Declined):
        return checked
    indices, start, count = checked
    p = st._placement
    mesh = p.mesh
    index_shape = torch.broadcast_shapes(*[t.shape for t in indices if t is not None])
    expanded = [t.expand(index_shape) if t is not None else None for t in indices]
    out_shape = tuple(st.shape[:start]) + tuple(index_shape) + tuple(st.shape[start + count :])
    nb = len(index_shape)
    # the result's index dims: a sharded indexed dim j of ``st`` lends its axes to the first
    # index dim along which the rows every rank needs stay inside the rows it holds
    out_index_spec = [()] * nb
    in_spec = list(p.spec)
    for j in range(start, start + count):
        axes = p.spec[j]
        if not axes:
            continue
        chosen = None
        for d in range(nb):
            if out_index_spec[d] or any(a in out_index_spec[x] for x in range(nb) for a in axes):
                continue
            trial = list(out_index_spec)
            trial[d] = axes
            if _local_reads(st, expanded, j, start, trial, p, out_shape):
                chosen = trial
                break
        if chosen is None:
            in_spec[j] = ()  # gather this indexed dim
        else:
            out_index_spec = chosen
    req = Placement(mesh, tuple(in_spec), p.partial if _sums(p) else ())
    out_spec = tuple(in_spec[:start]) + tuple(out_index_spec) + tuple(in_spec[start + count :])
    out = Placement(mesh, out_spec, req.partial)
    local = local_under(st, req)
    box = out.box(out_shape)
    index_box = box.slices()[start : start + nb]
    in_box = req.box(st.shape)
    local_indices = []
    for j, t in enumerate(expanded):
        if t is None:
            local_indices.append(None)
            continue
        piece = t[index_box]
        if in_spec[j]:
            piece = piece - in_box.offsets[j]
        local_indices.append(piece)
    return wrap(func(local, local_indices), out, out_shape)


def _sums(p: Placement) -> bool:
    return all(op == "sum" for _, op in p.partial)


def _local_reads(st, expanded, j, start, trial_index_spec, p, out_shape) -> bool:
    """Whether, with the result's index dims sharded as in ``trial_index_spec``, every
    rank reads along ``st``'s dim ``j`` only the rows it holds."""
    mesh = p.mesh
    nb = len(trial_index_spec)
    out_spec = (
        tuple(p.spec[:start]) + tuple(trial_index_spec) + ((),) * (len(out_shape) - start - nb)
    )
    out = Placement(mesh, out_spec)
    for rank in range(mesh.size()):
        coord = mesh.coord_of(rank)
        sl = out.box(out_shape, coord=coord).slices()[start : start + nb]
        values = expanded[j][sl]
        held = p.box(st.shape, coord=coord)
        lo, hi = held.offsets[j], held.offsets[j] + held.sizes[j]
        if values.numel() and (int(values.min()) < lo or int(values.max()) >= hi):
            return False
    return True


def _aligned_spec(shape, full_shape, spec) -> tuple:
    """The spec a tensor of ``shape`` needs to broadcast onto ``full_shape`` laid out by
    ``spec`` (broadcast dims replicated)."""
    off = len(full_shape) - len(shape)
    return tuple(
        spec[i + off] if shape[i] == full_shape[i + off] else () for i in range(len(shape))
    )


@register_rule(
    aten.index_put.default,
    aten.index_put_.default,
    aten._unsafe_index_put.default,
    aten._index_put_impl_.default,
)
def _index_put(func, args, kwargs):
    """``self[indices] = values`` (or ``+=`` with ``accumulate``), the backward of indexing.

    The indexed dims of ``self`` are written whole on every rank (the index values may
    point anywhere), so they are replicated; every other dim may stay sharded, taking
    ``self``'s layout or ``values``' (whichever moves fewer bytes: the backward of
    indexing writes a sharded gradient into fresh replicated zeros, and slicing the
    zeros is free). Index tensors must be plain or replicated. With ``accumulate``, a
    pending sum in ``values`` stays pending: ``self`` joins it on the leader only.
    """
    st, indices, values = args[0], list(args[1]), args[2]
    rest = list(args[3:])
    accumulate = bool(rest[0]) if rest else bool(kwargs.get("accumulate", False))
    inplace = func in (aten.index_put_.default, aten._index_put_impl_.default)
    if inplace and not is_st(st):
        return Declined("writing sharded values into a plain tensor in place")
    checked = _checked_indices(indices)
    if isinstance(checked, Declined):
        return checked
    indices, start, count = checked
    mesh = next(x for x in (st, values) if is_st(x))._placement.mesh
    index_shape = tuple(torch.broadcast_shapes(*[t.shape for t in indices if t is not None]))
    nb = len(index_shape)
    shape = tuple(st.shape)
    vfull = shape[:start] + index_shape + shape[start + count :]
    indexed = range(start, start + count)

    def from_values(vspec):
        """The self spec that keeps ``values``' layout of the dims they share."""
        full = ((),) * (len(vfull) - len(vspec)) + tuple(vspec)
        vshape = (1,) * (len(vfull) - values.ndim) + tuple(values.shape)
        out = []
        for d in range(len(shape)):
            if d in indexed:
                out.append(())
                continue
            vd = d if d < start else d - count + nb
            out.append(full[vd] if vshape[vd] == vfull[vd] else ())
        return tuple(out)

    candidates = []
    if is_st(st):
        candidates.append(
            tuple(() if d in indexed else a for d, a in enumerate(st._placement.spec))
        )
    if is_st(values) and not inplace:
        candidates.append(from_values(values._placement.spec))
    candidates.append(((),) * len(shape))
    vp = values._placement if is_st(values) else None
    keep = ()
    if (
        accumulate
        and not inplace
        and vp is not None
        and vp.partial
        and all(op == "sum" for _, op in vp.partial)
        and not (is_st(st) and st._placement.partial)
    ):
        keep = vp.partial
    best = None
    for spec in candidates:
        if keep and any(a in axes for axes in spec for a, _ in keep):
            continue
        req_self = Placement(mesh, spec)
        vspec = spec[:start] + ((),) * nb + spec[start + count :]
        req_values = Placement(mesh, _aligned_spec(tuple(values.shape), vfull, vspec), keep)
        cost = move_cost(st, req_self) + move_cost(values, req_values)
        if best is None or cost < best[0]:
            best = (cost, req_self, req_values)
    _, req_self, req_values = best
    local_values = local_under(values, req_values) if isinstance(values, torch.Tensor) else values
    if inplace:
        local_self = local_under(st, req_self)
        func(local_self, indices, local_values, *rest, **kwargs)
        if local_self is st._local_tensor:
            return st
        if st._placement.partial:  # the written values are whole: no longer a pending sum
            st._local_tensor, st._placement = local_self, req_self
            return st
        # back into self's own layout, in place: an in-place op never re-lays out self
        # (a vocabulary-sharded embedding stays sharded); a local slice here, since the
        # written layout only replicates dims self shards
        st._local_tensor.copy_(redistribute_local(local_self, shape, req_self, st._placement))
        return st
    out = Placement(mesh, req_self.spec, keep)
    local_self = local_under(st, req_self)
    if keep and not is_partial_leader(out):
        local_self = torch.zeros_like(local_self)  # self joins the pending sum once
    return wrap(func(local_self, indices, local_values, *rest, **kwargs), out, shape)
