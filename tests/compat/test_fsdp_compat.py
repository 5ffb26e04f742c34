"""shardkit.fsdp against torch (FSDP2 ``fully_shard``, plain single-process training, the
``torch.distributed.fsdp.wrap`` policies, ``checkpoint_wrapper``) and torch_xla's
documented FSDP behaviour. Values, key sets, dtypes, shapes and exception classes; every
case has a hard time limit."""

import functools
import inspect
import warnings

import numpy as np
import pytest
import torch
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(120)
WORLD = 2


class Block(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        with torch.device(device or "cpu"):
            self.inp = nn.Linear(5, 6)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(6, 3)  # 3 rows over 2 ranks: uneven

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


POLICY_ARGS = {"transformer_layer_cls": {Block}}


def _ours(model, **kw):
    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, **POLICY_ARGS)
    return FSDP(model, auto_wrap_policy=policy, **kw)


def _fsdp2(model, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _batch(step, rank):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))


def _train(model, steps=3):
    import torch.distributed as dist

    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(steps):
        opt.zero_grad()
        model(_batch(step, rank)).square().mean().backward()
        opt.step()
    return opt


def _np(t):
    return t.detach().numpy().copy()


def _vs_fsdp2_body():
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict as torch_get_model,
    )
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict as torch_get_optim,
    )

    from shardkit.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    ours = _ours(Net())
    torch.manual_seed(0)
    ref = _fsdp2(Net())
    ours_opt, ref_opt = _train(ours), _train(ref)
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    out = {
        "values": {
            k.replace("module.", ""): (
                _np(v.full_tensor()),
                tuple(v.shape),
                tuple(v._local_tensor.shape),
                str(v.dtype),
            )
            for k, v in sd.items()
        },
        "ref_values": {
            k: (_np(v.full_tensor()), tuple(v.shape), tuple(v._local_tensor.shape), str(v.dtype))
            for k, v in ref_sd.items()
        },
        "model_keys": (list(get_model_state_dict(ours)), list(torch_get_model(ref))),
        "optim_keys": (
            sorted(get_optimizer_state_dict(ours, ours_opt)["state"]),
            sorted(torch_get_optim(ref, ref_opt)["state"]),
        ),
    }
    # ZeRO-2 and bf16 compute with fp32 reduction, against FSDP2's equivalents
    from torch.distributed.fsdp import MixedPrecisionPolicy

    variants = {
        "zero2": ({"reshard_after_forward": False}, {"reshard_after_forward": False}),
        "bf16": (
            {"compute_dtype": torch.bfloat16, "fp32_reduce_scatter": True},
            {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)},
        ),
    }
    out["variants"] = {}
    for name, (ours_kw, ref_kw) in variants.items():
        torch.manual_seed(0)
        a = _ours(Net(), **ours_kw)
        torch.manual_seed(0)
        b = _fsdp2(Net(), **ref_kw)
        _train(a), _train(b)
        out["variants"][name] = (
            {k.replace("module.", ""): _np(v.full_tensor()) for k, v in a.state_dict().items()},
            {k: _np(v.full_tensor()) for k, v in b.state_dict().items()},
        )
    # optim.state_dict() values: global shapes and the same moments as FSDP2's DTensors
    osd, ref_osd = ours_opt.state_dict(), ref_opt.state_dict()
    out["moments"] = [
        (
            tuple(a["exp_avg"].shape),
            tuple(b["exp_avg"].shape),
            _np(a["exp_avg"].full_tensor()),
            _np(b["exp_avg"].full_tensor()),
        )
        for a, b in zip(osd["state"].values(), ref_osd["state"].values())
    ]
    return out


@pytest.fixture(scope="module")
def vs_fsdp2():
    return run_ranks(_vs_fsdp2_body, WORLD, timeout=100)


def test_training_matches_fsdp2(vs_fsdp2):
    for res in vs_fsdp2:
        assert sorted(res["values"]) == sorted(res["ref_values"])
        for k, (full, shape, _local, dtype) in res["values"].items():
            rfull, rshape, _rlocal, rdtype = res["ref_values"][k]
            np.testing.assert_allclose(full, rfull, atol=2e-6, rtol=0, err_msg=k)
            assert (shape, dtype) == (rshape, rdtype), k


@pytest.mark.parametrize("variant, tol", [("zero2", 2e-6), ("bf16", 2e-3)])
def test_zero2_and_mixed_precision_match_fsdp2(vs_fsdp2, variant, tol):
    for res in vs_fsdp2:
        ours, ref = res["variants"][variant]
        assert sorted(ours) == sorted(ref)
        for k in ref:
            np.testing.assert_allclose(ours[k], ref[k], atol=tol, rtol=0, err_msg=k)
        if variant == "bf16":  # really computed in bf16: off the fp32 run, as FSDP2 is
            fp32 = {k: v[0] for k, v in res["values"].items()}
            assert max(np.abs(ours[k] - fp32[k]).max() for k in fp32) > 1e-5


def test_state_dict_shards_have_fsdp2_global_and_local_shapes(vs_fsdp2):
    for res in vs_fsdp2:
        for k, (_full, shape, local, _dtype) in res["values"].items():
            assert (shape, local) == res["ref_values"][k][1:3], k


def test_state_dict_helper_keys_match_torch(vs_fsdp2):
    for res in vs_fsdp2:
        assert res["model_keys"][0] == res["model_keys"][1]
        assert res["optim_keys"][0] == res["optim_keys"][1]


def test_optimizer_state_dict_values_are_global_like_fsdp2(vs_fsdp2):
    for res in vs_fsdp2:
        assert len(res["moments"]) == 12
        for shape, ref_shape, full, ref_full in res["moments"]:
            assert shape == ref_shape
            np.testing.assert_allclose(full, ref_full, atol=2e-6, rtol=0)


# -- deferred init, activation checkpointing, state-dict round trips (2 ranks) -----------
def _plain_trained(steps=3):
    """Single-process oracle: both ranks' batches, averaged gradients."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(_batch(step, r)).square().mean() for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
    return {k: _np(v) for k, v in model.state_dict().items()}


def _full_of(model):
    return {k: _np(v.full_tensor()) for k, v in model._shardkit_sharded_state_dict().items()}


def _flows_body():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    from shardkit.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    full = Net().state_dict()
    out = {}

    # param_init_fn on a meta model, then load a full state dict (rows are sliced)
    def init(module):
        module.to_empty(device="cpu", recurse=False)

    model = _ours(Net("meta"), param_init_fn=init)
    model.load_state_dict({"module." + _wrapped(k): v for k, v in full.items()})
    _train(model)
    out["param_init_fn"] = _full_of(model)

    # FSDP2's flow: wrap on meta, to_empty(), reset_parameters(), then load and train
    model = _ours(Net("meta"))
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    out["meta_device"] = [p.device.type for p in model.parameters()]
    model.load_state_dict({"module." + _wrapped(k): v for k, v in full.items()})
    _train(model)
    out["to_empty"] = _full_of(model)

    # torch's apply_activation_checkpointing under our FSDP
    torch.manual_seed(0)
    model = _ours(Net())
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    opt = _train(model)
    out["ckpt_wrapped"] = _full_of(model)
    out["ckpt_keys"] = (
        list(get_model_state_dict(model)),
        sorted(get_optimizer_state_dict(model, opt)["state"]),
        list(model.state_dict()),
    )
    return out


def _wrapped(key):
    """Unwrapped name -> our FSDP state_dict key (auto-wrapped blocks add ``module.``)."""
    parts = key.split(".")
    if parts[0] == "blocks":
        return ".".join(parts[:2] + ["module"] + parts[2:])
    return key


@pytest.fixture(scope="module")
def flows():
    return run_ranks(_flows_body, WORLD, timeout=100), _plain_trained()


@pytest.mark.parametrize("flow", ["param_init_fn", "to_empty", "ckpt_wrapped"])
def test_deferred_init_and_checkpoint_wrapper_train_like_torch(flows, flow):
    results, ref = flows
    for res in results:
        got = res[flow]
        assert list(got) == list(ref)
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], atol=2e-6, rtol=0, err_msg=k)
        if flow == "to_empty":
            assert set(res["meta_device"]) == {"cpu"}


def test_checkpoint_wrapper_leaves_no_prefix_in_keys(flows):
    results, ref = flows
    for res in results:
        model_keys, optim_keys, raw_keys = res["ckpt_keys"]
        assert model_keys == list(ref)
        assert optim_keys == sorted(ref)
        assert not any("_checkpoint_wrapped_module" in k for k in raw_keys)


# -- one process: API surface against torch_xla's documented behaviour and torch ---------
def test_xla_alias_and_public_names():
    import shardkit.fsdp as sf
    from shardkit.fsdp import FSDP, FullyShardedDataParallel, XlaFullyShardedDataParallel

    assert XlaFullyShardedDataParallel is FullyShardedDataParallel is FSDP
    for name in (
        "XlaFullyShardedDataParallel",
        "checkpoint_module",
        "consolidate_sharded_model_checkpoints",
        "consolidate_sharded_state_dicts",
    ):  # torch_xla.distributed.fsdp.__all__
        assert name in sf.__all__


def test_wrapping_twice_raises_what_torch_xla_raises():
    from shardkit.fsdp import FSDP

    model = FSDP(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="already FSDP-wrapped"):
        FSDP(model)
    with pytest.raises(ValueError):  # and our own class for user mistakes
        FSDP(model)


def test_positional_reshard_after_forward_as_torch_xla():
    from shardkit.fsdp import FSDP

    assert FSDP(nn.Linear(2, 2), False)._opts.reshard_after_forward is False
    params = list(inspect.signature(FSDP.__init__).parameters)
    assert params[:3] == ["self", "module", "reshard_after_forward"]


XLA_DEFAULTS = {  # torch_xla's XlaFullyShardedDataParallel signature
    "execute_sharding_on_init": True,
    "optimization_barrier_in_forward": True,
    "optimization_barrier_in_backward": True,
    "mark_step_on_finalization": False,
    "disable_reshard_on_root": True,
    "shard_param_on_dim_0": False,
    "pin_layout_in_collective_ops": True,
    "_shard_size_multiple": 128,
    "_use_xla_patched_linear": True,
    "_debug_msg": "xla_fsdp",
    "_debug_print": False,
}


@pytest.mark.parametrize("name", sorted(XLA_DEFAULTS))
def test_xla_knobs_accepted_warning_once_when_changed(name):
    from shardkit.fsdp import FSDP, _xla_knobs

    _xla_knobs._WARNED.discard(name)
    default = XLA_DEFAULTS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSDP(nn.Linear(2, 2), **{name: default})  # torch_xla's default: silent
    changed = {True: False, False: True, 128: 1, "xla_fsdp": "x"}[default]
    with pytest.warns(UserWarning, match=name) as record:
        FSDP(nn.Linear(2, 2), **{name: changed})
        FSDP(nn.Linear(2, 2), **{name: changed})
    assert len([w for w in record if name in str(w.message)]) == 1


def test_xla_knobs_that_change_results_are_refused():
    from shardkit.fsdp import FSDP

    with pytest.raises(ValueError, match="sharding_groups"):
        FSDP(nn.Linear(2, 2), sharding_groups=[[0], [1]], sharding_rank=0, sharding_world_size=1)
    with pytest.raises(ValueError, match="_debug_dummy_forward_pass"):
        FSDP(nn.Linear(2, 2), _debug_dummy_forward_pass=True)
    FSDP(nn.Linear(2, 2), sharding_groups=[[0]], sharding_rank=0, sharding_world_size=1)
    with pytest.raises(TypeError, match="not_an_option"):  # as Python / torch_xla
        FSDP(nn.Linear(2, 2), not_an_option=1)


def _modules_for_policies():
    return [nn.Linear(100, 100), nn.ModuleList([nn.Linear(2, 2)]), Block(), nn.ReLU(), Net()]


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("always_wrap_policy", {}),
        ("size_based_auto_wrap_policy", {"min_num_params": 50}),
        ("transformer_auto_wrap_policy", {"transformer_layer_cls": {Block}}),
        ("lambda_auto_wrap_policy", {"lambda_fn": lambda m: isinstance(m, nn.Linear)}),
    ],
)
def test_wrap_policies_decide_like_torch(name, kwargs):
    import torch.distributed.fsdp.wrap as torch_wrap

    import shardkit.fsdp.wrap as ours_wrap

    ours = functools.partial(getattr(ours_wrap, name), **kwargs)
    theirs = functools.partial(getattr(torch_wrap, name), **kwargs)
    for module in _modules_for_policies():
        for recurse in (True, False):
            for numel in (0, 49, 50, 10_000):
                got = ours(module=module, recurse=recurse, nonwrapped_numel=numel)
                assert got == theirs(module=module, recurse=recurse, nonwrapped_numel=numel), (
                    type(module).__name__,
                    recurse,
                    numel,
                )


def test_always_wrap_policy_trains_like_plain():
    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import always_wrap_policy

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=always_wrap_policy)
    assert sum(isinstance(m, FSDP) for m in model.modules()) > 5
    assert not any(isinstance(m, nn.ModuleList) and isinstance(m, FSDP) for m in model.modules())
    x = torch.randn(3, 5)
    torch.testing.assert_close(model(x), plain(x), atol=0, rtol=0)


def _per_rank_files(tmp_path, names):
    """Two ranks' files of one model, written as ranks would, under the given names."""
    from shardkit.fsdp._layout import SlotLayout

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    for rank, name in enumerate(names):
        model, params = {}, {}
        for slot, (key, t) in enumerate(plain.state_dict().items()):
            lay = SlotLayout(tuple(t.shape), WORLD, 0)
            start, rows = lay.rows(rank)
            model["module." + key] = lay.shard_of(t, rank).clone()
            params["module." + key] = dict(
                fqn=key, shape=list(t.shape), slot=slot, replicated=False, start=start, rows=rows
            )
        meta = dict(version=1, world_size=WORLD, rank=rank, params=params, buffers={})
        torch.save({"model": model, "shard_metadata": meta}, tmp_path / name)
    return plain


def test_consolidation_takes_xla_names_orders_by_metadata_and_returns_none(tmp_path):
    from shardkit.fsdp import consolidate_sharded_model_checkpoints, consolidate_sharded_state_dicts

    # names sort the other way round than the ranks inside: metadata decides
    plain = _per_rank_files(tmp_path, ["rank-1-of-2-b.pth", "rank-0-of-2-a.pth"][::-1])
    full, path = consolidate_sharded_model_checkpoints(
        str(tmp_path) + "/", "rank-*-of-2*.pth", save_model=False
    )
    assert path is None  # torch_xla: None when nothing was saved
    assert not list(tmp_path.glob("*consolidated*"))
    assert list(full) == list(plain.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(full[k], v)
    ckpts = [
        torch.load(tmp_path / n, weights_only=True)
        for n in sorted(p.name for p in tmp_path.iterdir())
    ]
    ckpts.sort(key=lambda c: c["shard_metadata"]["rank"])
    again = consolidate_sharded_state_dicts([c["model"] for c in ckpts], ckpts[0]["shard_metadata"])
    assert all(torch.equal(again[k], full[k]) for k in full) and list(again) == list(full)
    _full, path = consolidate_sharded_model_checkpoints(str(tmp_path) + "/", "rank-*-of-2*.pth")
    assert path == str(tmp_path) + "/_consolidated.pth"


def test_consolidation_names_out_of_order_files(tmp_path):
    from shardkit.fsdp import consolidate_sharded_model_checkpoints

    _per_rank_files(tmp_path, ["x.pth", "w.pth"])  # any names: rank 0 sorts last
    full, _ = consolidate_sharded_model_checkpoints(str(tmp_path) + "/", "*.pth", save_model=False)
    assert full["0.weight"].shape == (5, 3)
    _per_rank_files(tmp_path, ["rank-1-of-2.pth", "y.pth"])  # name contradicts metadata
    with pytest.raises(ValueError, match="rank-1-of-2.pth"):
        consolidate_sharded_model_checkpoints(str(tmp_path) + "/", "rank-*.pth", save_model=False)


def test_load_state_dict_accepts_what_state_dict_returns_and_torch_key_errors():
    from shardkit.fsdp import FSDP

    torch.manual_seed(0)
    a = _ours(Net())
    torch.manual_seed(1)
    b = _ours(Net())
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5)
    assert torch.equal(a(x), b(x))
    sd = a.state_dict()
    sd.pop("module.inp.weight")
    with pytest.raises(RuntimeError, match="inp.weight"):  # as nn.Module
        b.load_state_dict(sd)
    c = FSDP(nn.Linear(3, 3))
    plain = nn.Linear(3, 3)
    c.load_state_dict({"module." + k: v for k, v in plain.state_dict().items()})
    assert torch.equal(c(torch.ones(1, 3)), plain(torch.ones(1, 3)))


def test_clip_grad_norm_and_no_sync_match_torch():
    from shardkit.fsdp import FSDP

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    model = FSDP(Net())
    x = torch.randn(6, 5)
    with model.no_sync():
        model(x[:3]).square().sum().backward()
    model(x[3:]).square().sum().backward()
    plain(x[:3]).square().sum().backward()
    plain(x[3:]).square().sum().backward()
    ours = model.clip_grad_norm_(0.5)
    theirs = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_checkpoint_module_and_shard_metadata_as_torch_xla():
    from shardkit.fsdp import FSDP, checkpoint_module

    torch.manual_seed(0)
    plain = Block()
    torch.manual_seed(0)
    model = FSDP(checkpoint_module(Block()))
    x = torch.randn(2, 6, requires_grad=True)
    torch.testing.assert_close(model(x), plain(x))
    meta = model.get_shard_metadata()
    assert {"world_size", "rank", "params", "buffers"} <= set(meta)
    assert set(meta["params"]) == set(model.state_dict())


def test_torch_xla_fsdp_surface_indexing_params_with_grad_and_policy_defaults():
    """Names torch_xla's FSDP and wrap module offer that ported code uses (an audit
    against torch_xla's source): ``fsdp[0]``, ``params_with_grad``, a policy called by
    keyword, and the policy defaults kept on the function."""
    from shardkit.fsdp import FSDP
    from shardkit.fsdp.wrap import always_wrap_policy, size_based_auto_wrap_policy

    model = FSDP(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], nn.ReLU)
    assert model.params_with_grad == []
    model(torch.randn(5, 4)).sum().backward()
    assert len(model.params_with_grad) == 4
    assert always_wrap_policy(module=model, recurse=True, unwrapped_params=3)
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}
    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    mha = nn.MultiheadAttention(4, 2)
    assert not size_based_auto_wrap_policy(mha, True, 10**9)  # a forced leaf
    size_based_auto_wrap_policy.FORCE_LEAF_MODULES = set()
    try:
        assert size_based_auto_wrap_policy(mha, True, 10**9)  # the set is the default
    finally:
        size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
