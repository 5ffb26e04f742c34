"""``shard_module(..., activations="local")`` on 2 ranks: a toy block with biases trains
like one process with exactly one all-reduce per row-parallel layer forward and one per
shared column-parallel input backward, and its checkpoint loads into the plain model."""

import pytest
from harness import run_ranks


def _block():
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(8, 12)
            self.up = nn.Linear(8, 12, bias=False)
            self.down = nn.Linear(12, 8)

        def forward(self, h):
            return self.down(torch.relu(self.gate(h)) * self.up(h))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.mlp = MLP()
            self.head = nn.Linear(8, 16)

        def forward(self, ids, recompute=False):
            h = self.emb(ids)
            if recompute:  # reentrant checkpointing: mlp's forward runs again in backward,
                # alone, and backward goes through that second graph (as HF's default does)
                return self.head(h + checkpoint(self.mlp, h, use_reentrant=True))
            return self.head(h + self.mlp(h))

    torch.manual_seed(0)
    return Block()


PLAN = {
    "mlp.gate.weight": ("model", None),
    "mlp.up.weight": ("model", None),
    "mlp.down.weight": (None, "model"),
}


def _train(path):
    import copy

    import numpy as np
    import torch
    import torch.nn.functional as F

    import shardkit.checkpoint as dist_cp
    import shardkit.runtime as xr
    import shardkit.spmd as xs

    ref = _block()
    mesh = xs.Mesh(np.arange(xr.world_size()), (xr.world_size(),), ("model",))
    model = xs.shard_module(copy.deepcopy(ref), mesh, PLAN, activations="local")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    out = {"loss_err": [], "calls": []}
    for i in range(4):
        losses = []
        for m, opt in zip((ref, model), opts):
            with xs.count_collectives() as counts:
                loss = F.cross_entropy(m(ids, recompute=i == 3).flatten(0, 1), ids.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out["calls"].append(dict(counts.calls))
        out["loss_err"].append(abs(losses[0] - losses[1]))
    out["local_rows"] = tuple(model.mlp.gate.weight.local_tensor().shape)
    out["bias_rows"] = tuple(model.mlp.gate.bias.local_tensor().shape)
    # a column-parallel layer called outside the module's forward shares nothing
    x = torch.randn(2, 8, requires_grad=True)
    with xs.count_collectives() as alone:
        (model.mlp.gate(x).sum() + model.mlp.up(x).sum()).backward()
    out["alone"] = dict(alone.calls)
    out["x_grad_err"] = float(
        (x.grad - (ref.mlp.gate.weight.sum(0) + ref.mlp.up.weight.sum(0)).detach()).abs().max()
    )
    dist_cp.save(model.state_dict(), checkpoint_id=path)
    out["params"] = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    return out


def _load(path):
    import shardkit.checkpoint as dist_cp

    plain = _block()
    state = plain.state_dict()
    dist_cp.load(state, checkpoint_id=path)
    return {n: t.numpy().copy() for n, t in state.items()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("local_tp") / "ckpt")
    return run_ranks(_train, 2, path), run_ranks(_load, 1, path)[0]


def test_local_block_trains_like_one_process(trained):
    results, _ = trained
    for r in results:
        assert max(r["loss_err"]) < 1e-6, r["loss_err"]
        assert r["local_rows"] == (6, 8) and r["bias_rows"] == (6,)


def test_collectives_are_one_per_row_layer_and_one_per_shared_input(trained):
    results, _ = trained
    for r in results:
        # forward: down's output; backward: the input gradient that gate and up share,
        # also when checkpointing reruns mlp's forward alone in backward (which then adds
        # down's all-reduce once more)
        assert r["calls"] == [{("all_reduce", ("model",)): n} for n in (2, 2, 2, 3)]
        # called one by one outside the module's forward: one all-reduce each
        assert r["alone"] == {("all_reduce", ("model",)): 2}
        assert r["x_grad_err"] < 1e-5


def test_checkpoint_of_local_activations_loads_into_the_plain_model(trained):
    results, loaded = trained
    import numpy as np

    assert sorted(loaded) == sorted(results[0]["params"])
    for name, ref in results[0]["params"].items():
        np.testing.assert_allclose(loaded[name], ref, rtol=0, atol=1e-6, err_msg=name)
