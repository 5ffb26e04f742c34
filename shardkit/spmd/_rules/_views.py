"""Rules for views and joins: view/reshape/flatten, transpose, permute, (un)squeeze,
expand, slicing, select, split/chunk/unbind, cat and stack.

Sharding follows the dims it sits on. A reshape keeps a dim's sharding only when, on
every rank, the shard is the same run of elements before and after (checked with box
arithmetic, so uneven ``torch.chunk`` splits are handled exactly); otherwise the dims
that break it are gathered first. Slicing along a sharded dim gathers that dim.
Views return new ShardedTensors: an in-place op on a view does not reach its base.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import combinations

import torch

from .._dispatch import FAST_HANDLERS, SLOW, Declined, _dispatch_rules, register_rule
from ..layout import chunk_bounds, mesh_coords, shard_index
from . import _fold
from ._common import Memo, Placement, ShardedTensor, is_st, local_under, move_cost, norm_dim, wrap

aten = torch.ops.aten


def _meta(x) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _bounds(size: int, axes, coord, mesh_shape) -> tuple[int, int]:
    if not axes:
        return 0, size
    index, count = shard_index(axes, coord, mesh_shape)
    return chunk_bounds(size, count, index)


def _run(sizes, specs, coord, mesh_shape):
    """A group's shard as ``(start, length)`` in the group's flat index, or None if it is
    not one contiguous run."""
    bounds = [_bounds(n, axes, coord, mesh_shape) for n, axes in zip(sizes, specs)]
    if any(s == 0 for _, s in bounds):
        return (0, 0)
    partial = [i for i, ((_, s), n) in enumerate(zip(bounds, sizes)) if s != n]
    if partial and any(bounds[i][1] != 1 for i in range(partial[-1])):
        return None
    start, stride = 0, 1
    for (o, _), n in zip(reversed(bounds), reversed(sizes)):
        start += o * stride
        stride *= n
    return start, math.prod(s for _, s in bounds)


def _splits(axes: tuple, parts: int):
    """Every way to cut ``axes`` into ``parts`` ordered runs."""
    for cuts in combinations(range(len(axes) + parts - 1), parts - 1):
        out, prev = [], -1
        bars = list(cuts) + [len(axes) + parts - 1]
        taken = 0
        for bar in bars:
            width = bar - prev - 1
            out.append(tuple(axes[taken : taken + width]))
            taken += width
            prev = bar
        yield out


def _groups(in_shape, out_shape):
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(in_shape):
            gi.append(i)
            pi, i = in_shape[i], i + 1
        if j < len(out_shape):
            gj.append(j)
            pj, j = out_shape[j], j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi, i = pi * in_shape[i], i + 1
            else:
                gj.append(j)
                pj, j = pj * out_shape[j], j + 1
        groups.append((gi, gj))
    return groups


@lru_cache(maxsize=4096)
def view_plan(in_shape: tuple, spec: tuple, out_shape: tuple, mesh_shape: tuple):
    """``(required input spec, output spec)`` for reshaping ``in_shape`` to ``out_shape``."""
    if 0 in in_shape:
        return ((),) * len(in_shape), ((),) * len(out_shape)
    req, out = list(spec), [()] * len(out_shape)
    coords = list(mesh_coords(mesh_shape))
    for gi, gj in _groups(in_shape, out_shape):
        if not any(spec[d] for d in gi):
            continue
        in_sizes, out_sizes = [in_shape[d] for d in gi], [out_shape[d] for d in gj]
        first = next(d for d in gi if spec[d])
        options = [[spec[d] for d in gi], [spec[d] if d == first else () for d in gi]]
        chosen = None
        for in_specs in options:
            axes = tuple(a for s in in_specs for a in s)
            for out_specs in _splits(axes, len(gj)) if gj else []:
                if all(
                    _run(in_sizes, in_specs, c, mesh_shape)
                    == _run(out_sizes, out_specs, c, mesh_shape)
                    is not None
                    for c in coords
                ):
                    chosen = (in_specs, out_specs)
                    break
            if chosen:
                break
        if chosen is None:
            chosen = ([()] * len(gi), [()] * len(gj))
        for d, s in zip(gi, chosen[0]):
            req[d] = s
        for d, s in zip(gj, chosen[1]):
            out[d] = s
    return tuple(req), tuple(out)


def _infer_shape(size, numel) -> tuple:
    """``size`` with its ``-1`` filled in; torch's ``RuntimeError`` when it cannot hold
    ``numel`` elements."""
    given = [int(s) for s in size]
    if given.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    shape = list(given)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known and numel % known == 0:
            shape[shape.index(-1)] = numel // known
    if -1 in shape or any(s < 0 for s in shape) or math.prod(shape) != numel:
        raise RuntimeError(f"shape '{given}' is invalid for input of size {numel}")
    return tuple(shape)


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    st, size = args[0], args[1]
    p = st._placement
    out_shape = _infer_shape(size, st.numel())
    req_spec, out_spec = view_plan(tuple(st.shape), p.spec, out_shape, p.mesh.mesh_shape)
    if req_spec != p.spec:
        folded = _fold.try_fold(st, out_shape)  # (batch, heads) -> batch*heads for bmm
        if folded is not None:
            return folded
    return plain_view(st, out_shape, req_spec, out_spec)


def plain_view(st, out_shape, req_spec=None, out_spec=None):
    """``st.view(out_shape)`` in a chunk layout (gathering the dims that break it)."""
    p = st._placement
    if req_spec is None:
        req_spec, out_spec = view_plan(tuple(st.shape), p.spec, out_shape, p.mesh.mesh_shape)
    req = Placement(p.mesh, req_spec, p.partial)
    out = Placement(p.mesh, out_spec, p.partial)
    local = local_under(st, req).reshape(out.box(out_shape).sizes)
    return wrap(local, out, out_shape)


@register_rule(aten.expand.default)
def _expand(func, args, kwargs):
    st, size = args[0], list(args[1])
    p = st._placement
    off = len(size) - st.ndim
    out_shape = tuple(st.shape[i - off] if s == -1 else int(s) for i, s in enumerate(size))
    req = [() if st.shape[i] != out_shape[i + off] else axes for i, axes in enumerate(p.spec)]
    out_spec = ((),) * off + tuple(req)
    req_p = Placement(p.mesh, tuple(req), p.partial)
    out_p = Placement(p.mesh, out_spec, p.partial)
    local = local_under(st, req_p).expand(out_p.box(out_shape).sizes)
    return wrap(local, out_p, out_shape)


def _permuted(st, order):
    p = st._placement
    spec = tuple(p.spec[d] for d in order)
    shape = tuple(st.shape[d] for d in order)
    return Placement(p.mesh, spec, p.partial), shape


@register_rule(aten.permute.default)
def _permute(func, args, kwargs):
    st = args[0]
    order = [norm_dim(d, st.ndim) for d in args[1]]
    out, shape = _permuted(st, order)
    return wrap(st._local_tensor.permute(order), out, shape, _permuted_strides(st, order))


@register_rule(aten.transpose.int, aten.t.default)
def _transpose(func, args, kwargs):
    st = args[0]
    order = _transpose_order(func, st, args[1:])
    out, shape = _permuted(st, order)
    return wrap(st._local_tensor.permute(order), out, shape, _permuted_strides(st, order))


def _transpose_order(func, st, dims) -> list[int]:
    """The dim order ``t()`` / ``transpose(d0, d1)`` (``dims``) makes of ``st``'s dims."""
    order = list(range(st.ndim))
    if st.ndim >= 2:
        d0, d1 = (dims[0], dims[1]) if func is aten.transpose.int else (0, 1)
        d0, d1 = norm_dim(d0, st.ndim), norm_dim(d1, st.ndim)
        order[d0], order[d1] = order[d1], order[d0]
    return order


def _permuted_strides(st, order) -> tuple[int, ...]:
    """A permuted view's global strides are its input's, permuted (as torch's): read off
    a shard they would differ between ranks whose shards have one row (where stride
    order is lost), and autograd would pick other kernels and collectives there."""
    strides = st.stride()
    return tuple(strides[d] for d in order)


@register_rule(aten.unsqueeze.default)
def _unsqueeze(func, args, kwargs):
    st = args[0]
    dim = norm_dim(args[1], st.ndim + 1)
    p = st._placement
    spec = p.spec[:dim] + ((),) + p.spec[dim:]
    shape = tuple(st.shape[:dim]) + (1,) + tuple(st.shape[dim:])
    return wrap(st._local_tensor.unsqueeze(dim), Placement(p.mesh, spec, p.partial), shape)


@register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(func, args, kwargs):
    st = args[0]
    if func is aten.squeeze.default:
        dims = list(range(st.ndim))
    elif func is aten.squeeze.dim:
        dims = [args[1]]
    else:
        dims = list(args[1])
    dims = sorted({norm_dim(d, st.ndim) for d in dims if st.ndim and st.shape[d] == 1})
    p = st._placement
    req = Placement(p.mesh, tuple(() if d in dims else a for d, a in enumerate(p.spec)), p.partial)
    out_spec = tuple(a for d, a in enumerate(req.spec) if d not in dims)
    shape = tuple(s for d, s in enumerate(st.shape) if d not in dims)
    local = aten.squeeze.dims(local_under(st, req), dims) if dims else local_under(st, req)
    return wrap(local, Placement(p.mesh, out_spec, p.partial), shape)


def _unshard_dim(st, dim) -> Placement:
    p = st._placement
    spec = tuple(() if d == dim else a for d, a in enumerate(p.spec))
    return Placement(p.mesh, spec, p.partial)


def _along_dim(func, args, kwargs, dim, drop=False):
    """Ops that index along ``dim``: gather that dim, then run locally."""
    st = args[0]
    req = _unshard_dim(st, dim)
    local = func(local_under(st, req), *args[1:], **kwargs)
    meta = func(_meta(st), *args[1:], **kwargs)
    spec = tuple(a for d, a in enumerate(req.spec) if not (drop and d == dim))
    out = Placement(req.mesh, spec, req.partial)
    if isinstance(meta, torch.Tensor):
        return wrap(local, out, meta.shape)
    return [wrap(loc, out, m.shape) for loc, m in zip(local, meta)]


@register_rule(aten.slice.Tensor)
def _slice(func, args, kwargs):
    st = args[0]
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), st.ndim)
    return _along_dim(func, args, kwargs, dim)


@register_rule(aten.select.int)
def _select(func, args, kwargs):
    st = args[0]
    return _along_dim(func, args, kwargs, norm_dim(args[1], st.ndim), drop=True)


@register_rule(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func, args, kwargs):
    st = args[0]
    dim = norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), st.ndim)
    return _along_dim(func, args, kwargs, dim)


@register_rule(aten.unbind.int)
def _unbind(func, args, kwargs):
    st = args[0]
    dim = norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), st.ndim)
    return _along_dim(func, args, kwargs, dim, drop=True)


@register_rule(aten.slice_backward.default, aten.select_backward.default)
def _index_backward(func, args, kwargs):
    grad, input_sizes, dim = args[0], tuple(args[1]), args[2]
    if not is_st(grad):
        return Declined("a plain gradient")
    dim = norm_dim(dim, len(input_sizes))
    p = grad._placement
    if func is aten.select_backward.default:
        out_spec = p.spec[:dim] + ((),) + p.spec[dim:]
        req = Placement(p.mesh, p.spec, p.partial)
    else:
        req = _unshard_dim(grad, dim)
        out_spec = req.spec
    out = Placement(p.mesh, out_spec, p.partial)
    local_sizes = out.box(input_sizes).sizes
    local = func(local_under(grad, req), local_sizes, dim, *args[3:], **kwargs)
    return wrap(local, out, input_sizes)


def _join(func, args, kwargs, stack: bool):
    tensors = list(args[0])
    dim_arg = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not stack:
        # torch.cat skips 1-D empty tensors whatever the others' shapes (a KV cache starts
        # as one); they hold nothing, so dropping them changes neither value nor layout
        kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
        tensors = kept or tensors[:1]
        if not any(is_st(t) for t in tensors):
            st = next(t for t in args[0] if is_st(t))
            local = func(
                [local_under(t, Placement.replicated(st._placement.mesh, t.ndim)) for t in tensors],
                dim_arg,
            )
            return wrap(local, Placement.replicated(st._placement.mesh, local.ndim), local.shape)
    # the same concatenation of the same layouts recurs every step (RoPE's rotate_half):
    # its plan depends only on the operands' layouts, shapes and dtypes and the dim
    key = (
        func,
        dim_arg,
        tuple((t._placement if is_st(t) else None, t.shape, t.dtype) for t in tensors),
    )
    plan = _MEMO.get(key)
    if plan is None:
        plan = _MEMO.put(key, _join_plan(func, tensors, dim_arg, stack))
    if isinstance(plan, Declined):
        return plan
    dim, req, out_placement, out_shape = plan
    local = func([local_under(t, req) for t in tensors], dim)
    return wrap(local, out_placement, out_shape)


def _join_plan(func, tensors: list, dim_arg: int, stack: bool):
    """``(dim, operand placement, output placement, output shape)`` of a cat or stack, or
    Declined: the operands are moved to the cheapest placement of one of them, with the
    joined dim unsharded (cat) and a pending sum kept only when all share it."""
    ndim = tensors[0].ndim
    if any(t.ndim != ndim for t in tensors):
        return Declined(f"operands of different ranks {[tuple(t.shape) for t in tensors]}")
    dim = norm_dim(dim_arg, ndim + 1 if stack else ndim)
    sts = [t for t in tensors if is_st(t)]
    mesh = sts[0]._placement.mesh
    partials = {t._placement.partial if is_st(t) else () for t in tensors}
    keep = partials.pop() if len(partials) == 1 else ()
    if keep and any(op != "sum" for _, op in keep):
        keep = ()
    best = None
    for st in sts:
        spec = tuple(
            () if (d == dim and not stack) else a for d, a in enumerate(st._placement.spec)
        )
        if keep and any(a in {x for axes in spec for x in axes} for a, _ in keep):
            continue
        req = Placement(mesh, spec, keep)
        cost = sum(move_cost(t, req) for t in tensors)
        if best is None or cost < best[0]:
            best = (cost, req)
    if best is None:
        best = (0, Placement(mesh, ((),) * ndim))
    req = best[1]
    out_spec = req.spec[:dim] + ((),) + req.spec[dim:] if stack else req.spec
    meta = func([_meta(t) for t in tensors], dim)
    return dim, req, Placement(mesh, out_spec, req.partial), meta.shape


@register_rule(aten.cat.default)
def _cat(func, args, kwargs):
    return _join(func, args, kwargs, stack=False)


@register_rule(aten.stack.default)
def _stack(func, args, kwargs):
    return _join(func, args, kwargs, stack=True)


@register_rule(
    aten.gather.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter_add.default,
)
def _gather_scatter(func, args, kwargs):
    """Index ops along ``dim``: every operand shares one spec with ``dim`` (and any dim
    whose sizes differ between operands) gathered, then the op runs locally."""
    st, dim = args[0], args[1]
    dim = norm_dim(dim, st.ndim)
    if not is_st(st):
        return Declined("a plain indexed tensor with sharded indices")
    others = [a for a in args[2:] if isinstance(a, torch.Tensor)]
    p = st._placement
    spec = tuple(
        ()
        if d == dim or any(o.ndim != st.ndim or o.shape[d] != st.shape[d] for o in others)
        else axes
        for d, axes in enumerate(p.spec)
    )
    req = Placement(p.mesh, spec)
    local_args = [
        local_under(a, Placement(p.mesh, spec)) if isinstance(a, torch.Tensor) else a
        for a in args[2:]
    ]
    local = func(local_under(st, req), args[1], *local_args, **kwargs)
    shape = others[0].shape if func is aten.gather.default else st.shape
    return wrap(local, req, shape)


# -- memoized layouts: the same view of the same layout recurs every step -------------
#: view layouts and cat/stack plans (``_join``), every key led by its op
_MEMO = Memo(8192)


def _layout_only_fast(func, args, kwargs):
    """``t``, ``transpose``, ``permute``, ``unsqueeze``, ``detach``, ``alias``: the op on the
    local tensor with the same arguments, and an output layout that depends only on the
    input's layout, shape and those arguments (memoized after the rule's first answer)."""
    st = args[0]
    if type(st) is not ShardedTensor or kwargs:
        return SLOW
    rest = tuple(tuple(a) if isinstance(a, list) else a for a in args[1:])
    key = (func, st._placement, st.shape, rest)
    hit = _MEMO.get(key)
    if hit is not None:
        return ShardedTensor(
            func(st._local_tensor, *args[1:]), hit[0], hit[1], strides=_fast_strides(func, st, rest)
        )
    out = _dispatch_rules(func, args, kwargs)
    if type(out) is ShardedTensor:
        _MEMO.put(key, (out._placement, out.shape))
    return out


def _fast_strides(func, st, rest) -> tuple[int, ...] | None:
    """The global strides of a memoized layout-only view (None: from the local tensor)."""
    if func is aten.t.default or func is aten.transpose.int:
        return _permuted_strides(st, _transpose_order(func, st, rest))
    if func is aten.permute.default:
        return _permuted_strides(st, [norm_dim(d, st.ndim) for d in rest[0]])
    if func is aten.detach.default or func is aten.alias.default:
        return st.stride()
    return None


def _view_fast(func, args, kwargs):
    """``view`` / ``_unsafe_view`` / ``reshape`` that keeps the input's layout: a local
    reshape to this rank's box (memoized per layout, shape and size)."""
    st = args[0]
    if type(st) is not ShardedTensor or kwargs:
        return SLOW
    key = (func, st._placement, st.shape, tuple(args[1]))
    hit = _MEMO.get(key)
    if hit is None:
        p = st._placement
        out_shape = _infer_shape(args[1], st.numel())
        req_spec, out_spec = view_plan(tuple(st.shape), p.spec, out_shape, p.mesh.mesh_shape)
        if req_spec != p.spec:
            return SLOW  # communicates or folds: the rule decides
        out = Placement(p.mesh, out_spec, p.partial)
        hit = (out, torch.Size(out_shape), out.box(out_shape).sizes)
        _MEMO.put(key, hit)
    return ShardedTensor(st._local_tensor.reshape(hit[2]), hit[0], hit[1])


for _op in (
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.detach.default,
    aten.alias.default,
):
    FAST_HANDLERS[_op] = _layout_only_fast
for _op in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
    FAST_HANDLERS[_op] = _view_fast


_INPLACE_VIEWS = {
    aten.squeeze_.default: (_squeeze, aten.squeeze.default),
    aten.squeeze_.dim: (_squeeze, aten.squeeze.dim),
    aten.squeeze_.dims: (_squeeze, aten.squeeze.dims),
    aten.unsqueeze_.default: (_unsqueeze, aten.unsqueeze.default),
}


@register_rule(*_INPLACE_VIEWS)
def _inplace_view(func, args, kwargs):
    """``squeeze_`` / ``unsqueeze_``: torch's own ``matmul`` of a 1-D operand ends in
    ``squeeze_(0)`` on its result. The tensor takes the out-of-place result's layout,
    and its wrapper's sizes follow (as DTensor does)."""
    from torch.utils._python_dispatch import return_and_correct_aliasing

    rule, plain = _INPLACE_VIEWS[func]
    st = args[0]
    out = rule(plain, args, kwargs)
    st._local_tensor, st._placement = out._local_tensor, out._placement
    return return_and_correct_aliasing(func, args, kwargs, st)
