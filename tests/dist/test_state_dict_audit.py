"""``shardkit.checkpoint.state_dict`` side by side with torch's (audit of 2026-11-29):

- the state dict of another model's stateless optimizer (no saved group holds any of
  the optimizer's parameters) loaded without a word and dropped every moment, where
  torch raises ``ValueError``;
- a wrapper's own ``model.state_dict()`` (``module.`` keys) loaded nothing under
  ``strict=False``, where torch's DDP loads it all;
- ``broadcast_from_rank0`` refused an optimizer with a tensor learning rate;
- torch's ``StateDictOptions`` was refused with a message naming the same class twice.
"""

import copy

import pytest
import torch
from harness import run_ranks
from torch import nn

import shardkit.checkpoint.state_dict as sd

pytestmark = pytest.mark.timeout(180)
WORLD = 2


def _trained(seed: int, lr=1e-3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, optim


def test_another_optimizers_state_dict_is_refused_and_changes_nothing():
    model, optim = _trained(0)
    other = nn.Linear(3, 3)
    wrong = sd.get_optimizer_state_dict(other, torch.optim.SGD(other.parameters(), lr=1.0))
    before = copy.deepcopy(optim.state_dict())
    with pytest.raises(ValueError, match="no saved param group holds any of the parameters"):
        sd.set_optimizer_state_dict(model, optim, wrong)
    after = optim.state_dict()
    assert len(after["state"]) == 4 and after["param_groups"] == before["param_groups"]
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


def test_torch_state_dict_options_are_taken_over():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model, optim = _trained(0)
    got = sd.get_state_dict(model, optim, options=StateDictOptions(cpu_offload=True))
    assert sorted(got[0]) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def _wrapper_keys_body(kind: str):
    from shardkit.ddp import DistributedDataParallel
    from shardkit.fsdp import FSDP

    wrap = DistributedDataParallel if kind == "ddp" else FSDP
    source, target = (wrap(_trained(seed)[0]) for seed in (0, 1))
    keys = sorted(source.state_dict())  # the wrapper's own: "module.0.weight", ...
    result = sd.set_model_state_dict(
        target, source.state_dict(), options=sd.StateDictOptions(strict=False)
    )
    full = sd.StateDictOptions(full_state_dict=True)
    want = sd.get_model_state_dict(source, options=full)
    got = sd.get_model_state_dict(target, options=full)
    return {
        "keys": keys[0],
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "same": all(torch.equal(want[k], got[k]) for k in want),
    }


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_wrappers_own_state_dict_loads_as_with_torch_ddp(kind):
    for r in run_ranks(_wrapper_keys_body, WORLD, kind):
        assert r == {"keys": "module.0.bias", "missing": [], "unexpected": [], "same": True}


def _tensor_lr_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    source, source_optim = _trained(0, lr=torch.tensor(0.01))
    full = sd.StateDictOptions(full_state_dict=True)
    model_sd = sd.get_model_state_dict(source, options=full)
    optim_sd = sd.get_optimizer_state_dict(source, source_optim, options=full)
    target, optim = _trained(1, lr=torch.tensor(0.5))
    sd.set_state_dict(
        target,
        optim,
        model_state_dict=model_sd if rank == 0 else {},
        optim_state_dict=optim_sd if rank == 0 else {},
        options=sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    group = optim.param_groups[0]
    return {
        "lr": round(float(group["lr"]), 6),
        "lr_is_tensor": torch.is_tensor(group["lr"]),
        "betas": group["betas"],
        "moments": torch.equal(
            optim.state[target[0].weight]["exp_avg"],
            source_optim.state[source[0].weight]["exp_avg"],
        ),
    }


def test_broadcast_from_rank0_takes_tensor_hyperparameters():
    for r in run_ranks(_tensor_lr_body, WORLD):
        assert r == {"lr": 0.01, "lr_is_tensor": True, "betas": (0.9, 0.999), "moments": True}
