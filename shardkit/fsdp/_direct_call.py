"""Calls of an FSDP unit's wrapped module that bypass the wrapper's forward.

Outside the wrapper's forward a wrapped module's parameters hold only this rank's rows,
so such a call would compute silently wrong values. Code moved over from torch makes it
in several ways: ``model.module(x)`` or a reference kept from before wrapping, a
submodule called on its own (``model.get_input_embeddings()(ids)``), and Hugging Face
``model.generate()``, which the wrapper forwards to the inner model and which calls
that model (or its encoder) directly. Without autograd (evaluation, generation) the hooks
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
    """Hook ``unit.module`` and every module holding one of the unit's parameters (an
    embedding called as ``model.get_input_embeddings()(ids)``, an encoder's layers
    called by ``generate()``) so that a direct call gathers (no autograd) or is refused."""
    modules = {id(unit.module): unit.module}
    for param in unit._state.params:
        for module, _ in param.owners:
            modules.setdefault(id(module), module)
    for module in modules.values():
        module.register_forward_pre_hook(unit._direct_call_pre_hook, with_kwargs=True)
        module.register_forward_hook(unit._direct_call_post_hook, always_call=True)


def pre_hook(unit, module, args: tuple, kwargs: dict):
    if unit._full_installed or not unit._state.params:
        return None  # inside the wrapper's forward or backward, or nothing sharded here
    if torch.is_grad_enabled():
        raise FSDPUsageError(_refusal(unit, module))
    if unit._nested and unit._is_root is None:
        raise FSDPUsageError(
            f"the {type(module).__name__} of a nested FSDP unit was called directly before "
            "the outermost FSDP module ran any forward; run one forward through it first"
        )
    unit._lazy_init()
    if unit._is_root:
        unit._start_root_call()
    # the outermost module called restores the shards (kept out of the module tree)
    unit.__dict__["_direct_call"] = module
    unit._install(unit._state.fulls(), full=True)  # fulls() gathers first
    return cast_floats((args, kwargs), unit._opts.compute_dtype)


def post_hook(unit, module) -> None:
    if unit._direct_call is not module:
        return  # not a direct call, or a module called inside the one that gathered
    unit._direct_call = None
    unit._restore_shards()
    if unit._is_root:
        unit._root._recording = False
        for inner in unit._root._units:
            inner._state.free()
    else:
        unit._state.free()


def _refusal(unit, module) -> str:
    where = (
        f"the {type(module).__name__} wrapped by FSDP"
        if module is unit.module
        else f"a {type(module).__name__} inside an FSDP unit"
    )
    fix = (
        "call the FSDP module itself (model(x), not model.module(x) or a reference kept "
        "from before wrapping)"
        if module is unit.module
        else "compute it inside the FSDP module's forward (e.g. pass input_ids rather than "
        "inputs_embeds computed from model.get_input_embeddings()), or wrap that module "
        "as an FSDP unit of its own and call the unit"
    )
    return (
        f"{where} was called directly, outside the wrapper's forward, where its parameters "
        f"hold only this rank's rows: {fix}. Without autograd (torch.no_grad(), e.g. "
        "evaluation or generate()) a direct call gathers the full parameters itself"
    )
