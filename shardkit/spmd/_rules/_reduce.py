"""Rules for reductions: sum, mean, amax/amin, max/min, argmax/argmin, vector norms.

Reducing over a sharded dim reduces each shard locally and leaves a pending sum (or
max/min) over that dim's mesh axes, resolved only when the value is needed. An empty
shard (uneven sizes) contributes the reduction's identity. argmax/argmin and the
``max.dim`` / ``min.dim`` pairs need indices, so they gather the reduced dim instead.
p-norms resolve their sum of powers at once, since the root is not linear.
"""

from __future__ import annotations

import math

import torch

from .. import _comm
from .._dispatch import Declined, register_rule
from ._common import Placement, local_under, norm_dim, wrap

aten = torch.ops.aten


def _dims(st, dims) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(st.ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(d, st.ndim) for d in dims})


def _out_shape(shape, dims, keepdim):
    if keepdim:
        return tuple(1 if d in dims else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in dims)


def _reduce(st, dims, keepdim, op: str, local_fn, identity=None):
    """Reduce locally over ``dims``; sharded reduced dims become pending ``op`` axes."""
    p = st._placement
    if p.partial and not all(o == op for _, o in p.partial):
        p = p.without_partial()
    local = local_under(st, p)
    new_partial = tuple((a, op) for d in dims for a in p.spec[d])
    spec = tuple(
        () if d in dims else axes for d, axes in enumerate(p.spec) if keepdim or d not in dims
    )
    out = Placement(p.mesh, spec, p.partial + new_partial)
    out_shape = _out_shape(st.shape, dims, keepdim)
    if identity is not None and any(local.shape[d] == 0 for d in dims):
        sizes = out.box(out_shape).sizes
        result = torch.full(sizes, identity(local.dtype), dtype=local.dtype, device=local.device)
    else:
        result = local_fn(local)
    return wrap(result, out, out_shape)


def _fp32_sum(st, dims, keepdim, local_fn):
    """An fp16/bf16 sum over sharded dims, summed in fp32 and rounded once.

    torch accumulates such sums in fp32 and rounds once; a pending sum in the tensor's
    own dtype would round each rank's partial and then the total, up to ten times
    torch's error on a few hundred rows. So the fp32 partials are summed at once.
    """
    out = _reduce(st, dims, keepdim, "sum", local_fn)
    whole = out._placement.without_partial()
    return wrap(local_under(out, whole).to(st.dtype), whole, out.shape)


def _rounds_per_rank(st, dims, dtype) -> bool:
    return (
        dtype is None
        and st.dtype in (torch.float16, torch.bfloat16)
        and any(st._placement.spec[d] for d in dims)
    )


def _check_as_torch(func, st, args, kwargs, *, empty: bool) -> None:
    """Raise torch's own error where torch refuses the call outright.

    ``empty``: a reduction without an identity over a dim of global size 0; the
    shard-local identity would otherwise answer for a reduction torch refuses. Either
    check runs on a tensor of no data: 0 elements, or the meta device.
    """
    probe = torch.empty(st.shape, dtype=st.dtype, device="cpu" if empty else "meta")
    func(probe, *args[1:], **kwargs)


def _lowest(dtype):
    if dtype == torch.bool:
        return False
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _highest(dtype):
    if dtype == torch.bool:
        return True
    return math.inf if dtype.is_floating_point else torch.iinfo(dtype).max


@register_rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(func, args, kwargs):
    st = args[0]
    if func is aten.sum.default:
        dims, keepdim, dtype = list(range(st.ndim)), False, kwargs.get("dtype")
    else:
        dims = _dims(st, args[1])
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = kwargs.get("dtype")
    if st.ndim == 0:
        return wrap(func(st._local_tensor, *args[1:], **kwargs), st._placement, ())
    if not dims:
        return Declined("an empty dim list")
    if _rounds_per_rank(st, dims, dtype):
        return _fp32_sum(
            st, dims, keepdim, lambda t: aten.sum.dim_IntList(t, dims, keepdim, dtype=torch.float32)
        )
    return _reduce(
        st, dims, keepdim, "sum", lambda t: aten.sum.dim_IntList(t, dims, keepdim, dtype=dtype)
    )


@register_rule(aten.mean.dim, aten.mean.default)
def _mean(func, args, kwargs):
    st = args[0]
    if func is aten.mean.default:
        dims, keepdim = list(range(st.ndim)), False
    else:
        dims = _dims(st, args[1])
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not dims:
        return Declined("an empty dim list")
    dtype = kwargs.get("dtype")
    if dtype is None and not (st.dtype.is_floating_point or st.dtype.is_complex):
        _check_as_torch(func, st, args, kwargs, empty=False)  # torch refuses integer means
    count = math.prod(st.shape[d] for d in dims)
    if _rounds_per_rank(st, dims, dtype):
        return _fp32_sum(
            st,
            dims,
            keepdim,
            lambda t: aten.sum.dim_IntList(t, dims, keepdim, dtype=torch.float32) / count,
        )

    def local_fn(t):
        return aten.sum.dim_IntList(t, dims, keepdim, dtype=dtype) / count

    return _reduce(st, dims, keepdim, "sum", local_fn)


@register_rule(aten.amax.default, aten.amin.default)
def _amax(func, args, kwargs):
    st = args[0]
    dims = _dims(st, args[1] if len(args) > 1 else kwargs.get("dim", ()))
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if any(st.shape[d] == 0 for d in dims):
        _check_as_torch(func, st, args, kwargs, empty=True)
    is_max = func is aten.amax.default
    return _reduce(
        st,
        dims,
        keepdim,
        "max" if is_max else "min",
        lambda t: func(t, dims, keepdim),
        _lowest if is_max else _highest,
    )


@register_rule(aten.max.default, aten.min.default)
def _max_all(func, args, kwargs):
    st = args[0]
    dims = list(range(st.ndim))
    is_max = func is aten.max.default
    if not dims:
        return Declined("a 0-dim tensor")
    if st.numel() == 0:
        _check_as_torch(func, st, args, kwargs, empty=True)
    reducer = aten.amax.default if is_max else aten.amin.default
    return _reduce(
        st,
        dims,
        False,
        "max" if is_max else "min",
        lambda t: reducer(t, dims, False),
        _lowest if is_max else _highest,
    )


def _gather_dim_then_local(func, st, dim, keepdim, args, kwargs):
    p = st._placement.without_partial()
    spec = tuple(() if d == dim else axes for d, axes in enumerate(p.spec))
    req = Placement(p.mesh, spec)
    out = func(local_under(st, req), *args[1:], **kwargs)
    out_spec = tuple(a for d, a in enumerate(spec) if keepdim or d != dim)
    out_p = Placement(p.mesh, out_spec)
    shape = _out_shape(st.shape, [dim], keepdim)
    if isinstance(out, torch.Tensor):
        return wrap(out, out_p, shape)
    return type(out)(wrap(o, out_p, shape) for o in out)


@register_rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default)
def _indexed(func, args, kwargs):
    st = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or st.ndim == 0:
        return Declined("no dim, or a 0-dim tensor")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return _gather_dim_then_local(func, st, norm_dim(dim, st.ndim), keepdim, args, kwargs)


@register_rule(aten.linalg_vector_norm.default)
def _vector_norm(func, args, kwargs):
    st = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dims = _dims(st, args[2] if len(args) > 2 else kwargs.get("dim"))
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    dtype = kwargs.get("dtype")
    if st.ndim == 0:
        return Declined("a 0-dim tensor")
    p = st._placement.without_partial()
    sharded_axes = [a for d in dims for a in p.spec[d]]
    if not sharded_axes:
        local = func(local_under(st, p), ord_, dims, keepdim, dtype=dtype)
        spec = tuple(
            () if d in dims else axes for d, axes in enumerate(p.spec) if keepdim or d not in dims
        )
        return wrap(local, Placement(p.mesh, spec), _out_shape(st.shape, dims, keepdim))
    if ord_ in (math.inf, -math.inf):
        if any(st.shape[d] == 0 for d in dims):
            _check_as_torch(func, st, args, kwargs, empty=True)
        op = "max" if ord_ > 0 else "min"
        return _reduce(
            st,
            dims,
            keepdim,
            op,
            lambda t: func(t, ord_, dims, keepdim, dtype=dtype),
            _lowest if op == "max" else _highest,
        )
    if ord_ == 0 or ord_ < 0:
        return Declined(f"ord={ord_} over sharded dims")
    local = local_under(st, p)
    if dtype is not None:
        local = local.to(dtype)
    powered = aten.sum.dim_IntList(local.abs() ** ord_, dims, keepdim)
    _comm.all_reduce(powered, p.mesh, sorted(set(sharded_axes)), "sum")
    spec = tuple(
        () if d in dims else axes for d, axes in enumerate(p.spec) if keepdim or d not in dims
    )
    return wrap(
        powered ** (1.0 / ord_), Placement(p.mesh, spec), _out_shape(st.shape, dims, keepdim)
    )


@register_rule(aten.all.default, aten.any.default, aten.all.dim, aten.any.dim, aten.all.dims)
def _all_any(func, args, kwargs):
    """``all`` / ``any``: each rank reduces its shard; over sharded dims the booleans are
    combined at once (one all-reduce of the result as bytes: min for all, max for any)."""
    st = args[0]
    if func in (aten.all.default, aten.any.default):
        dims, keepdim = list(range(st.ndim)), False
    else:
        dims = _dims(st, args[1] if len(args) > 1 else kwargs.get("dim"))
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    p = st._placement.without_partial()
    local = local_under(st, p)
    is_all = func.overloadpacket.__name__ == "all"
    if local.numel() == 0 or any(local.shape[d] == 0 for d in dims):
        shape = _out_shape(local.shape, dims, keepdim)
        result = torch.full(shape, is_all, dtype=torch.bool, device=local.device)
    else:
        result = (
            aten.all.dims(local, dims, keepdim) if is_all else aten.any.dims(local, dims, keepdim)
        )
    axes = sorted({a for d in dims for a in p.spec[d]})
    if axes:
        as_bytes = result.to(torch.uint8)
        _comm.all_reduce(as_bytes, p.mesh, axes, "min" if is_all else "max")
        result = as_bytes.to(torch.bool)
    spec = tuple(
        () if d in dims else axes_ for d, axes_ in enumerate(p.spec) if keepdim or d not in dims
    )
    return wrap(result, Placement(p.mesh, spec), _out_shape(st.shape, dims, keepdim))
