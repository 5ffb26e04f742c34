"""Rules for neural-network ops: softmax / log_softmax, layer_norm, embedding, dropout
and the negative log-likelihood behind cross_entropy (rms_norm decomposes into
pointwise ops and a mean, which have their own rules).
"""

from __future__ import annotations

import math

import torch

from .. import _comm
from .._dispatch import Declined, register_rule
from ._common import Memo, Placement, is_st, local_under, move_cost, norm_dim, wrap

aten = torch.ops.aten


def _mesh(*xs):
    return next(x for x in xs if is_st(x))._placement.mesh


def _spec_of(x):
    return x._placement.spec if is_st(x) else ((),) * x.ndim


def _unshard(spec, dims):
    return tuple(() if d in dims else a for d, a in enumerate(spec))


def _replicated(x, mesh):
    if x is None or not isinstance(x, torch.Tensor):
        return x
    return local_under(x, Placement.replicated(mesh, x.ndim))


# -- softmax ----------------------------------------------------------------------------
@register_rule(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def _softmax(func, args, kwargs):
    st, dim = args[0], norm_dim(args[1], args[0].ndim)
    p = st._placement
    if p.spec[dim] and func is not aten._safe_softmax.default and st.is_floating_point():
        return _sharded_softmax(func, st, dim, args)
    req = Placement(p.mesh, _unshard(p.spec, {dim}))
    return wrap(func(local_under(st, req), dim, *args[2:]), req, st.shape)


def _sharded_softmax(func, st, dim, args):
    """Softmax over a sharded dim without gathering it (vocabulary-parallel logits): the
    row max and the row sum of exponentials are all-reduced over the dim's axes, one
    value per row each."""
    p = st._placement.without_partial()
    axes = sorted(p.spec[dim])
    local = local_under(st, p)
    if len(args) > 2 and args[2]:  # half_to_float
        local = local.float()
    if local.shape[dim]:
        row_max = local.amax(dim, keepdim=True)
    else:
        sizes = list(local.shape)
        sizes[dim] = 1
        row_max = local.new_full(sizes, -math.inf)
    _comm.all_reduce(row_max, p.mesh, axes, "max")
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    shifted = local - row_max
    sum_exp = shifted.exp().sum(dim, keepdim=True)
    _comm.all_reduce(sum_exp, p.mesh, axes, "sum")
    if func is aten._log_softmax.default:
        out = shifted - sum_exp.log()
    else:
        out = shifted.exp() / sum_exp
    return wrap(out, p, st.shape)


@register_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(func, args, kwargs):
    grad, output, dim = args[0], args[1], norm_dim(args[2], args[1].ndim)
    mesh = _mesh(grad, output)
    out_spec = _spec_of(output)
    if out_spec[dim]:
        # the softmax dim is sharded: the one row sum the formula needs is all-reduced
        req = Placement(mesh, out_spec)
        g, o = local_under(grad, req), local_under(output, req)
        axes = sorted(out_spec[dim])
        if func is aten._log_softmax_backward_data.default:
            row = g.sum(dim, keepdim=True)
            _comm.all_reduce(row, mesh, axes, "sum")
            local = g - o.exp() * row
        else:
            row = (g * o).sum(dim, keepdim=True)
            _comm.all_reduce(row, mesh, axes, "sum")
            local = o * (g - row)
        return wrap(local.to(args[3]), req, grad.shape)
    options = [_unshard(_spec_of(x), {dim}) for x in (grad, output)]
    req = min(
        (Placement(mesh, s) for s in options),
        key=lambda r: move_cost(grad, r) + move_cost(output, r),
    )
    local = func(local_under(grad, req), local_under(output, req), dim, *args[3:])
    return wrap(local, req, grad.shape)


# -- layer norm -------------------------------------------------------------------------
@register_rule(aten.native_layer_norm.default)
def _layer_norm(func, args, kwargs):
    x, normalized, weight, bias, eps = args
    mesh = _mesh(x, weight, bias)
    lead = x.ndim - len(normalized)
    spec = _unshard(_spec_of(x), set(range(lead, x.ndim)))
    req = Placement(mesh, spec)
    out, mean, rstd = func(
        local_under(x, req), normalized, _replicated(weight, mesh), _replicated(bias, mesh), eps
    )
    stat_shape = tuple(x.shape[:lead]) + (1,) * len(normalized)
    return (
        wrap(out, req, x.shape),
        wrap(mean, req, stat_shape),
        wrap(rstd, req, stat_shape),
    )


@register_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func, args, kwargs):
    grad, x, normalized, mean, rstd, weight, bias, mask = args
    mesh = _mesh(grad, x, mean, rstd, weight, bias)
    lead = x.ndim - len(normalized)
    norm_dims = set(range(lead, x.ndim))
    options = [_unshard(_spec_of(t), norm_dims) for t in (x, grad)]
    req = min(
        (Placement(mesh, s) for s in options),
        key=lambda r: move_cost(x, r) + move_cost(grad, r),
    )
    stat_shape = tuple(x.shape[:lead]) + (1,) * len(normalized)
    gi, gw, gb = func(
        local_under(grad, req),
        local_under(x, req),
        normalized,
        local_under(mean, req) if stat_shape else mean,
        local_under(rstd, req) if stat_shape else rstd,
        _replicated(weight, mesh),
        _replicated(bias, mesh),
        mask,
    )
    # every rank saw only its rows: weight / bias gradients are sums pending over them
    partial = tuple((a, "sum") for axes in req.spec for a in axes)
    param = Placement(mesh, ((),) * len(normalized), partial)
    shape = tuple(normalized)
    return (
        wrap(gi, req, x.shape) if gi is not None else None,
        wrap(gw, param, shape) if gw is not None else None,
        wrap(gb, param, shape) if gb is not None else None,
    )


def _check_indices(indices: torch.Tensor, bound: int, message: str) -> None:
    """Raise as torch does for an index outside ``[0, bound)``: a table or class dim split
    over ranks would otherwise read zero for it on every rank, silently. On the CPU the
    check is torch's ``IndexError``; elsewhere an asynchronous assert (no host sync)."""
    if not indices.numel():
        return
    if indices.device.type == "cpu":
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= bound:
            raise IndexError(message.format(value=low if low < 0 else high))
    else:
        # no value without a host sync: the message names none
        torch._assert_async(
            ((indices >= 0) & (indices < bound)).all(), message.replace(" {value}", "")
        )


# -- embedding --------------------------------------------------------------------------
@register_rule(aten.embedding.default)
def _embedding(func, args, kwargs):
    weight, indices = args[0], args[1]
    mesh = _mesh(weight, indices)
    w_spec = _spec_of(weight)
    vocab_axes, dim_axes = w_spec
    w_req = Placement(mesh, w_spec)
    used = set(vocab_axes) | set(dim_axes)
    i_spec = tuple(tuple(a for a in axes if a not in used) for axes in _spec_of(indices))
    i_req = Placement(mesh, i_spec)
    local_w = local_under(weight, w_req)
    local_i = local_under(indices, i_req)
    out_shape = tuple(indices.shape) + (weight.shape[1],)
    if not vocab_axes:
        local = func(local_w, local_i, *args[2:], **kwargs)
        return wrap(local, Placement(mesh, i_spec + (dim_axes,)), out_shape)
    # vocabulary-parallel: each rank looks up the rows it owns; the rest read zero and the
    # result is a sum pending over the vocabulary axes
    _check_indices(local_i, weight.shape[0], "index out of range in self")
    lo, size = w_req.box(weight.shape).offsets[0], local_w.shape[0]
    outside = (local_i < lo) | (local_i >= lo + size)
    shifted = (local_i - lo).clamp(0, max(size - 1, 0))
    if size == 0:
        local = local_w.new_zeros(tuple(local_i.shape) + (local_w.shape[1],))
    else:
        local = func(local_w, shifted).masked_fill(outside.unsqueeze(-1), 0)
    partial = tuple((a, "sum") for a in vocab_axes)
    return wrap(local, Placement(mesh, i_spec + (dim_axes,), partial), out_shape)


@register_rule(aten.embedding_dense_backward.default)
def _embedding_backward(func, args, kwargs):
    grad, indices, num_weights, padding_idx, scale_by_freq = args
    mesh = _mesh(grad, indices)
    g_spec = _spec_of(grad)
    dim_axes = g_spec[-1]
    i_spec = tuple(tuple(a for a in axes if a not in dim_axes) for axes in g_spec[:-1])
    if scale_by_freq and any(i_spec):
        return Declined("scale_grad_by_freq with sharded indices (needs global counts)")
    req_g = Placement(mesh, i_spec + (dim_axes,))
    req_i = Placement(mesh, i_spec)
    local = func(local_under(grad, req_g), local_under(indices, req_i), *args[2:])
    partial = tuple((a, "sum") for axes in i_spec for a in axes)
    out = Placement(mesh, ((), dim_axes), partial)
    return wrap(local, out, (num_weights, grad.shape[-1]))


# -- dropout ----------------------------------------------------------------------------
@register_rule(aten.native_dropout.default)
def _native_dropout(func, args, kwargs):
    """Draw the full-size mask exactly as one device would, keep this shard's slice."""
    st, p_drop, train = args[0], args[1], args[2]
    placement = st._placement.without_partial()
    local = local_under(st, placement)
    if train is False:
        out, mask = func(local, p_drop, train)
        return wrap(out, placement, st.shape), wrap(mask, placement, st.shape)
    ones = torch.ones(st.shape, dtype=st.dtype, device=local.device)
    _, full_mask = func(ones, p_drop, train)
    mask = full_mask[placement.box(st.shape).slices()].clone()
    scale = 0.0 if p_drop >= 1 else 1.0 / (1.0 - p_drop)
    out = local * mask * scale
    return wrap(out, placement, st.shape), wrap(mask, placement, st.shape)


# -- negative log-likelihood --------------------------------------------------------------
def _nll_placements(x, target):
    mesh = _mesh(x, target)
    batch_axes = _spec_of(x)[0] if x.ndim == 2 else ()
    if not batch_axes and is_st(target) and target.ndim == 1:
        batch_axes = target._placement.spec[0]
    x_spec = (batch_axes, ()) if x.ndim == 2 else ((),)
    return mesh, batch_axes, Placement(mesh, x_spec), Placement(mesh, (batch_axes,) * target.ndim)


def _class_axes(x, batch_axes) -> tuple:
    """The axes of ``x``'s class dim (2-D input) that the batch does not use."""
    if x.ndim != 2 or not is_st(x) or not x.is_floating_point():
        return ()
    return tuple(a for a in x._placement.spec[1] if a not in batch_axes)


def _class_sharded_pick(x, target, weight, ignore_index, batch_axes, class_axes):
    """Vocabulary-parallel NLL: each rank picks the targets that fall in its classes."""
    mesh = _mesh(x, target)
    x_req = Placement(mesh, (batch_axes, class_axes))
    t_req = Placement(mesh, (batch_axes,))
    lx, lt = local_under(x, x_req), local_under(target, t_req)
    lw = _replicated(weight, mesh)
    valid = lt != ignore_index
    _check_indices(torch.where(valid, lt, 0), x.shape[1], "Target {value} is out of bounds.")
    lo, size = x_req.box(x.shape).offsets[1], lx.shape[1]
    mine = valid & (lt >= lo) & (lt < lo + size)
    idx = (lt - lo).clamp(0, max(size - 1, 0))
    if lw is None:
        w_t = valid.to(lx.dtype)
    else:
        w_t = lw[torch.where(valid, lt, 0)] * valid
    return mesh, x_req, lx, mine, idx, w_t


@register_rule(aten.nll_loss_forward.default)
def _nll_forward(func, args, kwargs):
    x, target, weight, reduction, ignore_index = args
    mesh, axes, x_req, t_req = _nll_placements(x, target)
    class_axes = _class_axes(x, axes)
    if class_axes:
        mesh, x_req, lx, mine, idx, w_t = _class_sharded_pick(
            x, target, weight, ignore_index, axes, class_axes
        )
        picked = (
            lx.gather(1, idx.unsqueeze(1)).squeeze(1) if lx.shape[1] else lx.new_zeros(w_t.shape)
        )
        losses = torch.where(mine, -picked * w_t, torch.zeros_like(w_t))
        total = w_t.sum().to(lx.dtype)
        _comm.all_reduce(total, mesh, sorted(axes), "sum")
        class_partial = tuple((a, "sum") for a in class_axes)
        rep = Placement.replicated(mesh, 0)
        if reduction == 0:
            return (
                wrap(losses, Placement(mesh, (axes,), class_partial), target.shape),
                wrap(total, rep, ()),
            )
        out = losses.sum()
        if reduction == 1:
            out = out / total
        partial = class_partial + tuple((a, "sum") for a in axes)
        return wrap(out, Placement(mesh, (), partial), ()), wrap(total, rep, ())
    lx, lt, lw = local_under(x, x_req), local_under(target, t_req), _replicated(weight, mesh)
    if not axes:
        out, total = func(lx, lt, lw, reduction, ignore_index)
        rep = Placement.replicated(mesh, 0)
        return wrap(out, Placement.replicated(mesh, out.ndim), out.shape), wrap(total, rep, ())
    if reduction == 0:  # none: one loss per (sharded) row
        out, total = func(lx, lt, lw, reduction, ignore_index)
        return (
            wrap(out, Placement(mesh, (axes,)), target.shape),
            wrap(total, Placement.replicated(mesh, 0), ()),
        )
    out, _ = func(lx, lt, lw, 2, ignore_index)  # this shard's summed loss
    valid = lt != ignore_index
    if lw is None:
        total = valid.sum().to(lx.dtype)
    else:
        total = (lw[torch.where(valid, lt, 0)] * valid).sum().to(lx.dtype)
    _comm.all_reduce(total, mesh, sorted(axes), "sum")
    if reduction == 1:  # mean over the global weight
        out = out / total
    partial = tuple((a, "sum") for a in axes)
    return (
        wrap(out, Placement(mesh, (), partial), ()),
        wrap(total, Placement.replicated(mesh, 0), ()),
    )


@register_rule(aten.nll_loss_backward.default)
def _nll_backward(func, args, kwargs):
    grad, x, target, weight, reduction, ignore_index, total = args
    mesh, axes, x_req, t_req = _nll_placements(x, target)
    class_axes = _class_axes(x, axes)
    if class_axes:
        mesh, x_req, lx, mine, idx, w_t = _class_sharded_pick(
            x, target, weight, ignore_index, axes, class_axes
        )
        if reduction == 0:
            g = local_under(grad, Placement(mesh, (axes,)))
        else:
            g = local_under(grad, Placement.replicated(mesh, grad.ndim))
        coef = -w_t * g
        if reduction == 1:
            coef = coef / _replicated(total, mesh)
        coef = torch.where(mine, coef, torch.zeros_like(coef)).to(lx.dtype)
        local = torch.zeros_like(lx)
        if lx.shape[1]:
            local.scatter_(1, idx.unsqueeze(1), coef.unsqueeze(1))
        return wrap(local, x_req, x.shape)
    g_req = Placement(mesh, (axes,) if grad.ndim == 1 else ((),) * grad.ndim)
    local = func(
        local_under(grad, g_req) if isinstance(grad, torch.Tensor) else grad,
        local_under(x, x_req),
        local_under(target, t_req),
        _replicated(weight, mesh),
        reduction,
        ignore_index,
        _replicated(total, mesh),
    )
    return wrap(local, x_req, x.shape)


# -- attention --------------------------------------------------------------------------
def _mask_placement(mask, mesh, lead, shape) -> Placement:
    """The mask's placement for attention sharded ``lead`` on (batch, heads): it
    broadcasts against ``shape``, so a dim of size 1 (or missing) stays whole."""
    off = len(shape) - mask.ndim
    spec = []
    for i in range(mask.ndim):
        d = i + off
        spec.append(lead[d] if d < 2 and mask.shape[i] == shape[d] else ())
    return Placement(mesh, tuple(spec))


@register_rule(
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
def _attention(func, args, kwargs):
    """Attention is independent per (batch, head): those two dims keep their sharding,
    sequence and head dims are gathered. An ``attn_mask`` is sliced like the batch and
    head dims it spans (broadcast dims stay whole). Dropout inside attention goes
    through the fallback (exact, with the single-device random stream)."""
    backward = func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    n_tensors = 6 if backward else 3
    tensors, rest = list(args[:n_tensors]), list(args[n_tensors:])
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    if dropout_p:
        return Declined(f"dropout_p={dropout_p} inside attention (random stream)")
    mask = kwargs.get("attn_mask")
    other_kwargs = tuple(sorted((k, v) for k, v in kwargs.items() if k != "attn_mask"))
    key = (
        func,
        tuple(_layout(t) for t in tensors),
        _layout(mask) if isinstance(mask, torch.Tensor) else mask,
        tuple(rest),
        other_kwargs,
    )
    try:
        plan = _ATTENTION_PLANS.get(key)
    except TypeError:  # an unhashable argument: plan this call alone
        key, plan = None, None
    if plan is None:
        plan = _attention_plan(func, tensors, rest, kwargs, backward)
        if key is not None:
            _ATTENTION_PLANS.put(key, plan)
    reqs, mask_req, places, shapes = plan
    local_kwargs = dict(kwargs)
    if mask_req is not None:
        local_kwargs["attn_mask"] = local_under(mask, mask_req)
    locals_ = [local_under(t, r) for t, r in zip(tensors, reqs)]
    if any(x.numel() == 0 for x in locals_):
        # an empty shard (fewer heads or batch rows than ranks): the kernel divides by the
        # local head count, so never call it with none; every output's shard is empty too
        device = locals_[0].device
        outs = [
            torch.zeros(p.box(shape).sizes, dtype=dtype, device=device)
            for p, (shape, dtype) in zip(places, shapes)
        ]
    else:
        outs = func(*locals_, *rest, **local_kwargs)
    return tuple(wrap(o, p, shape) for o, p, (shape, _) in zip(outs, places, shapes))


#: attention plans by operand layouts and arguments: every layer repeats the same call
_ATTENTION_PLANS = Memo(1024)


def _layout(t) -> tuple:
    return (t._placement if is_st(t) else None, t.shape, t.dtype)


def _attention_plan(func, tensors, rest, kwargs, backward: bool):
    """``(operand placements, mask placement or None, output placements, output shapes
    and dtypes)``: batch and head dims keep the cheapest operand's sharding."""
    mask = kwargs.get("attn_mask")
    mesh = _mesh(*tensors, *([mask] if mask is not None else []))
    options = []
    for t in tensors:
        lead = _gqa_safe(_spec_of(t)[:2], tensors, mesh)
        if lead not in options:
            options.append(lead)
    q_shape = tuple(tensors[1].shape) if backward else tuple(tensors[0].shape)
    best = None
    for lead in options:
        reqs = [Placement(mesh, lead + ((),) * (t.ndim - 2)) for t in tensors]
        cost = sum(move_cost(t, r) for t, r in zip(tensors, reqs))
        mask_req = None
        if isinstance(mask, torch.Tensor):
            mask_req = _mask_placement(mask, mesh, lead, q_shape)
            cost += move_cost(mask, mask_req)
        if best is None or cost < best[0]:
            best = (cost, lead, reqs, mask_req)
    _, lead, reqs, mask_req = best
    meta_kwargs = dict(kwargs)
    if mask_req is not None:
        meta_kwargs["attn_mask"] = torch.empty(mask.shape, dtype=mask.dtype, device="meta")
    metas = func(
        *[torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors],
        *rest,
        **meta_kwargs,
    )
    places = [Placement(mesh, lead + ((),) * (m.ndim - 2)) for m in metas]
    return reqs, mask_req, places, [(m.shape, m.dtype) for m in metas]


def _gqa_safe(lead, tensors, mesh):
    """``lead`` without its head sharding when query and key/value head counts differ
    (grouped-query attention) and a rank's query heads would not find their key/value
    heads locally: only when every head count splits evenly do the groups line up."""
    axes = lead[1] if len(lead) > 1 else ()
    heads = {t.shape[1] for t in tensors if t.ndim > 2}
    if not axes or len(heads) < 2:
        return lead
    count = 1
    for a in axes:
        count *= mesh.mesh_shape[a]
    if all(h % count == 0 for h in heads):
        return lead
    return (lead[0], ())


# -- mean squared error ---------------------------------------------------------------------
@register_rule(aten.mse_loss.default)
def _mse(func, args, kwargs):
    """Composed from rules (difference, square, mean/sum), so it never gathers."""
    from .._dispatch import dispatch

    x, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    diff = dispatch(aten.sub.Tensor, (x, target), {})
    sq = dispatch(aten.mul.Tensor, (diff, diff), {})
    if reduction == 0:
        return sq
    return dispatch(aten.mean.default if reduction == 1 else aten.sum.default, (sq,), {})


@register_rule(aten.mse_loss_backward.default)
def _mse_backward(func, args, kwargs):
    from .._dispatch import dispatch

    grad, x, target, reduction = args
    scale = 2.0 / max(x.numel(), 1) if reduction == 1 else 2.0  # no rows: an empty gradient
    diff = dispatch(aten.sub.Tensor, (x, target), {})
    scaled = dispatch(aten.mul.Tensor, (diff, scale), {})
    return dispatch(aten.mul.Tensor, (scaled, grad), {})
