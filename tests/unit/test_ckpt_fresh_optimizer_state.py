"""Resuming an optimizer that never stepped some parameters (an unused pooler, an expert
no token was routed to), found by a model audit (2026-11-28).

Adam keeps no state for a parameter that never got a gradient, so the checkpoint has none
for it; the resume recipe primes a fresh optimizer (``prime_optimizer``), which then holds
state for every parameter, and the restore failed with missing keys. A parameter with no
saved state now gets none, exactly as the saved optimizer had; a checkpoint without the
optimizer at all is still an error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointManager, StateDictMismatchError, prime_optimizer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)  # never in the forward: Adam has no state for it

    def forward(self, x):
        return self.used(x)


def _step(model, optim, seed):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def _trained():
    model = Net()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for seed in range(2):
        _step(model, optim, seed)
    return model, optim


def test_the_manager_resume_recipe_leaves_never_stepped_parameters_fresh(tmp_path):
    model, optim = _trained()
    with CheckpointManager(tmp_path, save_interval=1) as mgr:
        mgr.save(2, {"model": model.state_dict(), "optim": optim.state_dict()}, force=True)
    resumed = Net()
    resumed_optim = torch.optim.Adam(resumed.parameters(), lr=0.1)
    prime_optimizer(resumed_optim)  # state for all four parameters
    state = {"model": resumed.state_dict(), "optim": resumed_optim.state_dict()}
    with CheckpointManager(tmp_path, save_interval=1) as mgr:
        mgr.restore(2, state)
    resumed_optim.load_state_dict(state["optim"])
    assert sorted(resumed_optim.state_dict()["state"]) == sorted(optim.state_dict()["state"])
    _step(model, optim, 7)  # the next step matches the uninterrupted run exactly
    _step(resumed, resumed_optim, 7)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_an_optimizer_given_as_a_stateful_too(tmp_path):
    model, optim = _trained()
    dcp.save({"optim": optim}, checkpoint_id=tmp_path)
    fresh = torch.optim.Adam(Net().parameters(), lr=0.1)
    prime_optimizer(fresh)
    dcp.load({"optim": fresh}, checkpoint_id=tmp_path)
    assert sorted(fresh.state_dict()["state"]) == sorted(optim.state_dict()["state"])


def test_a_checkpoint_without_the_optimizer_still_raises(tmp_path):
    model, _ = _trained()
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path)
    fresh = torch.optim.Adam(Net().parameters(), lr=0.1)
    prime_optimizer(fresh)
    with pytest.raises(StateDictMismatchError, match=r"optim\.state\.0\.exp_avg"):
        dcp.load({"model": Net().state_dict(), "optim": fresh.state_dict()}, checkpoint_id=tmp_path)
