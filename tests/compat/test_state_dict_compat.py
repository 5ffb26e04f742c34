"""shardkit.checkpoint.state_dict against torch.distributed.checkpoint.state_dict (torch 2.13).

The same scenario through both, in one process or in the same 2-rank run: key sets,
values, dtypes, devices, optimizer hyperparameters and exception classes must agree.
Every case has a hard time limit.
"""

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.distributed.checkpoint.state_dict as tsd
from harness import run_ranks
from torch import nn

import shardkit.checkpoint.state_dict as ssd
from shardkit.checkpoint import StateDictMismatchError

pytestmark = pytest.mark.timeout(120)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _trained(seed=0, opt=torch.optim.Adam, **kw):
    model = _net(seed)
    optim = opt(model.parameters(), **({"lr": 0.1} | kw))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(5, 3, generator=gen)).square().sum().backward()
        optim.step()
    return model, optim


def _equal(a, b, where=""):
    if isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), (where, list(a), list(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _equal(x, y, where)
    elif torch.is_tensor(a):
        assert (a.dtype, a.device, tuple(a.shape)) == (b.dtype, b.device, tuple(b.shape)), where
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the oracle's class is what we compare
        return exc
    raise AssertionError("nothing raised")


def _both(fn):
    """``fn(module)`` with torch's helpers and with ours."""
    return fn(tsd), fn(ssd)


def _opts(mod, **kw):
    return mod.StateDictOptions(**kw)


# -- getting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [{}, {"full_state_dict": True}, {"cpu_offload": True}, {"ignore_frozen_params": True}],
    ids=["default", "full", "cpu_offload", "ignore_frozen"],
)
def test_get_state_dict_matches_torch(kw):
    model, optim = _trained()
    model[0].bias.requires_grad_(False)
    theirs, ours = _both(lambda m: m.get_state_dict(model, optim, options=_opts(m, **kw)))
    _equal(ours[0], theirs[0], "model")
    _equal(ours[1], theirs[1], "optim")


def test_submodules_and_keep_submodule_prefixes_match_torch():
    model, _ = _trained()
    for keep in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: the option is deprecated
            theirs, ours = _both(
                lambda m, keep=keep: m.get_model_state_dict(
                    model, submodules={model[2]}, options=_opts(m, keep_submodule_prefixes=keep)
                )
            )
        _equal(ours, theirs, f"keep={keep}")


def test_flattened_optimizer_state_dict_matches_torch_and_loads_back():
    model, optim = _trained()
    theirs, ours = _both(
        lambda m: m.get_optimizer_state_dict(
            model, optim, options=_opts(m, flatten_optimizer_state_dict=True)
        )
    )
    _equal(ours, theirs)
    fresh = _net(1)
    opt = torch.optim.Adam(fresh.parameters(), lr=0.7)
    ssd.set_optimizer_state_dict(fresh, opt, ours)
    _equal(ssd.get_optimizer_state_dict(fresh, opt), ssd.get_optimizer_state_dict(model, optim))


def test_empty_param_group_is_kept_and_restored_as_torch():
    def run(m):
        model = nn.Linear(2, 2)
        optim = torch.optim.SGD([{"params": list(model.parameters()), "lr": 0.1},
                                 {"params": [], "lr": 0.7}])  # fmt: skip
        osd = m.get_optimizer_state_dict(model, optim)
        again = torch.optim.SGD([{"params": list(model.parameters()), "lr": 0.2},
                                 {"params": [], "lr": 0.9}])  # fmt: skip
        m.set_optimizer_state_dict(model, again, osd)
        return osd, [g["lr"] for g in again.param_groups]

    theirs, ours = _both(run)
    _equal(ours[0], theirs[0])
    assert ours[1] == theirs[1] == [0.1, 0.7]


# -- setting -------------------------------------------------------------------------


def test_raw_optimizer_state_dict_restores_lr_and_state_as_torch():
    src_model, src = _trained(lr=0.05)

    def run(m):
        model = _net(3)
        optim = torch.optim.Adam(model.parameters(), lr=0.9)
        m.set_optimizer_state_dict(model, optim, copy.deepcopy(src.state_dict()))
        return optim.state_dict()

    theirs, ours = _both(run)
    _equal(ours, theirs)
    assert ours["param_groups"][0]["lr"] == 0.05
    _equal(ours["state"], src.state_dict()["state"])


def test_set_state_dict_with_an_empty_model_state_dict_as_torch():
    src_model, src = _trained()

    def run(m):
        model = _net(3)
        optim = torch.optim.Adam(model.parameters(), lr=0.9)
        osd = m.get_optimizer_state_dict(src_model, src)
        m.set_state_dict(model, optim, model_state_dict={}, optim_state_dict=osd)
        return model.state_dict(), optim.state_dict()

    theirs, ours = _both(run)
    _equal(ours, theirs)
    _equal(ours[0], _net(3).state_dict())  # the model is left alone


def test_empty_optimizer_state_dict_raises_as_torch():
    model, optim = _trained()
    theirs, ours = _both(
        lambda m: _raised(
            lambda: m.set_state_dict(model, optim, model_state_dict={}, optim_state_dict={})
        )
    )
    assert isinstance(ours, type(theirs))


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape"])
def test_mismatches_raise_torch_class(case):
    model, _ = _trained()
    sd = model.state_dict()
    bad = {
        "missing": {k: v for k, v in sd.items() if k != "2.bias"},
        "unexpected": {**sd, "9.weight": torch.zeros(1)},
        "shape": {**sd, "0.weight": torch.zeros(5, 3)},
    }[case]
    theirs, ours = _both(lambda m: _raised(lambda: m.set_model_state_dict(_net(1), bad)))
    assert isinstance(ours, type(theirs)), (type(ours), type(theirs))
    assert isinstance(ours, (StateDictMismatchError, ValueError))  # both worlds
    key = {"missing": "2.bias", "unexpected": "9.weight", "shape": "0.weight"}[case]
    assert key in str(ours)


def test_non_strict_returns_the_same_keys_as_torch():
    model, _ = _trained()
    sd = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    sd["9.weight"] = torch.zeros(1)
    theirs, ours = _both(
        lambda m: m.set_model_state_dict(_net(1), sd, options=_opts(m, strict=False))
    )
    assert sorted(ours.missing_keys) == sorted(theirs.missing_keys) == ["2.bias"]
    assert sorted(ours.unexpected_keys) == sorted(theirs.unexpected_keys) == ["9.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_cast_as_torch(dtype):
    model, _ = _trained()
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}

    def run(m):
        target = _net(1)
        m.set_model_state_dict(target, sd)
        return target.state_dict()

    theirs, ours = _both(run)
    _equal(ours, theirs)


def _meta_body():
    import torch
    import torch.distributed.checkpoint.state_dict as tsd

    import shardkit.checkpoint.state_dict as ssd

    model, _ = _trained()

    def run(m):
        with torch.device("meta"):
            target = _net(1)
        m.set_model_state_dict(
            target, model.state_dict(), options=_opts(m, full_state_dict=True, strict=False)
        )
        return target

    theirs, ours = run(tsd), run(ssd)
    _equal(ours.state_dict(), theirs.state_dict())
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in ours.parameters())
    assert not any(p.is_meta for p in ours.parameters())
    ours(torch.randn(2, 3)).sum().backward()  # it trains
    return ours[0].weight.grad is not None


def test_meta_model_is_materialised_as_torch():
    # torch's meta path needs a process group (for its default device), so run in one
    assert run_ranks(_meta_body, 2, timeout=60) == [True, True]


def test_state_dict_options_fields_and_defaults_match_torch():
    theirs = {f.name: f.default for f in dataclasses.fields(tsd.StateDictOptions)}
    ours = {f.name: f.default for f in dataclasses.fields(ssd.StateDictOptions)}
    assert ours == theirs


def test_broadcast_needs_full_state_dict_as_torch():
    theirs, ours = _both(
        lambda m: _raised(lambda: m.set_model_state_dict(
            _net(), {}, options=m.StateDictOptions(broadcast_from_rank0=True)))
    )  # fmt: skip
    assert isinstance(ours, type(theirs))


# -- 2 ranks: FSDP2 and broadcast_from_rank0 -----------------------------------------


def _fsdp2(seed, mesh, meta=False):
    from torch.distributed.fsdp import fully_shard

    if meta:
        with torch.device("meta"):
            model = _net(seed)
    else:
        model = _net(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _broadcast_body():
    import copy

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint.state_dict as ssd

    mesh = init_device_mesh("cpu", (2,))
    src, src_optim = _trained(seed=5)
    full_msd = src.state_dict() if dist.get_rank() == 0 else {}
    full_osd = tsd.get_optimizer_state_dict(src, src_optim) if dist.get_rank() == 0 else {}
    out = {}
    for meta in (False, True):
        results = []
        for mod in (tsd, ssd):
            model = _fsdp2(1, mesh, meta=meta)
            opts = mod.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            # torch replaces the values of the dict it is given: give each its own copy
            mod.set_model_state_dict(model, dict(full_msd), options=opts)
            optim = torch.optim.Adam(model.parameters(), lr=0.9)
            if not meta:
                mod.set_optimizer_state_dict(model, optim, copy.deepcopy(full_osd), options=opts)
            results.append((model, optim))
        (tm, to), (om, oo) = results
        tsd_m, osd_m = tm.state_dict(), om.state_dict()
        same = list(tsd_m) == list(osd_m)
        for k in tsd_m:
            a, b = tsd_m[k].to_local(), osd_m[k].to_local()
            same = same and a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
            # the local shard holds no more memory than its own elements
            same = same and b.untyped_storage().nbytes() == b.numel() * b.element_size()
        if not meta:
            a = tsd.get_optimizer_state_dict(tm, to)
            b = tsd.get_optimizer_state_dict(om, oo)
            same = same and a["param_groups"][0]["lr"] == b["param_groups"][0]["lr"] == 0.1
            for k, entry in a["state"].items():
                for name, v in entry.items():
                    w = b["state"][k][name]
                    v = v.to_local() if hasattr(v, "to_local") else v
                    w = w.to_local() if hasattr(w, "to_local") else w
                    same = same and torch.equal(v, w)
        out["meta" if meta else "plain"] = bool(same)
    return out


def test_broadcast_from_rank0_into_fsdp2_matches_torch():
    results = run_ranks(_broadcast_body, 2, timeout=90)
    assert results == [{"plain": True, "meta": True}] * 2


def _mismatch_body():
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint.state_dict as ssd

    mesh = init_device_mesh("cpu", (2,))
    sd = _net(0).state_dict()
    sd["0.weight"] = torch.zeros(7, 3)
    out = []
    for mod in (tsd, ssd):
        try:
            mod.set_model_state_dict(_fsdp2(1, mesh), sd)
        except Exception as exc:  # noqa: BLE001 - comparing classes
            out.append(exc)
    t, s = out
    return isinstance(s, type(t)) and "0.weight" in str(s) and f"rank {dist.get_rank()}" in str(s)


def test_sharded_shape_mismatch_raises_torch_class_naming_rank():
    assert run_ranks(_mismatch_body, 2, timeout=60) == [True, True]


def _ac(seed):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = _net(seed)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    return model


def test_activation_checkpointing_under_shardkit_fsdp_gives_torch_keys():
    import shardkit.fsdp as fsdp

    oracle = tsd.get_model_state_dict(_ac(0))  # torch's keys: no wrapper components
    model = fsdp.FullyShardedDataParallel(_ac(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    full = ssd.StateDictOptions(full_state_dict=True)
    msd = ssd.get_model_state_dict(model, options=full)
    osd = ssd.get_optimizer_state_dict(model, optim, options=full)
    assert list(msd) == list(oracle)
    assert sorted(osd["state"]) == sorted(k for k in oracle if "weight" in k or "bias" in k)
    plain = _net(5)  # loads into a plain model, and back into a wrapped one
    plain_optim = torch.optim.Adam(plain.parameters())
    ssd.set_state_dict(plain, plain_optim, model_state_dict=msd, optim_state_dict=osd)
    _equal(dict(plain.state_dict()), msd)
    again = fsdp.FullyShardedDataParallel(_ac(7))
    again_optim = torch.optim.Adam(again.parameters())
    ssd.set_state_dict(again, again_optim, model_state_dict=msd, optim_state_dict=osd)
    _equal(ssd.get_model_state_dict(again, options=full), msd)


def _fsdp2_meta_full_body():
    import torch
    import torch.distributed.checkpoint.state_dict as tsd
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint.state_dict as ssd

    mesh = init_device_mesh("cpu", (2,))
    full = _trained(seed=4)[0].state_dict()
    models = []
    for mod in (tsd, ssd):
        model = _fsdp2(1, mesh, meta=True)
        opts = mod.StateDictOptions(full_state_dict=True, strict=False)
        mod.set_model_state_dict(model, dict(full), options=opts)
        models.append(model)
    theirs, ours = (m.state_dict() for m in models)
    ok = list(theirs) == list(ours) and not any(p.is_meta for p in models[1].parameters())
    for k in theirs:
        a, b = theirs[k].to_local(), ours[k].to_local()
        ok = ok and (a.dtype, a.device) == (b.dtype, b.device) and torch.equal(a, b)
    models[1](torch.randn(2, 3)).sum().backward()  # the materialised model trains
    return ok and all(p.grad is not None for p in models[1].parameters())


def test_fsdp2_meta_model_is_materialised_from_a_full_state_dict_as_torch():
    assert run_ranks(_fsdp2_meta_full_body, 2, timeout=60) == [True, True]


def test_missing_optimizer_state_raises_as_torch_and_changes_nothing():
    """Saved state lacking a parameter that requires grad: strict raises a RuntimeError
    (torch's class) and leaves the optimizer as it was; strict=False drops that state."""

    def run(m, **kw):
        model, optim = _trained(seed=1)
        osd = m.get_optimizer_state_dict(model, optim)
        name = sorted(osd["state"])[0]
        del osd["state"][name]
        before = copy.deepcopy(optim.state_dict())
        try:
            m.set_optimizer_state_dict(model, optim, osd, options=_opts(m, **kw))
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        return name, raised, before, optim.state_dict()

    for name, raised, before, after in _both(run):  # torch's, then ours
        assert raised is not None and name in raised, raised
        _equal(after, before)
    theirs, ours = _both(lambda m: run(m, strict=False))
    assert theirs[1] is ours[1] is None
    _equal(ours[3], theirs[3])


# -- no optimizer, empty and overlapping param groups (found by a side-by-side audit) ----


def test_an_empty_optimizer_list_gets_and_sets_the_model_alone_as_torch():
    model, _ = _trained()
    theirs, ours = _both(lambda m: m.get_state_dict(model, []))
    _equal(ours, theirs)
    assert ours[1] == {} and sorted(ours[0]) == sorted(model.state_dict())

    def load(m):
        fresh = _net(5)
        m.set_state_dict(fresh, [], model_state_dict=model.state_dict(), optim_state_dict={})
        return fresh.state_dict()

    theirs, ours = _both(load)
    _equal(ours, theirs)
    _equal(ours, model.state_dict())


@pytest.mark.parametrize("call", ["get", "set"])
def test_an_empty_optimizer_list_where_only_optimizers_count_raises_torch_class(call):
    model, _ = _trained()

    def run(m):
        if call == "get":
            return _raised(lambda: m.get_optimizer_state_dict(model, []))
        return _raised(
            lambda: m.set_optimizer_state_dict(model, [], {"state": {}, "param_groups": []})
        )

    theirs, ours = _both(run)
    assert isinstance(theirs, RuntimeError) and isinstance(ours, RuntimeError), (theirs, ours)
    assert isinstance(ours, ValueError) and "optimizers is empty" in str(ours)


def test_a_state_dict_without_param_groups_is_refused_and_changes_nothing():
    """torch: ValueError ("a different number of parameter groups"). shardkit used to
    load it, wiping the stepped optimizer's state without a word."""
    model, optim = _trained()
    before = copy.deepcopy(optim.state_dict())
    theirs, ours = _both(
        lambda m: _raised(
            lambda: m.set_optimizer_state_dict(model, optim, {"state": {}, "param_groups": []})
        )
    )
    assert isinstance(theirs, ValueError) and isinstance(ours, ValueError), (theirs, ours)
    assert "no param_groups" in str(ours)
    _equal(optim.state_dict(), before)


def test_a_parameter_in_several_saved_groups_takes_the_last_groups_hyperparameters():
    model, optim = _trained(opt=torch.optim.SGD, momentum=0.9)
    osd = ssd.get_optimizer_state_dict(model, optim)
    (group,) = osd["param_groups"]
    osd["param_groups"] = [{**group, "lr": 0.1}, {**group, "lr": 0.2}]

    def run(m):
        fresh = _net(0)
        target = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
        m.set_optimizer_state_dict(fresh, target, copy.deepcopy(osd))
        return [g["lr"] for g in target.param_groups]

    theirs, ours = _both(run)
    assert ours == theirs == [0.2]
