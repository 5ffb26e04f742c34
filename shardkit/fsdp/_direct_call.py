"""Calls of an FSDP unit's wrapped module that bypass the wrapper's forward.

Outside the wrapper's forward a wrapped module's parameters hold only this rank's rows,
so such a call would compute silently wrong values. Code moved over from torch makes it
in two ways: ``model.module(x)`` or a reference kept from before wrapping, and
Hugging Face ``model.generate()``, which the wrapper forwards to the inner model and
which calls that model directly. Without autograd (evaluation, generation) the hooks
here gather the unit's full parameters around the call, as FSDP2's hooks do; with
autograd a direct call is refused, because its gradients would bypass the unit's
reduce-scatter.
"""

from __future__ import annotations

import torch

from ._errors import FSDPUsageError
from ._options import cast_floats

__all__ = ["install_direct_call_hooks"]


def install_direct_call_hooks(unit) -> None:
    """Hook ``unit.module`` so that a direct call gathers (no autograd) or is refused."""
    unit.module.register_forward_pre_hook(unit._direct_call_pre_hook, with_kwargs=True)
    unit.module.register_forward_hook(unit._direct_call_post_hook, always_call=True)


def pre_hook(unit, module, args: tuple, kwargs: dict):
    if unit._full_installed or not unit._state.params:
        return None  # inside the wrapper's forward or backward, or nothing sharded here
    if torch.is_grad_enabled():
        raise FSDPUsageError(
            f"the {type(module).__name__} wrapped by FSDP was called directly, outside the "
            "wrapper's forward, where its parameters hold only this rank's rows: call the "
            "FSDP module itself (model(x), not model.module(x) or a reference kept from "
            "before wrapping). Without autograd (torch.no_grad(), e.g. evaluation or "
            "generate()) a direct call gathers the full parameters itself"
        )
    if unit._nested and unit._is_root is None:
        raise FSDPUsageError(
            f"the {type(module).__name__} of a nested FSDP unit was called directly before "
            "the outermost FSDP module ran any forward; run one forward through it first"
        )
    unit._lazy_init()
    if unit._is_root:
        unit._start_root_call()
    unit._direct_call = True
    unit._install(unit._state.fulls(), full=True)  # fulls() gathers first
    return cast_floats((args, kwargs), unit._opts.compute_dtype)


def post_hook(unit) -> None:
    if not unit._direct_call:
        return
    unit._direct_call = False
    unit._restore_shards()
    if unit._is_root:
        unit._root._recording = False
        for inner in unit._root._units:
            inner._state.free()
    else:
        unit._state.free()
