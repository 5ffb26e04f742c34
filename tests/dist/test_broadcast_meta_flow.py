"""Issue 21's meta-device flow on 2 ranks: shardkit FSDP built on meta with
``param_init_fn`` -> train -> save -> rank 0 reads the checkpoint as a full state dict ->
``set_model_state_dict(broadcast_from_rank0=True)`` into a fresh meta FSDP model."""

from harness import run_ranks


def _build():
    from torch import nn

    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _init(module):
    module.to_empty(device="cpu")
    for sub in module.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()


def _flow(path):
    import torch
    import torch.distributed as dist

    import shardkit.checkpoint as dcp
    import shardkit.fsdp as fsdp
    from shardkit.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    torch.manual_seed(0)
    with torch.device("meta"):
        model = fsdp.FullyShardedDataParallel(_build(), param_init_fn=_init)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(3, 4, generator=gen)).sum().backward()
        optim.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    full = {}
    if dist.get_rank() == 0:  # only rank 0 reads the checkpoint, into a plain model's dict
        full = {"model": _build().state_dict()}
        dcp.load(full, checkpoint_id=path, no_dist=True)
        full = full["model"]
    with torch.device("meta"):
        fresh = fsdp.FullyShardedDataParallel(
            _build(), param_init_fn=lambda m: m.to_empty(device="cpu")
        )
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(fresh, full, options=opts)
    got = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    assert list(got) == list(trained)
    return all(torch.equal(got[k], trained[k]) for k in trained)


def test_meta_fsdp_train_save_broadcast_load(tmp_path):
    assert run_ranks(_flow, 2, str(tmp_path / "ckpt"), timeout=90) == [True, True]
