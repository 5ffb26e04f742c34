"""xs.shard_module (plan helper) and the fallback log, in a world of one."""

import logging
import re

import numpy as np
import pytest
import torch
from torch import nn

import shardkit.spmd as xs
from shardkit.spmd import _dispatch

aten = torch.ops.aten


def _mesh():
    return xs.Mesh(np.arange(1), (1,), ("model",))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.proj(self.wte(ids)))


def test_tied_weight_stays_one_sharded_parameter():
    model = xs.shard_module(Tied(), _mesh(), {"wte.weight": ("model", None)})
    assert model.head.weight is model.wte.weight
    assert isinstance(model.wte.weight, xs.ShardedTensor)
    assert isinstance(model.wte.weight, nn.Parameter)
    assert model.wte.weight.partition_spec == ("model", None)
    # every other parameter is replicated, and the shared one is named once
    assert [n for n, _ in model.named_parameters()] == ["wte.weight", "proj.weight", "proj.bias"]
    assert model.proj.weight.partition_spec == (None, None)


def test_tied_weight_can_be_named_by_either_owner():
    model = xs.shard_module(Tied(), _mesh(), {"head.weight": ("model", None)})
    assert model.head.weight is model.wte.weight
    assert model.wte.weight.partition_spec == ("model", None)


def test_tied_weight_with_conflicting_specs_is_refused():
    with pytest.raises(ValueError, match="tied parameter"):
        xs.shard_module(
            Tied(), _mesh(), {"wte.weight": ("model", None), "head.weight": (None, "model")}
        )


def test_first_matching_pattern_wins():
    model = xs.shard_module(
        Tied(), _mesh(), {"proj.weight": (None, "model"), "*.weight": ("model", None)}
    )
    assert model.proj.weight.partition_spec == (None, "model")
    assert model.wte.weight.partition_spec == ("model", None)


def test_unmatched_pattern_is_an_error_unless_not_strict():
    with pytest.raises(ValueError, match=re.escape("['*.q_proj.weight'] match no parameter")):
        xs.shard_module(Tied(), _mesh(), {"*.q_proj.weight": ("model", None)})
    xs.shard_module(Tied(), _mesh(), {"*.q_proj.weight": ("model", None)}, strict=False)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        xs.shard_module(lambda x: x, _mesh(), {})
    with pytest.raises(TypeError, match="plan must map"):
        xs.shard_module(Tied(), _mesh(), [("wte.weight", ("model", None))])
    with pytest.raises(ValueError):  # spec of the wrong length
        xs.shard_module(Tied(), _mesh(), {"proj.bias": ("model", None)})


def test_sharding_twice_is_refused_with_another_spec_and_a_no_op_with_the_same():
    model = xs.shard_module(Tied(), _mesh(), {"wte.weight": ("model", None)})
    weight = model.wte.weight
    xs.shard_module(model, _mesh(), {"wte.weight": ("model", None)})
    assert model.wte.weight is weight
    with pytest.raises(ValueError, match="already sharded"):
        xs.shard_module(model, _mesh(), {"wte.weight": (None, "model")})


def test_sharded_module_trains_like_the_original_and_keeps_the_tie():
    torch.manual_seed(0)
    ref = Tied()
    model = xs.shard_module(Tied(), _mesh(), {"wte.weight": ("model", None)})
    model.load_state_dict({k: v for k, v in ref.state_dict().items()}, strict=False)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            p.copy_(q)
    ids = torch.tensor([[1, 2, 3], [4, 5, 9]])
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        for _ in range(2):
            loss = m(ids).square().mean()
            xs.clear_sharding(loss).backward()
            opt.step()
            opt.zero_grad()
    assert model.head.weight is model.wte.weight
    out, expected = xs.clear_sharding(model(ids)), ref(ids)
    assert torch.allclose(out, expected, atol=1e-6)


def test_new_rules_are_registered():
    for op in (
        aten.constant_pad_nd.default,
        aten.index.Tensor,
        aten.all.default,
        aten.any.dim,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ):
        assert _dispatch._rule_for(op) is not None, op


def test_a_declined_rule_is_logged_as_declined_with_its_reason(caplog):
    mesh = xs.Mesh(np.arange(1), (1, 1), ("data", "model"))
    q = xs.mark_sharding(torch.randn(1, 2, 3, 4), mesh, ("data", "model", None, None))
    xs.reset_fallback_counts()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="shardkit.spmd"):
        picked = q[torch.ones(1, 2, 3, 4, dtype=torch.bool)]
        torch.unique(q)
    assert torch.equal(xs.clear_sharding(picked), xs.clear_sharding(q).reshape(-1))
    messages = [r.getMessage() for r in caplog.records]
    assert any("index" in m and "declined: boolean mask" in m for m in messages), messages
    assert any("_unique2" in m and "has no sharding rule" in m for m in messages), messages
    assert xs.fallback_counts() == {"index": 1, "_unique2": 1}


def test_folded_tensor_refuses_redistribute_with_the_fix():
    from shardkit.spmd._rules import _fold

    mesh = xs.Mesh(np.arange(1), (1,), ("model",))
    x = xs.mark_sharding(torch.randn(2, 4, 3), mesh, (None, "model", None))
    folded = _fold.try_fold(x, (8, 3))
    assert isinstance(folded, _fold.Folded)
    assert torch.equal(folded.full_tensor(), xs.clear_sharding(x).reshape(8, 3))
    with pytest.raises(ValueError, match=r"view\(\)"):
        folded.redistribute(("model", None))
