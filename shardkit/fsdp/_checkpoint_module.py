"""Activation checkpointing that composes with FSDP's re-gather in backward."""

from __future__ import annotations

import functools
import types

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_module"]


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s activations in backward instead of keeping them.

    The module is changed in place and returned, so parameter names do not change (no
    wrapper prefix in state dicts). Uses non-reentrant :func:`torch.utils.checkpoint`,
    which supports keyword arguments. Inside FSDP (``FSDP(checkpoint_module(m))`` or an
    ``auto_wrapper_callable`` doing that), the unit re-gathers its parameters before the
    recomputation reads them.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_module expects an nn.Module, got {type(module).__name__}")
    if getattr(module, "_shardkit_checkpointed", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = types.MethodType(forward, module)
    module._shardkit_checkpointed = True
    return module
