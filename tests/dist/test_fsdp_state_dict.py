"""FSDP's own ``model.state_dict()`` / ``optim.state_dict()`` through every save path.

The seed's CheckpointManager flow, ``{'model': model.state_dict(), 'optim':
optim.state_dict()}``, saved on 2 ranks restores bit-exactly on 2, 1 and 3 ranks; the
same state dicts saved per rank with ``torch.save`` (torch_xla's file names) consolidate, from
the files and in memory, and reload on the same ranks."""

import functools

import numpy as np
import pytest
import torch
from fsdp_models import Block
from harness import run_ranks
from torch import nn

STEP = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)  # 7 rows: uneven over 2 and 3 ranks
        self.blocks = nn.ModuleList(Block(7) for _ in range(2))
        self.head = nn.Linear(7, 2)  # 2 rows: rank 2 of 3 holds none
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-d: replicated

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.gate * self.head(h)


def _build(seed):
    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    torch.manual_seed(seed)
    model = FSDP(
        Net(),
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _np(value):
    """Tensors as numpy arrays (results travel back from the ranks by pickle)."""
    if isinstance(value, torch.Tensor):
        return value.detach().numpy().copy()
    if isinstance(value, dict):
        return {k: _np(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_np(v) for v in value]
    return value


def _full(model, optim):
    """Full parameters and full optimizer state, keyed by the unwrapped names."""
    from shardkit.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    params = {k: v.full_tensor() for k, v in model._shardkit_sharded_state_dict().items()}
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    return _np(params), _np(osd)


def _save_body(root):
    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointManager
    from shardkit.fsdp import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts
    from shardkit.spmd import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = _build(0)
    for step in range(STEP):
        g = torch.Generator().manual_seed(100 * step + rank)
        optim.zero_grad()
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    kinds = {k: isinstance(v, ShardedTensor) for k, v in state["model"].items()}
    assert kinds["module.inp.weight"] and not kinds["module.gate"], kinds
    index = [id(p) for p in model.parameters()].index(id(model.module.inp.weight))
    moment = state["optim"]["state"][index]["exp_avg"]
    assert isinstance(moment, ShardedTensor) and moment.shape == (7, 5)
    # the optimizer's own state stays plain
    assert not any(isinstance(v, ShardedTensor) for s in optim.state.values() for v in s.values())
    with CheckpointManager(f"{root}/mgr", save_interval=1) as mgr:
        assert mgr.save(STEP, state)
    # per-rank torch.save, torch_xla's names: plain local rows, weights_only loadable
    torch.save(
        {
            "model": model.state_dict(),
            "shard_metadata": model.get_shard_metadata(),
            "optimizer": optim.state_dict(),
        },
        f"{root}/rank-{rank}-of-{world}.pth",
    )
    dist.barrier()
    out = {"full": _full(model, optim)}
    ckpt = torch.load(f"{root}/rank-{rank}-of-{world}.pth", weights_only=True)
    assert type(ckpt["model"]["module.inp.weight"]) is torch.Tensor
    assert ckpt["model"]["module.inp.weight"].shape[0] == (4 if rank == 0 else 3)
    model2, optim2 = _build(7)
    model2(torch.randn(2, 5)).sum().backward()  # give optim2 state (hooks) by a step
    optim2.step()
    model2.load_state_dict(ckpt["model"])
    optim2.load_state_dict(ckpt["optimizer"])
    out["per_rank"] = _full(model2, optim2)
    if rank == 0:
        full, path = consolidate_sharded_model_checkpoints(
            f"{root}/", "rank-*-of-*.pth", save_model=False
        )
        out["consolidated"], out["consolidated_path"] = _np(full), path
        # the same in memory, with the last rank's shard metadata
        ckpts = [torch.load(f"{root}/rank-{r}-of-{world}.pth", weights_only=True) for r in (0, 1)]
        merged = consolidate_sharded_state_dicts(
            [c["model"] for c in ckpts], ckpts[-1]["shard_metadata"]
        )
        out["merged_in_memory"] = _np(merged)
    return out


def _restore_body(root):
    from shardkit.checkpoint import CheckpointManager, prime_optimizer

    model, optim = _build(1)  # other weights: everything must come from the checkpoint
    prime_optimizer(optim)
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    with CheckpointManager(f"{root}/mgr", save_interval=1) as mgr:
        assert mgr.latest_step() == STEP
        mgr.restore(STEP, state)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    restored = _full(model, optim)
    optim.zero_grad()  # and training goes on
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    return restored


def _assert_same(got, want):
    (gp, go), (wp, wo) = got, want
    assert list(gp) == list(wp)
    for k in wp:
        assert np.array_equal(gp[k], wp[k]), k
    assert go["param_groups"] == wo["param_groups"]
    assert list(go["state"]) == list(wo["state"])
    for name, entry in wo["state"].items():
        for k, v in entry.items():
            assert np.array_equal(go["state"][name][k], v), (name, k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp_sd"))
    return root, run_ranks(_save_body, 2, root, timeout=120)


def test_per_rank_torch_save_consolidates_and_reloads(saved):
    _root, results = saved
    for res in results:
        _assert_same(res["per_rank"], res["full"])
    params = results[0]["full"][0]
    assert results[0]["consolidated_path"] is None
    for consolidated in (results[0]["consolidated"], results[0]["merged_in_memory"]):
        assert list(consolidated) == list(params)
        for k, v in params.items():
            assert np.array_equal(consolidated[k], v), k


@pytest.mark.parametrize("world", [2, 1, 3])
def test_manager_flow_restores_bit_exactly(saved, world):
    root, results = saved
    want = results[0]["full"]
    for got in run_ranks(_restore_body, world, root, timeout=120):
        _assert_same(got, want)
