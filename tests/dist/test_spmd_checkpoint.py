"""SPMD checkpointing: a tensor-parallel block (2x2 mesh) saves through shardkit.checkpoint
and CheckpointManager with the SPMD planners, and restores onto other meshes and layouts
(a 1x4 mesh with the model axis reversed, and SpmdFullyShardedDataParallel on 'fsdp').
"""

import pathlib

import pytest
from harness import run_ranks

EXAMPLES = str(pathlib.Path(__file__).resolve().parents[2] / "examples")


def _full(state):
    import shardkit.spmd as xs

    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            for kk, vv in _full(v).items():
                out[f"{k}.{kk}"] = vv
        elif isinstance(v, xs.ShardedTensor):
            out[k] = v.full_tensor().detach().clone()
        elif hasattr(v, "clone"):
            out[k] = v.detach().clone()
    return out


def _save_then_reshard(examples_dir, root):
    import sys

    import numpy as np
    import torch
    import torch.nn.functional as F

    import shardkit.checkpoint as dist_cp
    import shardkit.spmd as xs
    from shardkit.checkpoint.state_dict import get_state_dict, set_state_dict

    sys.path.insert(0, examples_dir)
    import spmd_tensor_parallel as tp

    def trained(block, mesh, spec_in, opt=None):
        opt = opt or torch.optim.AdamW(block.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(4)
        x, y = torch.randn(4, 6, 32, generator=gen), torch.randn(4, 6, 32, generator=gen)
        loss = F.mse_loss(
            block(xs.mark_sharding(x, mesh, spec_in)), xs.mark_sharding(y, mesh, spec_in)
        )
        loss.full_tensor().backward()
        opt.step()
        opt.zero_grad()
        return opt

    mesh_a = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
    torch.manual_seed(0)
    block = tp.shard_block(tp.Block(32), mesh_a)
    opt = trained(block, mesh_a, ("data", None, None))
    model_sd, optim_sd = get_state_dict(block, opt)
    state = {"model": model_sd, "optim": optim_sd}
    expected = _full(state)
    dist_cp.save(state, checkpoint_id=f"{root}/plain", planner=dist_cp.SPMDSavePlanner())
    mgr = dist_cp.CheckpointManager(f"{root}/managed", save_interval=1)
    mgr.save(1, state)
    mgr.join()

    def fresh(wrap):
        torch.manual_seed(1)  # different weights: the load must overwrite every value
        model = wrap(tp.Block(32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dist_cp.prime_optimizer(opt)
        m, o = get_state_dict(model, opt)
        return model, opt, {"model": m, "optim": o}

    results = {}
    # 1. plain load onto a 1x4 mesh, model axis over 4 ranks in reversed order
    mesh_b = xs.Mesh(np.arange(4)[::-1].copy(), (1, 4), ("data", "model"))
    model_b, opt_b, state_b = fresh(lambda m: tp.shard_block(m, mesh_b))
    dist_cp.load(state_b, checkpoint_id=f"{root}/plain", planner=dist_cp.SPMDLoadPlanner())
    set_state_dict(
        model_b, opt_b, model_state_dict=state_b["model"], optim_state_dict=state_b["optim"]
    )
    got = _full(
        {"model": get_state_dict(model_b, opt_b)[0], "optim": get_state_dict(model_b, opt_b)[1]}
    )
    results["mesh_1x4"] = (
        sorted(got) == sorted(expected),
        max(float((got[k] - expected[k]).abs().max()) for k in expected),
    )
    results["mesh_1x4_spec"] = model_b.q.weight.partition_spec
    # 2. CheckpointManager restore into SpmdFullyShardedDataParallel on a 1-D 'fsdp' mesh
    mesh_c = xs.Mesh(np.arange(4), (4,), ("fsdp",))
    model_c, opt_c, state_c = fresh(lambda m: xs.SpmdFullyShardedDataParallel(m, mesh_c))
    dist_cp.CheckpointManager(f"{root}/managed", save_interval=1).restore(1, state_c)
    set_state_dict(
        model_c, opt_c, model_state_dict=state_c["model"], optim_state_dict=state_c["optim"]
    )
    got = _full(
        {"model": get_state_dict(model_c, opt_c)[0], "optim": get_state_dict(model_c, opt_c)[1]}
    )
    results["fsdp"] = (
        sorted(got) == sorted(expected),
        max(float((got[k] - expected[k]).abs().max()) for k in expected),
    )
    results["fsdp_spec"] = model_c.module.q.weight.partition_spec
    # 3. restored onto the saving layout, training continues bit for bit (resharded
    # copies differ only by summation order, which AdamW's normalisation amplifies)
    model_d, opt_d, state_d = fresh(lambda m: tp.shard_block(m, mesh_a))
    dist_cp.load(state_d, checkpoint_id=f"{root}/plain", planner=dist_cp.SPMDLoadPlanner())
    set_state_dict(
        model_d, opt_d, model_state_dict=state_d["model"], optim_state_dict=state_d["optim"]
    )
    cont_a = trained(block, mesh_a, ("data", None, None), opt)
    cont_d = trained(model_d, mesh_a, ("data", None, None), opt_d)
    del cont_a, cont_d
    results["continued"] = max(
        float((p.full_tensor() - q.full_tensor()).abs().max())
        for p, q in zip(block.parameters(), model_d.parameters())
    )
    results["num_keys"] = len(expected)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("spmd_ckpt"))
    out = run_ranks(_save_then_reshard, 4, EXAMPLES, root, timeout=180)
    return out[0]


def test_reshards_onto_another_mesh(results):
    same_keys, err = results["mesh_1x4"]
    assert same_keys and err == 0.0
    assert results["mesh_1x4_spec"] == ("model", None)
    assert results["num_keys"] > 20  # parameters and Adam state were both saved


def test_manager_restores_into_spmd_fsdp(results):
    same_keys, err = results["fsdp"]
    assert same_keys and err == 0.0
    assert results["fsdp_spec"] == ("fsdp", None)


def test_training_continues_identically_after_restore(results):
    assert results["continued"] == 0.0
