"""Rules for the multi-tensor (``_foreach_*``) and fused (``_fused_adam_`` ...) optimizer ops.

These are elementwise per list position, so position ``i`` of every list is brought to
the placement of the first list's tensor ``i`` (normally the parameter) and the op runs
on the local shards: an optimizer step on sharded parameters never communicates unless
a gradient arrives with another placement. Plain (replicated) tensors next to sharded
ones are sliced locally to the sharded layout; a plain tensor updated in place stays
whole. Plain parameters get plain gradients (see ``_dispatch._plain_grad``), so a model
with only some parameters sharded steps without any collective.
"""

from __future__ import annotations

import torch

from .._dispatch import dispatch
from ._common import Placement, is_st, local_under, resolve_inplace, wrap

aten = torch.ops.aten


def foreach_rule(func, args, kwargs):
    name = func.overloadpacket.__name__
    if name in ("_foreach_norm", "_foreach_max"):
        return _per_tensor_reduction(func, args, kwargs)
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    if not lists:
        return NotImplemented
    ref = args[lists[0]]
    inplace = name.endswith("_")
    placements: list[Placement | None] = []
    for j, x in enumerate(ref):
        if is_st(x):
            resolve_inplace(x)
            placements.append(x._placement)
        elif inplace:
            # a plain tensor updated in place must stay whole: its operands come whole
            placements.append(None)
        else:
            # out of place, a plain (replicated) operand is sliced to the first sharded
            # operand's layout: no collective
            other = next((a[j] for a in (args[i] for i in lists) if is_st(a[j])), None)
            placements.append(None if other is None else other._placement.without_partial())
    new_args = list(args)
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            items = []
            for j, x in enumerate(a):
                if isinstance(x, torch.Tensor) and (is_st(x) or placements[j] is not None):
                    target = placements[j]
                    if target is None:
                        target = Placement.replicated(x._placement.mesh, x.ndim)
                    if x.ndim == 0 and not is_st(x):
                        items.append(x)
                        continue
                    # fused kernels assume dense tensors; the new local still holds x's
                    # value, so x adopts it (in-place updates then land in x)
                    local = local_under(x, target).contiguous()
                    if is_st(x):
                        x._local_tensor, x._placement = local, target
                    items.append(local)
                else:
                    items.append(x)
            new_args[i] = items
        elif is_st(a):
            new_args[i] = local_under(a, Placement.replicated(a._placement.mesh, a.ndim))
    new_kwargs = {
        k: local_under(v, Placement.replicated(v._placement.mesh, v.ndim)) if is_st(v) else v
        for k, v in kwargs.items()
    }
    out = func(*new_args, **new_kwargs)
    if out is None:
        return None

    def wrap_list(outs):
        result = []
        for j, o in enumerate(outs):
            if placements[j] is not None and isinstance(o, torch.Tensor):
                result.append(wrap(o, placements[j], ref[j].shape))
            else:
                result.append(o)
        return result

    if isinstance(out, (list, tuple)) and out and isinstance(out[0], (list, tuple)):
        return tuple(wrap_list(o) for o in out)
    if isinstance(out, (list, tuple)):
        return wrap_list(out)
    return NotImplemented


def _per_tensor_reduction(func, args, kwargs):
    tensors = args[0]
    if func.overloadpacket.__name__ == "_foreach_max":
        return [dispatch(aten.max.default, (t,), {}) if is_st(t) else t.max() for t in tensors]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    out = []
    for t in tensors:
        if is_st(t):
            out.append(dispatch(aten.linalg_vector_norm.default, (t, ord_), {"dtype": dtype}))
        else:
            out.append(torch.linalg.vector_norm(t, ord_, dtype=dtype))
    return out


def is_foreach(func) -> bool:
    name = func.overloadpacket.__name__
    return name.startswith("_foreach_") or name.startswith("_fused_")
