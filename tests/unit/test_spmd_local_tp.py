"""xs.shard_module(..., activations="local") in a world of one: what it refuses (before
changing anything), what it shards, and that the module computes what it did before."""

import numpy as np
import pytest
import torch
from torch import nn

import shardkit.spmd as xs


def _mesh(shape=(1,), names=("model",)):
    return xs.Mesh(np.arange(1), shape, names)


class Block(nn.Module):
    """Two column-parallel linears reading one input, a row-parallel one, a residual."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.gate = nn.Linear(8, 16)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8)

    def forward(self, ids):
        h = self.emb(ids)
        return h + self.down(torch.relu(self.gate(h)) * self.up(h))


PLAN = {
    "gate.weight": ("model", None),
    "up.weight": ("model", None),
    "down.weight": (None, "model"),
}


def test_local_shards_only_the_linears_and_computes_the_same():
    torch.manual_seed(0)
    ref = Block()
    model = xs.shard_module(Block(), _mesh(), PLAN, activations="local")
    model.load_state_dict({k: v for k, v in ref.state_dict().items()}, strict=True)
    specs = {n: getattr(p, "partition_spec", None) for n, p in model.named_parameters()}
    assert specs == {
        "emb.weight": None,
        "gate.weight": ("model", None),
        "gate.bias": ("model",),  # a column-parallel bias is split with its outputs
        "up.weight": ("model", None),
        "down.weight": (None, "model"),
        "down.bias": None,  # added once, after the row-parallel sum
    }
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids)
    assert type(out) is torch.Tensor  # plain activations all the way
    torch.testing.assert_close(out, ref(ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    "plan, match",
    [
        ({"emb.weight": ("model", None)}, "'emb.weight'.*only nn.Linear.*Embedding"),
        ({"down.weight": (None, "model"), "down.bias": ("model",)}, "'down.bias'.*column-par"),
    ],
)
def test_local_refuses_what_it_cannot_run_and_changes_nothing(plan, match):
    model = Block()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        xs.shard_module(model, _mesh(), plan, activations="local")
    assert {n: p for n, p in model.named_parameters()} == before
    assert "forward" not in model.gate.__dict__


def test_local_needs_a_one_dimensional_mesh_and_a_known_mode():
    with pytest.raises(ValueError, match=r"1-D mesh.*\(1, 1\)"):
        xs.shard_module(Block(), _mesh((1, 1), ("data", "model")), PLAN, activations="local")
    with pytest.raises(ValueError, match="activations must be one of"):
        xs.shard_module(Block(), _mesh(), PLAN, activations="megatron")


def test_row_parallel_takes_a_full_width_input_too():
    torch.manual_seed(0)
    lin = nn.Linear(16, 4)
    ref = nn.Linear(16, 4)
    ref.load_state_dict(lin.state_dict())
    holder = nn.Sequential(lin)
    xs.shard_module(holder, _mesh(), {"0.weight": (None, "model")}, activations="local")
    x = torch.randn(2, 16)
    torch.testing.assert_close(holder(x), ref(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="row-parallel.*got an input of 5 features"):
        holder(torch.randn(2, 5))
