"""End to end across world sizes: an FSDP2 model's FQN-keyed state (model + Adam)
saved on 2 ranks loads on 3 (FSDP2, uneven shards) and on 1 (plain model); a checkpoint
written by torch.distributed.checkpoint on 2 ranks imports and loads into a plain model."""

import io

import torch
from harness import run_ranks
from torch import nn


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))


def _pack(obj):
    """Tensors sent back through the harness pipe would be shared by file descriptor, which
    dies with the rank; send bytes instead."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(raw):
    return torch.load(io.BytesIO(raw), weights_only=True)


def _fsdp2(seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _net(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, optim):
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().sum().backward()
        optim.step()


def _save_on_two(root):
    import torch.distributed.checkpoint as tdcp

    import shardkit.checkpoint as dist_cp
    from shardkit.checkpoint.format_utils import import_torch_dcp
    from shardkit.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = _fsdp2(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optim)
    msd, osd = get_state_dict(model, optim)
    dist_cp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/shardkit")
    tdcp.save({"model": model.state_dict(), "epoch": 4}, checkpoint_id=f"{root}/torch_dcp")
    import_torch_dcp(f"{root}/torch_dcp", f"{root}/imported", progress=False)  # every rank alike
    return _pack(get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)))


def _load_on_three(root):
    import shardkit.checkpoint as dist_cp
    from shardkit.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model = _fsdp2(1)
    optim = torch.optim.Adam(model.parameters(), lr=0.9)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dist_cp.load(state, checkpoint_id=f"{root}/shardkit")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _pack(get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)))


def _load_on_one(root):
    import shardkit.checkpoint as dist_cp
    from shardkit.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _net(2)
    optim = torch.optim.Adam(model.parameters(), lr=0.9)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dist_cp.load(state, checkpoint_id=f"{root}/shardkit")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restored = get_state_dict(model, optim)

    migrated = _net(3)
    imported = {"model": migrated.state_dict(), "epoch": 0}
    dist_cp.load(imported, checkpoint_id=f"{root}/imported")
    migrated.load_state_dict(imported["model"])
    return _pack((restored, migrated.state_dict(), imported["epoch"]))


def _assert_same(a, b, where):
    assert list(a) == list(b), (where, list(a), list(b))
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k], f"{where}.{k}")
        elif torch.is_tensor(a[k]):
            assert type(b[k]) is torch.Tensor and torch.equal(a[k], b[k]), (where, k)
        else:
            assert a[k] == b[k], (where, k)


def test_save_on_two_load_on_three_and_one_and_import_torch_dcp(tmp_path):
    root = str(tmp_path)
    (msd, osd) = _unpack(run_ranks(_save_on_two, 2, root, timeout=120)[0])
    for raw in run_ranks(_load_on_three, 3, root, timeout=120):
        got_msd, got_osd = _unpack(raw)
        _assert_same(got_msd, msd, "3-rank model")
        _assert_same(got_osd["state"], osd["state"], "3-rank optim")
        assert got_osd["param_groups"] == osd["param_groups"]
    (restored_msd, restored_osd), migrated, epoch = _unpack(run_ranks(_load_on_one, 1, root)[0])
    _assert_same(restored_msd, msd, "1-rank model")
    _assert_same(restored_osd["state"], osd["state"], "1-rank optim")
    assert restored_osd["param_groups"] == osd["param_groups"]
    _assert_same(migrated, msd, "imported torch DCP")
    assert epoch == 4
