"""Deferred initialization: FSDP on a model built on the meta device."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._build import own_modules
from ._errors import FSDPUsageError

__all__ = ["materialize_meta", "uses_checkpointing", "FSDPUsageError"]


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
    """
    pending = [m for m in own_modules(root) if _has_meta(m)]
    if not pending:
        return
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
