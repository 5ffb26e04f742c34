"""Distributed checkpoints of FSDP models through shardkit.checkpoint and its state-dict
helpers, resharding in every direction, optimizer state included: FSDP on 4 ranks ->
FSDP on 2; FSDP on 4 -> a plain model in one process; a plain model -> FSDP on 2."""

import functools

import numpy as np
import torch
from harness import run_ranks
from torch import nn

import shardkit.checkpoint as dist_cp
from shardkit.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

FULL = StateDictOptions(full_state_dict=True)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 3 * d)
        self.b = nn.Linear(3 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList(Block(6) for _ in range(2))
        self.head = nn.Linear(6, 2)  # 2 rows: empty shards on ranks 2 and 3 of 4
        self.gate = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("shift", torch.tensor([1.0, -1.0]))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.gate * self.head(h) + self.shift


def _build(seed, fsdp):
    torch.manual_seed(seed)
    model = Net()
    if fsdp:
        from shardkit.fsdp import FSDP
        from shardkit.fsdp.wrap import transformer_auto_wrap_policy

        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={Block}
            ),
        )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, opt, steps, world=1, rank=0):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g).chunk(world)[rank]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _full_numpy(model, opt):
    model_sd = get_model_state_dict(model, options=FULL)
    optim_sd = get_optimizer_state_dict(model, opt, options=FULL)
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for k, v in state.items():
            out[f"optim.{fqn}.{k}"] = np.asarray(v.detach().numpy() if torch.is_tensor(v) else v)
    return out


def _state(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _load_into(model, opt, path):
    state = _state(model, opt)
    dist_cp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def _save_on_4(path):
    import torch.distributed as dist

    model, opt = _build(0, fsdp=True)
    _train(model, opt, 2, dist.get_world_size(), dist.get_rank())
    state = _state(model, opt)
    assert type(state["model"]["blocks.0.a.weight"]).__name__ == "ShardedTensor"
    dist_cp.save(state, checkpoint_id=path)
    return _full_numpy(model, opt)


def _load_on_2(fsdp_path, plain_path):
    out = {}
    for name, path in (("fsdp", fsdp_path), ("plain", plain_path)):
        model, opt = _build(7, fsdp=True)  # other weights, fresh optimizer
        _load_into(model, opt, path)
        out[name] = _full_numpy(model, opt)
    return out


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_fsdp_checkpoints_reshard_every_way(tmp_path):
    fsdp_path, plain_path = str(tmp_path / "fsdp4"), str(tmp_path / "plain")
    # a plain model's checkpoint, written by one process
    plain, plain_opt = _build(1, fsdp=False)
    _train(plain, plain_opt, 3)
    dist_cp.save(_state(plain, plain_opt), checkpoint_id=plain_path)
    plain_ref = _full_numpy(plain, plain_opt)

    fsdp_ref = run_ranks(_save_on_4, 4, fsdp_path, timeout=180)
    for other in fsdp_ref[1:]:
        _assert_same(other, fsdp_ref[0])
    fsdp_ref = fsdp_ref[0]
    assert "optim.blocks.1.b.weight.exp_avg_sq" in fsdp_ref

    # FSDP on 4 ranks -> FSDP on 2; a plain model -> FSDP on 2
    for loaded in run_ranks(_load_on_2, 2, fsdp_path, plain_path, timeout=180):
        _assert_same(loaded["fsdp"], fsdp_ref)
        _assert_same(loaded["plain"], plain_ref)

    # FSDP on 4 ranks -> a plain model in this process
    model, opt = _build(9, fsdp=False)
    _load_into(model, opt, fsdp_path)
    _assert_same(_full_numpy(model, opt), fsdp_ref)
