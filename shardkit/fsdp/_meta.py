"""Deferred initialization: FSDP on a model built on the meta device."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._build import own_modules
from ._errors import FSDPUsageError

__all__ = ["materialize_meta", "uses_checkpointing", "FSDPUsageError", "replaced_after_wrapping"]


def _has_meta(module: nn.Module) -> bool:
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.is_meta for t in tensors)


def materialize_meta(
    root: nn.Module, param_init_fn: Callable | None, device: torch.device | None = None
) -> None:
    """Initialize the unit's modules that hold meta tensors, before they are sharded.

    With ``param_init_fn`` it is called on each such module (as torch's FSDP does);
    without, each is given empty storage on ``device`` (default CPU) and its
    ``reset_parameters()`` runs, as torch_xla's and torch's FSDP do by default.
    Materializing module by module gives each module of a tied parameter its own new
    tensor (``lm_head`` and ``wte``), so the ties the meta model declared are made again
    afterwards, with the first module's values (Hugging Face's ``tie_weights`` keeps the
    input embedding's too).
    """
    pending = [m for m in own_modules(root) if _has_meta(m)]
    if not pending:
        return
    ties: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in own_modules(root):
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                ties.setdefault(id(param), []).append((module, name))
    device = device or torch.device("cpu")
    for module in pending:
        if param_init_fn is not None:
            param_init_fn(module)
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise FSDPUsageError(
                f"{type(module).__name__} holds meta-device tensors and has no "
                "reset_parameters(); pass param_init_fn=fn(module) to FSDP to initialize it"
            )
        module.to_empty(device=device, recurse=False)
        reset()
    for owners in ties.values():
        (first, first_name), rest = owners[0], owners[1:]
        for module, name in rest:
            module._parameters[name] = first._parameters[first_name]
    left = [type(m).__name__ for m in own_modules(root) if _has_meta(m)]
    if param_init_fn is not None and left:
        raise FSDPUsageError(
            f"param_init_fn left meta-device tensors in {sorted(set(left))}; it must "
            "materialize them, e.g. module.to_empty(device='cpu', recurse=False) then "
            "initialize"
        )


def uses_checkpointing(root: nn.Module) -> bool:
    """Whether a unit's modules recompute activations (ours, or torch's checkpoint_wrapper)."""
    return any(
        getattr(m, "_shardkit_checkpointed", False) or hasattr(m, "_checkpoint_wrapped_module")
        for m in own_modules(root)
    )


def replaced_after_wrapping(param, module: nn.Module, name: str) -> None:
    """Raise for a parameter attribute the model reassigned after wrapping.

    FSDP puts each parameter's shard or full tensor into its modules itself, so a
    reassignment (``tie_weights()`` after wrapping, ``load_state_dict(assign=True)``)
    would be overwritten silently, and that module would compute with stale values.
    """
    raise FSDPUsageError(
        f"the {type(module).__name__}'s parameter {name!r} (in the unit: "
        f"{' = '.join(repr(f) for f in param.fqns)}) was replaced after FSDP wrapped the model, e.g. by tie_weights() or "
        "load_state_dict(assign=True); FSDP would overwrite it with its own tensor. Tie "
        "or replace parameters before wrapping (with a meta-device model: inside "
        "param_init_fn, or tie the model's weights and let FSDP keep the tie), and load "
        "with load_state_dict() without assign"
    )
