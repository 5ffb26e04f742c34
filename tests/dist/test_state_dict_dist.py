"""State-dict helpers on 2 real ranks: torch DDP, torch FSDP2 (fully_shard on gloo),
ShardedTensor parameters, the shardkit sharded-module protocol and shardkit FSDP/DDP, against torch's
``torch.distributed.checkpoint.state_dict`` as the oracle. One launch for all checks."""

import copy
import warnings

import torch
from harness import run_ranks
from torch import nn

WORLD = 2


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))


def _train(model, optim, steps=2, seed=7):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=gen)).square().sum().backward()
        optim.step()


def _same(a, b, where):
    from torch.distributed.tensor import DTensor

    assert list(a) == list(b), (where, list(a), list(b))
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            _same(x, y, f"{where}.{k}")
        elif isinstance(x, DTensor):
            assert isinstance(y, DTensor) and x.placements == y.placements, (where, k)
            assert torch.equal(x.to_local(), y.to_local()), (where, k)
        elif torch.is_tensor(x):
            assert type(x) is type(y) and torch.equal(x, y), (where, k, type(x), type(y))
        else:
            assert x == y, (where, k)


def _same_optim(a, b, where):
    _same(a["state"], b["state"], where)
    assert a["param_groups"] == b["param_groups"], where


def _fsdp2(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    model = _net(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _check_torch_ddp():
    import torch.distributed.checkpoint.state_dict as tsd

    from shardkit.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    ddp = nn.parallel.DistributedDataParallel(_net(0))
    optim = torch.optim.Adam(ddp.parameters(), lr=0.01)
    _train(ddp, optim)
    msd, osd = get_state_dict(ddp, optim)
    assert not any(k.startswith("module.") for k in msd), list(msd)
    _same(msd, tsd.get_model_state_dict(ddp), "ddp model")
    _same_optim(osd, tsd.get_optimizer_state_dict(ddp, optim), "ddp optim")
    plain = _net(1)
    plain_optim = torch.optim.Adam(plain.parameters(), lr=0.5)
    # like torch's Optimizer.load_state_dict, the optimizer adopts the given tensors
    set_state_dict(
        plain,
        plain_optim,
        model_state_dict=msd,
        optim_state_dict=copy.deepcopy(osd),
        options=StateDictOptions(strict=True),
    )
    _train(ddp, optim, seed=9)
    _train(plain, plain_optim, seed=9)
    for (k, a), b in zip(ddp.module.state_dict().items(), plain.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def _check_fsdp2():
    from dataclasses import replace

    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as tsd

    import shardkit.checkpoint.state_dict as sd_api
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardkit.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _fsdp2(0, mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optim)
    full = StateDictOptions(full_state_dict=True)
    tfull = tsd.StateDictOptions(full_state_dict=True)

    msd, osd = get_state_dict(model, optim)
    assert all(isinstance(v, DTensor) for v in msd.values())
    assert isinstance(osd["state"]["0.weight"]["exp_avg"], DTensor)
    _same(msd, tsd.get_model_state_dict(model), "fsdp2 sharded model")
    _same_optim(osd, tsd.get_optimizer_state_dict(model, optim), "fsdp2 sharded optim")
    fmsd, fosd = get_state_dict(model, optim, options=full)
    assert all(type(v) is torch.Tensor for v in fmsd.values())
    _same(fmsd, tsd.get_model_state_dict(model, options=tfull), "fsdp2 full model")
    _same_optim(fosd, tsd.get_optimizer_state_dict(model, optim, options=tfull), "fsdp2 full optim")
    # with cpu_offload too, rank 0 alone gets the gathered state dicts, as torch
    offload, toffload = (
        o.StateDictOptions(full_state_dict=True, cpu_offload=True) for o in (sd_api, tsd)
    )
    for flat in (False, True):
        ours = get_state_dict(model, optim, options=replace(offload, flatten_optimizer_state_dict=flat))
        theirs = tsd.get_state_dict(
            model, optim, options=replace(toffload, flatten_optimizer_state_dict=flat)
        )
        if dist.get_rank() == 0:
            _same(ours[0], fmsd, "fsdp2 full offloaded model")
            _same(ours[0], theirs[0], "fsdp2 full offloaded model, torch")
            _same(ours[1], theirs[1], "fsdp2 full offloaded optim, torch")
        else:
            assert ours == theirs == ({}, {}), (ours, theirs)

    # full tensors load into a fresh FSDP2 model (sliced locally) and training continues alike
    for values in ("full", "sharded"):
        other = _fsdp2(1, mesh)
        other_optim = torch.optim.Adam(other.parameters(), lr=0.3)
        m_in, o_in = (fmsd, fosd) if values == "full" else (msd, copy.deepcopy(osd))
        set_state_dict(other, other_optim, model_state_dict=m_in, optim_state_dict=o_in)
        _same(get_model_state_dict(other), msd, f"fsdp2 reload {values}")
        _same_optim(get_optimizer_state_dict(other, other_optim), osd, f"fsdp2 optim {values}")

    # the gathered state dict loads into a plain model, and a plain one into FSDP2
    plain = _net(2)
    set_model_state_dict(plain, fmsd)
    _same(plain.state_dict(), fmsd, "fsdp2 -> plain")
    target = _fsdp2(3, mesh)
    set_model_state_dict(target, plain.state_dict())
    _same(get_model_state_dict(target), msd, "plain -> fsdp2")
    try:
        set_model_state_dict(target, {**fmsd, "2.weight": torch.zeros(3, 4)})
    except ValueError as exc:
        assert "'2.weight'" in str(exc) and "(3, 4)" in str(exc) and "(3, 5)" in str(exc)
    else:
        raise AssertionError("shape mismatch on a DTensor parameter was not reported")
    _train(model, optim, seed=11)
    _train(other, other_optim, seed=11)
    _same(get_model_state_dict(other), get_model_state_dict(model), "fsdp2 trained on")


def _check_sharded_tensor_params():
    import shardkit.spmd as xs
    from shardkit.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    mesh = xs.Mesh(list(range(WORLD)), (WORLD,), ("x",))
    torch.manual_seed(0)
    full_w = torch.randn(5, 3)
    layer = nn.Linear(3, 5)
    layer.weight = nn.Parameter(xs.mark_sharding(full_w, mesh, ("x", None)))
    sd = get_model_state_dict(layer)
    assert isinstance(sd["weight"], xs.ShardedTensor)
    assert sd["weight"].partition_spec == ("x", None)
    gathered = get_model_state_dict(layer, options=StateDictOptions(full_state_dict=True))
    assert type(gathered["weight"]) is torch.Tensor and torch.equal(gathered["weight"], full_w)
    dst = nn.Linear(3, 5)
    dst.weight = nn.Parameter(xs.mark_sharding(torch.zeros(5, 3), mesh, ("x", None)))
    set_model_state_dict(dst, gathered)
    assert torch.equal(dst.weight.local_tensor(), layer.weight.local_tensor())
    assert torch.equal(dst.bias, layer.bias)


class _ShardedUnit(nn.Module):
    """A stand-in for shardkit FSDP: flat local row shards as plain parameters."""

    _shardkit_wrapper = True

    def __init__(self, module, mesh):
        super().__init__()
        import shardkit.spmd as xs

        self.module, self.mesh = module, mesh
        self.shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        self.flat = nn.ParameterList(
            nn.Parameter(
                xs.mark_sharding(p.detach(), mesh, ("x",) + (None,) * (p.ndim - 1))
                .local_tensor()
                .detach()
                .clone()
            )
            for p in module.parameters()
        )

    def _shardkit_sharded_state_dict(self):
        import shardkit.spmd as xs

        return {
            n: xs.ShardedTensor.from_local(
                p.detach(), self.mesh, ("x",) + (None,) * (len(s) - 1), s
            )
            for (n, s), p in zip(self.shapes.items(), self.flat)
        }

    def _shardkit_load_sharded_state_dict(self, state):
        with torch.no_grad():
            for n, p in zip(self.shapes, self.flat):
                p.copy_(state[n].local_tensor())

    def _shardkit_param_fqns(self):
        return {id(p): n for n, p in zip(self.shapes, self.flat)}


def _check_protocol():
    import shardkit.spmd as xs
    from shardkit.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    mesh = xs.Mesh(list(range(WORLD)), (WORLD,), ("x",))

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(2, 3), _ShardedUnit(nn.Linear(3, 3), mesh))

    model = build(0)
    optim = torch.optim.Adam(list(model[0].parameters()) + list(model[1].flat), lr=0.1)
    for p in optim.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optim.step()
    msd, osd = get_state_dict(model, optim)
    assert sorted(msd) == ["0.bias", "0.weight", "1.bias", "1.weight"], sorted(msd)
    assert isinstance(msd["1.weight"], xs.ShardedTensor) and msd["1.weight"].shape == (3, 3)
    assert osd["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    moment = osd["state"]["1.weight"]["exp_avg"]
    assert isinstance(moment, xs.ShardedTensor) and moment.shape == (3, 3)
    assert torch.equal(moment.local_tensor(), optim.state[model[1].flat[0]]["exp_avg"])
    full = StateDictOptions(full_state_dict=True)
    fmsd, fosd = get_state_dict(model, optim, options=full)
    assert type(fosd["state"]["1.weight"]["exp_avg"]) is torch.Tensor
    assert fosd["state"]["1.weight"]["exp_avg"].shape == (3, 3)

    other = build(1)
    other_optim = torch.optim.Adam(list(other[0].parameters()) + list(other[1].flat), lr=0.5)
    set_state_dict(other, other_optim, model_state_dict=fmsd, optim_state_dict=fosd)
    _same(get_model_state_dict(other, options=full), fmsd, "protocol model")
    _same_optim(get_optimizer_state_dict(other, other_optim, options=full), fosd, "protocol optim")
    assert torch.equal(
        other_optim.state[other[1].flat[0]]["exp_avg"], optim.state[model[1].flat[0]]["exp_avg"]
    )
    # strict=False: a key the sharded module owns but the state dict lacks keeps its value
    bumped = {k: v + 1 for k, v in fmsd.items() if k != "1.bias"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = set_model_state_dict(other, bumped, options=StateDictOptions(strict=False))
    # as torch: the skipped keys come back in the result, without a warning
    assert result.missing_keys == ["1.bias"] and not any("1.bias" in str(w.message) for w in caught)
    now = get_model_state_dict(other, options=full)
    assert torch.equal(now["1.bias"], fmsd["1.bias"])
    assert torch.equal(now["1.weight"], fmsd["1.weight"] + 1)


def _check_shardkit_wrappers():
    from shardkit.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from shardkit.ddp import DistributedDataParallel as SkDDP
    from shardkit.fsdp import FullyShardedDataParallel as SkFSDP

    ref = _net(0)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=0.05)
    model = SkFSDP(_net(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    _train(model, optim)
    _train(ref, ref_optim)
    full = StateDictOptions(full_state_dict=True)
    fmsd, fosd = get_state_dict(model, optim, options=full)
    rmsd, rosd = get_state_dict(ref, ref_optim)
    assert list(fmsd) == list(rmsd) and list(fosd["state"]) == list(rosd["state"])
    for k in rmsd:
        assert torch.allclose(fmsd[k], rmsd[k], atol=1e-6), k
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(fosd["state"][k][name], rosd["state"][k][name], atol=1e-6), k
    ddp = SkDDP(_net(1))
    ddp_optim = torch.optim.Adam(ddp.parameters(), lr=0.5)
    set_state_dict(ddp, ddp_optim, model_state_dict=fmsd, optim_state_dict=copy.deepcopy(fosd))
    _same(get_state_dict(ddp, ddp_optim)[0], fmsd, "shardkit FSDP -> shardkit DDP")
    _same(get_state_dict(ddp, ddp_optim)[1]["state"], fosd["state"], "FSDP -> DDP optim")


def _body():
    _check_torch_ddp()
    _check_fsdp2()
    _check_sharded_tensor_params()
    _check_protocol()
    _check_shardkit_wrappers()
    return "ok"


def test_state_dict_helpers_on_two_ranks():
    assert run_ranks(_body, WORLD, timeout=120) == ["ok"] * WORLD
