"""What an async save holds when training changes the state right after the call (race
audit, 2026-11-29): each case committed the changed values with no error.

- a zero-stall save of SPMD parameters missed writes to a parameter's own shard
  (``p.local_tensor().add_()``, ``p[0] = 0``): only the wrapper's and the saved alias's
  version counters were watched;
- the copy-in-the-call path copied tensors but not the state dict's lists and dicts;
- the zero-stall path copied dicts and lists but not a tuple holding a list;
- pickled values were pickled on the background thread, after training went on.
"""

import numpy as np
import pytest
import torch
from harness import run_ranks
from torch import nn

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointError, DefaultLoadPlanner, DefaultSavePlanner

pytestmark = pytest.mark.timeout(180)


def _spmd_local_write_body(root, how):
    import shardkit.spmd as xs

    world = torch.distributed.get_world_size()
    mesh = xs.Mesh(np.arange(world), (world,), ("d",))
    torch.manual_seed(0)
    model = xs.shard_module(nn.Linear(4, 6), mesh, {"weight": ("d", None)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # the optimizer owns the weight: the save stages in the background
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=root)
    with torch.no_grad():
        if how == "local_tensor":
            model.weight.local_tensor().add_(100.0)
        else:
            model.weight[0] = 0.0
    try:
        future.result()
    except CheckpointError as exc:
        return "refused" if "changed in place after the save was called" in str(exc) else str(exc)
    return "committed"


@pytest.mark.parametrize("how", ["local_tensor", "setitem"])
def test_a_write_to_a_sharded_parameters_own_shard_is_refused(tmp_path, how):
    assert run_ranks(_spmd_local_write_body, 2, str(tmp_path / "ck"), how) == ["refused"] * 2
    assert not dcp.is_committed(tmp_path / "ck")


def _trained():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("zero_stall", [True, False])
def test_values_are_taken_at_the_call(tmp_path, zero_stall):
    model, opt = _trained()
    seen, pair = [1, 2, 3], (1, [2, 3])
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    state["meta"] = {"seen": seen, "pair": pair, "tags": {"a"}}
    future = dcp.async_save(
        state,
        checkpoint_id=tmp_path,
        planner=DefaultSavePlanner(allow_pickle=True),  # the set is pickled
        zero_stall=zero_stall,
    )
    seen.append(4)
    pair[1].append(99)
    state["meta"]["tags"].add("b")
    future.result()
    out = {"meta": {"seen": [], "pair": (), "tags": set()}}
    dcp.load(out, checkpoint_id=tmp_path, planner=DefaultLoadPlanner(allow_pickle=True))
    assert out["meta"] == {"seen": [1, 2, 3], "pair": (1, [2, 3]), "tags": {"a"}}
