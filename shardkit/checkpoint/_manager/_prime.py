"""Create an optimizer's lazily allocated state so a checkpoint can load into it in place.

torch optimizers allocate their per-parameter state (SGD's momentum buffer, Adam's
``step``/``exp_avg``/``exp_avg_sq``) on the first ``step()``. An in-place load needs
those tensors to exist beforehand, with their final shapes, dtypes and devices, so the
checkpoint layer knows what to read and where to put it. :func:`prime_optimizer` runs
one step that cannot move the parameters, then zeroes the state it created.
"""

from __future__ import annotations

import torch

__all__ = ["prime_optimizer"]

# Hyperparameters that make a step change the parameters or seed the state with
# non-zero values; each is set to zero for the priming step and restored afterwards.
_ZEROED_HYPERPARAMS = ("lr", "weight_decay")


def _zero_like(value):
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0


def prime_optimizer(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Allocate ``optim``'s per-parameter state, zeroed, without changing any parameter.

    Call it on a freshly built optimizer right before loading a checkpoint into
    ``optim.state_dict()`` in place (see :class:`CheckpointManager`). It sets a zero
    gradient on every parameter that requires grad, runs ``optim.step()`` with ``lr``
    and ``weight_decay`` temporarily 0, restores those hyperparameters, then zeroes
    every state tensor (step counters back to 0, moments and momentum buffers to 0).

    Destructive: any state ``optim`` already had (moments, momentum, step counts) is
    overwritten with zeros. The parameters' values and their ``.grad`` attributes are
    left as they were. Primed state behaves like fresh state for Adam, AdamW and SGD
    without dampening; for SGD with ``dampening != 0`` the first step after priming
    differs from a fresh optimizer's, which is why priming is only meant to be followed
    by a load that overwrites the state.

    Works for optimizers whose ``step()`` needs no closure; tested with SGD (with
    momentum), Adam and AdamW.

    Args:
        optim: the optimizer to prime.

    Returns:
        ``optim`` itself, for chaining.
    """
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"prime_optimizer expects a torch.optim.Optimizer, got {type(optim).__name__}"
        )
    params = [p for group in optim.param_groups for p in group["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_hparams = [
        {k: group[k] for k in _ZEROED_HYPERPARAMS if k in group} for group in optim.param_groups
    ]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group, saved in zip(optim.param_groups, saved_hparams):
            for key, value in saved.items():
                group[key] = _zero_like(value)
        optim.step()
    finally:
        for group, saved in zip(optim.param_groups, saved_hparams):
            group.update(saved)
        for p, g in zip(params, saved_grads):
            p.grad = g
    with torch.no_grad():
        for state in optim.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    state[key] = type(value)(0)
    return optim
