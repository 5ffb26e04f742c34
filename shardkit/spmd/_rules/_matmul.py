"""Rules for matrix products: mm, bmm, addmm (matmul, linear and einsum decompose to these).

Each operand dim may keep its sharding: the row dim of A, the column dim of B, the
batch dim, and the contracted dim ``k``. Sharding ``k`` identically on both sides makes
the product a pending sum over those axes (resolved lazily, when the value is needed).
Candidates are ranked by the bytes their input moves need plus the later cost of a
pending sum (not charged when both operands already share the contracted dim's axes).
"""

from __future__ import annotations

from itertools import product

import torch

from .._dispatch import Declined, register_rule
from ._common import (
    Memo,
    Placement,
    disjoint,
    is_partial_leader,
    is_st,
    local_under,
    move_cost,
    partial_cost,
    wrap,
)

aten = torch.ops.aten


def _spec_and_partial(x, ndim):
    if is_st(x):
        return x._placement.spec, x._placement.partial
    return ((),) * ndim, ()


def _unique(options):
    out = []
    for o in options:
        if o not in out:
            out.append(o)
    return out


#: plans by the operands' layouts, shapes and element sizes: a training step repeats the
#: same few dozen products
_PLANS = Memo(4096)


def _layout_key(x):
    if not isinstance(x, torch.Tensor):
        return x if x is None or isinstance(x, (int, float)) else type(x)
    return (x._placement if is_st(x) else None, tuple(x.shape), x.element_size())


def _plan(a, b, batched: bool, mesh, out_shape, bias=None, elsize=4):
    key = (_layout_key(a), _layout_key(b), _layout_key(bias), batched, mesh, elsize)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _choose(a, b, batched, mesh, out_shape, bias, elsize))
    return plan


def _choose(a, b, batched: bool, mesh, out_shape, bias=None, elsize=4):
    sa, pa = _spec_and_partial(a, a.ndim)
    sb, pb = _spec_and_partial(b, b.ndim)
    if batched:
        (a_b, a_m, a_k), (b_b, b_k, b_n) = sa, sb
    else:
        (a_m, a_k), (b_k, b_n), a_b, b_b = sa, sb, (), ()
    sums_only = all(op == "sum" for _, op in pa + pb)
    best = None
    for bb, m, k, n in product(
        _unique([a_b, b_b, ()]) if batched else [()],
        _unique([a_m, ()]),
        _unique([a_k, b_k, ()]),
        _unique([b_n, ()]),
    ):
        if not disjoint(bb, m, k, n):
            continue
        used = set(bb + m + k + n)
        keep_a = pa if pa and not pb and sums_only and not used & {x for x, _ in pa} else ()
        keep_b = pb if pb and not pa and sums_only and not used & {x for x, _ in pb} else ()
        req_a = Placement(mesh, ((bb,) if batched else ()) + (m, k), keep_a)
        req_b = Placement(mesh, ((bb,) if batched else ()) + (k, n), keep_b)
        out_partial = tuple((x, "sum") for x in k) + keep_a + keep_b
        out = Placement(mesh, ((bb,) if batched else ()) + (m, n), out_partial)
        cost = move_cost(a, req_a) + move_cost(b, req_b)
        if not (k and a_k == k and b_k == k):
            # a contraction the operands already share is left pending for free, as
            # DTensor does: its sum is resolved later, often merged with others (gradient
            # accumulation, residual adds) into one collective, so moving operands now to
            # avoid it would pay for traffic the pending sum may never need
            cost += partial_cost(out, out_shape, elsize)
        req_bias = None
        if bias is not None and isinstance(bias, torch.Tensor):
            req_bias = _bias_placement(bias, out, out_shape)
            cost += move_cost(bias, req_bias)
        if best is None or cost < best[0]:
            best = (cost, req_a, req_b, out, req_bias)
    return best[1:]


def _bias_placement(bias, out: Placement, out_shape) -> Placement:
    off = len(out_shape) - bias.ndim
    spec = tuple(
        out.spec[i + off] if bias.shape[i] == out_shape[i + off] else () for i in range(bias.ndim)
    )
    return Placement(out.mesh, spec)


@register_rule(aten.mm.default, aten.bmm.default)
def _mm(func, args, kwargs):
    a, b = args
    batched = func is aten.bmm.default
    mesh = (a if is_st(a) else b)._placement.mesh
    out_shape = (a.shape[0], a.shape[1], b.shape[2]) if batched else (a.shape[0], b.shape[1])
    req_a, req_b, out, _ = _plan(a, b, batched, mesh, out_shape, elsize=a.element_size())
    local = func(local_under(a, req_a), local_under(b, req_b))
    return wrap(local, out, out_shape)


@register_rule(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, a, b = args[:3]
    if is_st(bias) and bias._placement.partial:
        return Declined("a bias holding a pending sum")
    mesh = next(x for x in (a, b, bias) if is_st(x))._placement.mesh
    out_shape = (a.shape[0], b.shape[1])
    req_a, req_b, out, req_bias = _plan(
        a, b, False, mesh, out_shape, bias=bias, elsize=a.element_size()
    )
    local_bias = local_under(bias, req_bias) if isinstance(bias, torch.Tensor) else bias
    if out.partial and not is_partial_leader(out) and isinstance(local_bias, torch.Tensor):
        # the bias joins the pending sum once, on the leader
        local_bias = torch.zeros_like(local_bias)
    local = func(local_bias, local_under(a, req_a), local_under(b, req_b), *args[3:], **kwargs)
    return wrap(local, out, out_shape)
