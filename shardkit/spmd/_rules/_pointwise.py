"""Rules for pointwise ops (with broadcasting, scalars, in-place) and tensor factories.

The output takes the sharding of one of its inputs (ranked by the bytes the others
must move to line up with it). Pending sums survive linear ops: ``P + P``, ``P * c``,
``-P``; ``P + c`` adds ``c`` on the partial axes' leader only, so it stays pending.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._dispatch import Declined, register_rule
from ._common import (
    Memo,
    Placement,
    is_partial_leader,
    is_st,
    local_under,
    move_cost,
    resolve_inplace,
    wrap,
)

aten = torch.ops.aten

_ADD = {"add", "sub"}
_MUL = {"mul", "div"}
_UNARY_LINEAR = {"neg", "positive"}


def _flatten(args: tuple, kwargs: dict):
    """Pointwise ops almost always take flat arguments: skip pytree for them."""
    if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
        return list(args), None, len(args)
    flat, tree = tree_flatten((args, kwargs))
    return flat, tree, len(tree_flatten(args)[0])


def _unflatten(flat: list, tree):
    if tree is None:
        return tuple(flat), {}
    return tree_unflatten(flat, tree)


def _broadcast(shapes) -> tuple:
    """torch.broadcast_shapes without its overhead (shapes are already valid)."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        off = ndim - len(shape)
        for i, size in enumerate(shape):
            if size != 1:
                out[i + off] = size
    return tuple(out)


def is_inplace(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _aligned(shape, out_shape, spec) -> tuple:
    """The spec an input of ``shape`` needs so it broadcasts onto an output with ``spec``."""
    off = len(out_shape) - len(shape)
    return tuple(spec[i + off] if shape[i] == out_shape[i + off] else () for i in range(len(shape)))


def _candidate(st, out_shape) -> tuple:
    off = len(out_shape) - st.ndim
    spec = [()] * len(out_shape)
    for i, axes in enumerate(st._placement.spec):
        if st.shape[i] == out_shape[i + off]:
            spec[i + off] = axes
    return tuple(spec)


def _scales_only(holder, tensors) -> bool:
    """Whether ``P * t`` should keep ``P`` pending: only when every other tensor operand
    is a scalar (``numel() == 1``).

    Multiplying by a non-scalar tensor ``t`` makes a new value the same size as ``P`` or
    larger, so resolving ``P`` now costs no more than resolving the product later, and
    the resolution is remembered on ``P``, where every other consumer of ``P`` reuses it.
    Kept pending, each product would need its own all-reduce: a column-parallel layer's
    input gradient, for example, feeds both halves of a norm's backward (the input
    gradient and the weight gradient).
    """
    return all(t is holder or t.numel() == 1 for t in tensors)


def _plan(func, sts, out_spec, first, tensors=()) -> tuple[tuple, bool]:
    """Output partial axes for ``out_spec`` and whether non-partial terms go to the leader."""
    base = func.overloadpacket.__name__.rstrip("_")
    partials = {st._placement.partial for st in sts if st._placement.partial}
    used = {a for axes in out_spec for a in axes}
    if len(partials) != 1:
        return (), False
    (partial,) = partials
    if any(op != "sum" for _, op in partial) or any(a in used for a, _ in partial):
        return (), False
    holders = [st for st in sts if st._placement.partial]
    if base in _ADD:
        if is_inplace(func) and not first._placement.partial:
            # ``r.add_(P)``: keeping the sum pending would zero ``r``'s own storage on
            # all ranks but the leader, and any view of ``r`` would silently read that
            # zero; resolving ``P`` keeps ``r`` what it claims to be
            return (), False
        return partial, True
    if base == "div" and "mode" in func._overloadname:
        return (), False  # floor / trunc division rounds each rank's part: not linear
    if base in _MUL and len(holders) == 1 and (base == "mul" or holders[0] is first):
        if _scales_only(holders[0], tensors):
            return partial, False
        return (), False
    if base in _UNARY_LINEAR and len(sts) == 1:
        return partial, False
    return (), False


def _choose(func, tensors, sts, mesh, first):
    """``(out_shape, spec, partial, leader_only, reqs)`` for a pointwise call, or
    Declined."""
    if any(st._placement.mesh != mesh for st in sts):
        return Declined("operands on different meshes")
    out_shape = _broadcast([tuple(t.shape) for t in tensors])
    inplace = is_inplace(func)
    if inplace:
        if not is_st(first) or tuple(first.shape) != out_shape:
            return Declined("an in-place op that broadcasts self")
        candidates = [first._placement.spec]
    else:
        candidates = []
        for st in sts:
            c = _candidate(st, out_shape)
            if c not in candidates:
                candidates.append(c)
        replicated = ((),) * len(out_shape)
        if replicated not in candidates:
            candidates.append(replicated)

    best = None
    for spec in candidates:
        partial, leader_only = _plan(func, sts, spec, first, tensors)
        reqs = []
        cost = 0
        for st in sts:
            keep = st._placement.partial if partial and st._placement.partial else ()
            req = Placement(mesh, _aligned(st.shape, out_shape, spec), keep)
            reqs.append(req)
            cost += move_cost(st, req)
        if best is None or cost < best[0]:
            best = (cost, spec, partial, leader_only, tuple(reqs))
    _, spec, partial, leader_only, reqs = best
    return out_shape, spec, partial, leader_only, reqs


#: pointwise plans by (op, operands' shapes / placements / identities): the choice is pure
#: arithmetic on those, and a training step repeats the same few hundred calls
_PLANS = Memo(8192)


def _plan_key(func, tensors, first):
    ids: dict[int, int] = {}
    parts = []
    for t in tensors:
        slot = ids.setdefault(id(t), len(ids))
        placement = t._placement if is_st(t) else None
        parts.append((slot, tuple(t.shape), placement, t is first))
    return (func, tuple(parts))


def _zeros_like(value: torch.Tensor) -> torch.Tensor:
    """A read-only zero of ``value``'s shape and dtype: one element broadcast, so a
    non-leader's share of a replicated term costs no allocation (the op reads it once)."""
    return value.new_zeros(()).expand(value.shape)


def pointwise_rule(func, args, kwargs):
    if "out" in kwargs:
        return Declined("an out= argument")
    flat, tree, num_positional = _flatten(args, kwargs)
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    sts = [x for x in tensors if is_st(x)]
    mesh = sts[0]._placement.mesh
    first = args[0]
    if not is_st(first) and isinstance(first, torch.Tensor) and is_inplace(func):
        return _into_plain(func, flat, tree, sts, mesh)
    key = _plan_key(func, tensors, first)
    cached = _PLANS.get(key)
    if cached is None:
        cached = _PLANS.put(key, _choose(func, tensors, sts, mesh, first))
    if isinstance(cached, Declined):
        return cached
    out_shape, spec, partial, leader_only, reqs = cached
    reqs = list(reqs)
    inplace = is_inplace(func)
    out_placement = Placement(mesh, spec, partial)
    if inplace and first._placement.partial and not partial:
        resolve_inplace(first)
        reqs[sts.index(first)] = first._placement
    zero_others = leader_only and not is_partial_leader(out_placement)

    req_of = {id(st): req for st, req in zip(sts, reqs)}
    local_flat = []
    for index, x in enumerate(flat):
        if is_st(x):
            value = local_under(x, req_of[id(x)])
            if zero_others and not x._placement.partial:
                value = _zeros_like(value)
        elif isinstance(x, torch.Tensor):
            value = local_under(x, Placement(mesh, _aligned(x.shape, out_shape, spec)))
            if zero_others:
                value = _zeros_like(value)
        elif (
            zero_others
            and index < num_positional
            and isinstance(x, (int, float, complex))
            and not isinstance(x, bool)
        ):
            value = 0
        else:
            value = x
        local_flat.append(value)
    l_args, l_kwargs = _unflatten(local_flat, tree)
    out = func(*l_args, **l_kwargs)
    if inplace:
        first._placement = out_placement
        return first
    if isinstance(out, torch.Tensor):
        return wrap(out, out_placement, out_shape)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(wrap(o, out_placement, out_shape) for o in out)
    return Declined(f"an output of type {type(out).__name__}")


def _into_plain(func, flat, tree, sts, mesh):
    """An in-place op on a plain (whole, replicated) tensor with sharded operands, such as
    a plain optimizer state updated from a sharded gradient: the operands are gathered
    once and the op runs on whole tensors. A gathered operand that needs no gradient
    (a gradient, an optimizer state) keeps its whole copy, so the next op on it (Adam's
    ``lerp_`` then ``addcmul_``) does not gather again."""
    whole = {}
    for st in sts:
        target = Placement.replicated(mesh, st.ndim)
        local = local_under(st, target)
        if not st.requires_grad:
            st._local_tensor, st._placement = local, target
        whole[id(st)] = local
    local_flat = [whole[id(x)] if is_st(x) else x for x in flat]
    l_args, l_kwargs = _unflatten(local_flat, tree)
    return func(*l_args, **l_kwargs)


# -- factories and fills -------------------------------------------------------------
@register_rule(
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
)
def _like(func, args, kwargs):
    st = args[0]
    placement = st._placement.without_partial()
    return wrap(func(st._local_tensor, *args[1:], **kwargs), placement, st.shape)


@register_rule(aten.rand_like.default, aten.randn_like.default)
def _random_like(func, args, kwargs):
    """Draw the full tensor (as one device would, same generator) and keep this shard."""
    st = args[0]
    placement = st._placement.without_partial()
    full = func(torch.empty(st.shape, dtype=st.dtype, device=st._local_tensor.device), **kwargs)
    return wrap(full[placement.box(st.shape).slices()].clone(), placement, st.shape)


@register_rule(
    aten.bernoulli_.float,
    aten.uniform_.default,
    aten.normal_.default,
    aten.exponential_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
)
def _random_fill(func, args, kwargs):
    """In-place random fill: draw the full tensor and keep this shard, so every shard is
    the slice single-device torch would draw with the same seed."""
    st = args[0]
    placement = st._placement.without_partial()
    full = torch.empty(st.shape, dtype=st.dtype, device=st._local_tensor.device)
    func(full, *args[1:], **kwargs)
    st._local_tensor = full[placement.box(st.shape).slices()].clone()
    st._placement = placement
    return st


@register_rule(aten.fill_.Scalar, aten.zero_.default)
def _fill(func, args, kwargs):
    st = args[0]
    st._placement = st._placement.without_partial()
    func(st._local_tensor, *args[1:], **kwargs)
    return st


@register_rule(
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
    aten.new_empty_strided.default,
)
def _new(func, args, kwargs):
    st, size = args[0], tuple(int(s) for s in args[1])
    mesh = st._placement.mesh
    if size == tuple(st.shape):
        placement = st._placement.without_partial()
    else:
        placement = Placement.replicated(mesh, len(size))
    local_size = placement.box(size).sizes
    rest = list(args[2:])
    if func is aten.new_empty_strided.default:
        strides, acc = [], 1
        for s in reversed(local_size):
            strides.append(acc)
            acc *= max(s, 1)
        rest[0] = tuple(reversed(strides))
    return wrap(func(st._local_tensor, local_size, *rest, **kwargs), placement, size)


@register_rule(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not is_st(dst):
        return Declined("copying a sharded tensor into a plain one")
    placement = dst._placement.without_partial()
    if dst._placement.partial:
        dst._local_tensor = dst._local_tensor.clone()
    dst._placement = placement
    if isinstance(src, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
        # a source that broadcasts: line its dims up with dst's before cutting dst's box
        if is_st(src):
            src = local_under(src, Placement.replicated(src._placement.mesh, src.ndim))
        src = src.expand(dst.shape)
    value = local_under(src, placement) if isinstance(src, torch.Tensor) else src
    func(dst._local_tensor, value, *args[2:], **kwargs)
    return dst


@register_rule(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    st = args[0]
    placement = st._placement
    dtype = kwargs.get("dtype")
    if (
        placement.partial
        and dtype is not None
        and not (dtype.is_floating_point and st.is_floating_point())
    ):
        placement = placement.without_partial()
    local = local_under(st, placement)
    return wrap(func(local, *args[1:], **kwargs), placement, st.shape)


@register_rule(aten._local_scalar_dense.default)
def _item(func, args, kwargs):
    st = args[0]
    return func(local_under(st, Placement.replicated(st._placement.mesh, st.ndim)))


@register_rule(aten.lift_fresh.default)
def _lift(func, args, kwargs):
    return args[0]


@register_rule(aten.native_dropout.default)
def _native_dropout(func, args, kwargs):
    """Fused dropout (what ``F.dropout`` becomes on accelerators): run the op on a whole
    tensor of ones, as one device would draw it from the same generator, and keep this
    shard of its mask and scale. A pending sum stays pending (dropout is linear)."""
    st, p = args[0], args[1]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    placement = st._placement
    if placement.partial and any(op != "sum" for _, op in placement.partial):
        placement = placement.without_partial()
    local = local_under(st, placement)
    ones = torch.ones(st.shape, dtype=st.dtype, device=local.device)
    scaled, mask = func(ones, p, train)
    box = placement.box(st.shape).slices()
    mask_placement = placement.without_partial()
    return (
        wrap(local * scaled[box], placement, st.shape),
        wrap(mask[box].clone(), mask_placement, st.shape),
    )
