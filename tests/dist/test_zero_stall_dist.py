"""Zero-stall async_save on 2 ranks: plain (replicated), DDP and FSDP models step with a
large learning rate right after the call; each checkpoint holds the state at the call, bit
for bit. A change outside optimizer.step() on one rank fails the save on both."""

import threading

import pytest
import torch
from harness import run_ranks
from torch import nn

import shardkit.checkpoint as dist_cp
from shardkit.checkpoint._core._flatten import flatten
from shardkit.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 4 * d)
        self.b = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self, d=96):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 3)
        self.register_buffer("shift", torch.tensor([1.0, -1.0, 0.5]))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.shift


def _build(kind):
    torch.manual_seed(0)
    model = Net()
    if kind == "fsdp":
        from shardkit.fsdp import FSDP

        model = FSDP(model)
    elif kind == "ddp":
        from shardkit.ddp import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=1.0)


def _step(model, opt, seed):
    import torch.distributed as dist

    # a plain model is replicated: every rank must see the same batch to stay equal
    plain = isinstance(model, Net)
    g = torch.Generator().manual_seed(seed * 10 + (0 if plain else dist.get_rank()))
    opt.zero_grad()
    model(torch.randn(16, 8, generator=g)).square().mean().backward()
    opt.step()


def _state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _locals(sd):
    """This rank's piece of every tensor, cloned, by flattened key."""
    return {k: leaf.local.clone() for k, leaf in flatten(sd, for_save=True).tensors.items()}


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _save_while_stepping(kind, root):
    from shardkit.checkpoint._core._zero_stall import STATS

    model, opt = _build(kind)
    _step(model, opt, 0)
    staged = STATS.staged_saves
    mismatched = []
    for i in range(2):
        expected = _locals(_state(model, opt))
        path = f"{root}/{kind}-{i}"
        fut = dist_cp.async_save(_state(model, opt), checkpoint_id=path)
        opt.step()  # at once: the last gradients are still there
        for k in range(2):
            _step(model, opt, 10 * i + k + 1)
        fut.result(timeout=60)
        target = _state(model, opt)
        dist_cp.load(target, checkpoint_id=path)
        got = _locals(target)
        assert got.keys() == expected.keys()
        mismatched += [k for k in got if not torch.equal(_bits(got[k]), _bits(expected[k]))]
        moved = _locals(_state(model, opt))  # loading wrote the saved state back
        bad = [k for k in expected if not torch.equal(_bits(moved[k]), _bits(expected[k]))]
        assert not bad, bad
    return mismatched, STATS.staged_saves - staged


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp"])
def test_checkpoint_is_the_state_at_the_call_under_immediate_steps(tmp_path, kind):
    for mismatched, staged in run_ranks(_save_while_stepping, 2, kind, str(tmp_path)):
        assert mismatched == []
        assert staged == 2  # both saves staged in the background


def _change_outside_step(root):
    import torch.distributed as dist

    from shardkit.checkpoint._core import _async

    model, opt = _build("fsdp")
    _step(model, opt, 0)
    dist_cp.save(_state(model, opt), checkpoint_id=root)
    previous = _locals(_state(model, opt))
    gate, real = threading.Event(), _async.copy_into
    if dist.get_rank() == 0:  # rank 0 stages only after the change below

        def gated(dst, src):
            gate.wait()
            real(dst, src)

        _async.copy_into = gated
    try:
        fut = dist_cp.async_save(_state(model, opt), checkpoint_id=root)
        if dist.get_rank() == 0:
            with torch.no_grad():  # the shards the optimizer owns, outside step()
                for p in opt.param_groups[0]["params"]:
                    p.add_(1.0)
        gate.set()
        error = fut.exception(timeout=60)
    finally:
        gate.set()
        _async.copy_into = real
    target = _state(model, opt)
    dist_cp.load(target, checkpoint_id=root)
    got = _locals(target)
    intact = all(torch.equal(_bits(got[k]), _bits(previous[k])) for k in previous)
    return type(error).__name__, str(error), intact


def test_change_outside_step_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    (name0, msg0, intact0), (name1, msg1, intact1) = run_ranks(
        _change_outside_step, 2, str(tmp_path)
    )
    assert name0 == name1 == "CheckpointError"
    assert "'model." in msg0 and "was changed in place" in msg0
    assert "staging the checkpoint failed on rank(s) [0]" in msg1
    assert intact0 and intact1  # the previous checkpoint is still the committed one
