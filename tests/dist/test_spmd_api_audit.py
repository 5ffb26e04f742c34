"""The SPMD API around the ops, found side by side with DTensor (2026-11-29):

- ``torch.equal`` of two same-layout ShardedTensors compared only each rank's rows, so
  the ranks answered differently;
- backward through ``local_tensor()`` of a pending sum counted the gradient once per
  rank (2x on 2 ranks);
- ``emb.weight[idx] = 0`` re-laid out a vocabulary-sharded weight as replicated;
- ``mark_sharding`` of a sharded tensor with another spec moved data without a word,
  where the docs (and torch_xla) refuse;
- ``p.grad`` came back as a pending sum or in another layout for leaves made by
  ``requires_grad_()`` or by deep-copying a sharded module.
"""

import copy

import numpy as np
import pytest
import torch
from harness import run_ranks

import shardkit.spmd as xs

pytestmark = pytest.mark.timeout(180)
WORLD = 2


def _mesh(name="x"):
    return xs.Mesh(np.arange(WORLD), (WORLD,), (name,))


def _equal_body():
    mesh = _mesh()
    g = torch.arange(20.0).reshape(5, 4)
    h = g.clone()
    h[4, 3] += 1  # only the last rank's rows differ
    a, b = xs.mark_sharding(g, mesh, ("x", None)), xs.mark_sharding(h, mesh, ("x", None))
    return [torch.equal(a, b), torch.equal(a, a.clone()), a.equal(b)]


def test_torch_equal_compares_whole_tensors_on_every_rank():
    assert run_ranks(_equal_body, WORLD) == [[False, True, False]] * WORLD


def _local_tensor_grad_body():
    mesh = _mesh("data")
    st = xs.mark_sharding(torch.ones(6, 4), mesh, ("data", None)).requires_grad_()
    pending = st.sum(0)
    pending.local_tensor().sum().backward()  # each rank backpropagates its addend
    return [bool(pending.placement.partial), st.grad.full_tensor().unique().tolist()]


def test_backward_through_the_addend_of_a_pending_sum_counts_it_once():
    # as DTensor's to_local(): the addend's gradient is the sum's, replicated
    assert run_ranks(_local_tensor_grad_body, WORLD) == [[True, [1.0]]] * WORLD


def _index_put_body():
    mesh = _mesh("model")
    torch.manual_seed(0)
    emb = xs.shard_module(torch.nn.Embedding(10, 3), mesh, {"weight": ("model", None)})
    want = emb.weight.full_tensor().detach().clone()
    want[[0, 9]] = 0.0
    weight = emb.weight
    with torch.no_grad():
        weight[torch.tensor([0, 9])] = 0.0  # e.g. the pad row, after sharding
        weight.index_put_((torch.tensor([3]),), torch.ones(3), accumulate=True)
    want[3] += 1.0
    return {
        "spec": weight.partition_spec,
        "local_rows": weight.local_tensor().shape[0],
        "same_object": emb.weight is weight,
        "values": torch.equal(weight.full_tensor().detach(), want),
    }


def test_in_place_index_assignment_keeps_the_layout():
    for r in run_ranks(_index_put_body, WORLD):
        assert r == {"spec": ("model", None), "local_rows": 5, "same_object": True, "values": True}


def _mark_again_body():
    mesh = _mesh()
    st = xs.mark_sharding(torch.ones(4, 2), mesh, ("x", None))
    same = xs.mark_sharding(st, mesh, ("x", None)) is st
    try:
        xs.mark_sharding(st, mesh, (None, "x"))
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"same": same, "error": error}


def test_mark_sharding_refuses_to_reshard_a_sharded_tensor():
    for r in run_ranks(_mark_again_body, WORLD):
        assert r["same"], r
        assert "already sharded as ('x', None)" in r["error"], r
        assert "st.redistribute(spec)" in r["error"], r


def _grad_placement_body():
    mesh = _mesh("data")
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    out = {}
    leaves = {
        "mark_sharding(t).requires_grad_()": xs.mark_sharding(
            torch.randn(6, 5), mesh, ("data", None)
        ).requires_grad_(),
        "from_local(t).requires_grad_()": xs.ShardedTensor.from_local(
            torch.randn(3, 5), mesh, ("data", None), (6, 5)
        ).requires_grad_(),
    }
    lin = torch.nn.Linear(5, 3)
    xs.shard_module(lin, mesh, {"weight": ("data", None)})
    twin = copy.deepcopy(lin)  # an EMA or teacher copy
    leaves["deepcopy: weight"], leaves["deepcopy: bias"] = twin.weight, twin.bias
    for name, leaf in leaves.items():
        if name.startswith("deepcopy"):
            continue
        (xs.mark_sharding(x, mesh, ("data", None)) @ leaf.t()).sum().backward()
    twin(xs.mark_sharding(x, mesh, ("data", None))).sum().backward()
    for name, leaf in leaves.items():
        grad = leaf.grad
        out[name] = grad.placement == leaf.placement and not grad.placement.partial
    return out


def test_every_sharded_leaf_gets_its_gradient_in_its_own_layout():
    for r in run_ranks(_grad_placement_body, WORLD):
        assert all(r.values()), r
