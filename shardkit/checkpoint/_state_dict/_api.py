"""Model and optimizer state dicts in one call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ._model import IncompatibleKeys, get_model_state_dict, set_model_state_dict
from ._optim import as_optimizers, get_optimizer_state_dict, set_optimizer_state_dict
from ._options import StateDictOptions

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: Iterable[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)``, both keyed by unwrapped FQNs; the
    second is ``{}`` when ``optimizers`` is empty (a model without an optimizer), as in
    torch."""
    optims = as_optimizers(optimizers)
    model_sd = get_model_state_dict(model, submodules=submodules, options=options)
    if not optims:
        return model_sd, {}
    optim_sd = get_optimizer_state_dict(model, optims, submodules=submodules, options=options)
    return model_sd, optim_sd


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any],
    options: StateDictOptions | None = None,
) -> IncompatibleKeys:
    """Load both state dicts; returns the model's missing / unexpected keys. With no
    optimizers (an empty list) only the model is loaded, as in torch."""
    optims = as_optimizers(optimizers)
    result = set_model_state_dict(model, model_state_dict, options=options)
    if optims:
        set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
    return result
