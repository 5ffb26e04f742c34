"""State-dict helpers on one process: FQN unwrapping, optimizer keying, options, errors.

torch's own ``torch.distributed.checkpoint.state_dict`` serves as the oracle where it
applies.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import state_dict as tsd

from shardkit.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.register_buffer("scale", torch.arange(2.0))

    def forward(self, x):
        return self.block(self.embed(x)) * self.scale


class FakeWrapper(nn.Module):
    """What a shardkit DDP-style wrapper looks like to the helpers."""

    _shardkit_wrapper = True

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _net(seed=0):
    torch.manual_seed(seed)
    return Net()


def _train(model, optim, steps=2):
    torch.manual_seed(123)
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        optim.step()


def _assert_sd_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            _assert_sd_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_options_are_validated_and_frozen():
    opts = StateDictOptions(full_state_dict=True)
    assert (opts.full_state_dict, opts.cpu_offload, opts.strict, opts.ignore_frozen_params) == (
        True,
        False,
        True,
        False,
    )
    with pytest.raises(TypeError, match="cpu_offload"):
        StateDictOptions(cpu_offload=1)
    with pytest.raises(TypeError):
        StateDictOptions(True)  # keyword-only
    with pytest.raises(AttributeError):
        opts.strict = False  # frozen
    with pytest.raises(TypeError, match="StateDictOptions"):
        get_model_state_dict(_net(), options={"strict": False})


def test_wrapped_models_give_unwrapped_keys_like_torch():
    plain = _net()
    expected = tsd.get_model_state_dict(plain)
    inner = _net()
    inner.block[0] = checkpoint_wrapper(inner.block[0])  # nested wrapper component
    variants = {
        "plain": plain,
        "shardkit-wrapper": FakeWrapper(_net()),
        "compile": torch.compile(_net()),
        "wrapper(compile(ckpt-wrapped))": FakeWrapper(torch.compile(inner)),
    }
    for name, model in variants.items():
        sd = get_model_state_dict(model)
        _assert_sd_equal(sd, expected)
        assert all(not v.requires_grad for v in sd.values()), name
    # a child really named "module" under no wrapper keeps its name
    holder = nn.Module()
    holder.module = nn.Linear(2, 2)
    assert sorted(get_model_state_dict(FakeWrapper(holder))) == ["module.bias", "module.weight"]


def test_set_model_state_dict_round_trip_across_wrappers():
    src = FakeWrapper(torch.compile(_net(0)))
    sd = get_model_state_dict(src, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    inner = _net(1)
    inner.block[2] = checkpoint_wrapper(inner.block[2])
    dst = FakeWrapper(inner)
    result = set_model_state_dict(dst, sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    _assert_sd_equal(get_model_state_dict(dst), tsd.get_model_state_dict(_net(0)))


def test_model_errors_name_keys_shapes_and_dtypes():
    model = _net()
    sd = get_model_state_dict(model)
    with pytest.raises(ValueError, match=r"'embed.weight'.*\(5, 3\).*\(4, 3\)"):
        set_model_state_dict(model, {**sd, "embed.weight": torch.zeros(5, 3)})
    set_model_state_dict(model, {**sd, "scale": torch.full((2,), 3.0, dtype=torch.float64)})
    assert model.scale.dtype == torch.float32 and model.scale.eq(3).all()  # cast, as torch
    partial = {k: v for k, v in sd.items() if k != "scale"}
    partial["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \['scale'\].*unexpected keys"):
        set_model_state_dict(model, partial)
    before = copy.deepcopy(model.state_dict())
    new = {k: v + 1 for k, v in partial.items() if k != "extra.weight"}
    new["extra.weight"] = torch.zeros(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as torch: reported in the result, not warned
        result = set_model_state_dict(model, new, options=StateDictOptions(strict=False))
    assert result.missing_keys == ["scale"] and result.unexpected_keys == ["extra.weight"]
    assert torch.equal(model.scale, before["scale"])
    assert torch.equal(model.embed.weight, before["embed.weight"] + 1)
    with pytest.raises(TypeError, match="mapping"):
        set_model_state_dict(model, [1, 2])


def test_frozen_params_and_submodules():
    model = _net()
    model.embed.requires_grad_(False)
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    assert "embed.weight" not in sd and "block.0.weight" in sd and "scale" in sd
    oracle = tsd.get_model_state_dict(
        model, options=tsd.StateDictOptions(ignore_frozen_params=True)
    )
    _assert_sd_equal(sd, oracle)
    # frozen params are not missing when ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_model_state_dict(model, sd, options=StateDictOptions(ignore_frozen_params=True))
    sub = get_model_state_dict(FakeWrapper(model), submodules=[model.block])
    assert sorted(sub) == ["block.0.bias", "block.0.weight", "block.2.bias", "block.2.weight"]
    with pytest.raises(ValueError, match="not part of the model"):
        get_model_state_dict(model, submodules=[nn.Linear(1, 1)])


def _optim_sd_equal(ours, theirs):
    _assert_sd_equal(ours["state"], theirs["state"])
    assert ours["param_groups"] == theirs["param_groups"]


def test_optimizer_state_keyed_by_fqn_like_torch():
    model = _net()
    optim = torch.optim.AdamW(
        [
            {"params": list(model.embed.parameters()), "lr": 0.01},
            {"params": list(model.block.parameters()), "weight_decay": 0.5},
        ],
        lr=0.1,
    )
    _train(model, optim)
    ours = get_optimizer_state_dict(FakeWrapper(torch.compile(model)), optim)
    _optim_sd_equal(ours, tsd.get_optimizer_state_dict(model, optim))
    assert ours["param_groups"][0]["params"] == ["embed.weight", "embed.bias"]
    # full + cpu offload changes nothing for plain CPU tensors
    full = get_optimizer_state_dict(
        model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    _optim_sd_equal(full, ours)
    sub = get_optimizer_state_dict(model, optim, submodules=[model.block])
    assert sorted(sub["state"]) == [
        "block.0.bias",
        "block.0.weight",
        "block.2.bias",
        "block.2.weight",
    ]
    assert len(sub["param_groups"]) == 1


def test_optimizer_round_trip_into_a_differently_wrapped_model_trains_identically():
    model = _net(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.1)
    _train(model, optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    model_sd = copy.deepcopy(model_sd)
    optim_sd = copy.deepcopy(optim_sd)

    other = _net(1)
    other_optim = torch.optim.Adam(other.parameters(), lr=9.0)  # hyperparams come from the sd
    wrapped = FakeWrapper(torch.compile(other))
    result = set_state_dict(
        wrapped, other_optim, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    assert result == ([], [])
    assert other_optim.param_groups[0]["lr"] == 0.05
    _train(model, optim, steps=2)
    _train(other, other_optim, steps=2)
    _assert_sd_equal(other.state_dict(), model.state_dict())
    _optim_sd_equal(
        get_optimizer_state_dict(other, other_optim), get_optimizer_state_dict(model, optim)
    )


def test_priming_an_unstepped_optimizer_does_not_change_training():
    for make in (
        lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
    ):
        a, b = _net(0), _net(0)
        opt_a, opt_b = make(a.parameters()), make(b.parameters())
        sd = get_optimizer_state_dict(a, opt_a)  # allocates state in place
        assert sorted(sd["state"]) == sorted(n for n, _ in a.named_parameters())
        assert a.embed.weight.grad is None  # priming leaves no gradients behind
        _train(a, opt_a, steps=3)
        _train(b, opt_b, steps=3)
        _assert_sd_equal(a.state_dict(), b.state_dict())

        # gradients already there (between backward and the first step) are kept
        a, b = _net(0), _net(0)
        opt_a, opt_b = make(a.parameters()), make(b.parameters())
        for model in (a, b):
            model(torch.ones(2, 3)).sum().backward()
        grad = a.embed.weight.grad.clone()
        sd = get_optimizer_state_dict(a, opt_a)
        assert len(sd["state"]) == 6 and torch.equal(a.embed.weight.grad, grad)
        opt_a.step()
        opt_b.step()
        _assert_sd_equal(a.state_dict(), b.state_dict())


def test_multiple_optimizers_and_optimizer_errors():
    model = _net()
    opt1 = torch.optim.SGD(model.embed.parameters(), lr=0.1, momentum=0.9)
    opt2 = torch.optim.Adam(model.block.parameters(), lr=0.2)
    _train(model, _Both(opt1, opt2))
    sd = get_optimizer_state_dict(model, [opt1, opt2])
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.2]
    assert set(sd["state"]["embed.weight"]) == {"momentum_buffer"}
    fresh = _net()
    f1 = torch.optim.SGD(fresh.embed.parameters(), lr=1.0, momentum=0.9)
    f2 = torch.optim.Adam(fresh.block.parameters(), lr=1.0)
    set_optimizer_state_dict(fresh, (f1, f2), sd)
    _optim_sd_equal(get_optimizer_state_dict(fresh, [f1, f2]), sd)
    # one optimizer at a time: the other's state is skipped with a warning naming it
    f3 = torch.optim.SGD(fresh.embed.parameters(), lr=1.0, momentum=0.9)
    with pytest.warns(UserWarning, match="block.0.weight"):
        set_optimizer_state_dict(fresh, f3, sd)
    assert torch.equal(
        f3.state[fresh.embed.weight]["momentum_buffer"],
        sd["state"]["embed.weight"]["momentum_buffer"],
    )
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        get_optimizer_state_dict(model, stranger)
    with pytest.raises(ValueError, match=r"optimizer 1 parameter 0 \(shape \(3,\)\)"):
        set_optimizer_state_dict(model, [opt1, stranger], sd)
    with pytest.raises(TypeError, match="optimizers"):
        get_optimizer_state_dict(model, "adam")
    with pytest.raises(ValueError, match="param_groups"):
        set_optimizer_state_dict(model, opt1, {"state": {}})


class _Both:
    def __init__(self, *optims):
        self.optims = optims

    def zero_grad(self):
        for o in self.optims:
            o.zero_grad()

    def step(self):
        for o in self.optims:
            o.step()


def test_unexpected_keys_from_a_load_state_dict_override_are_a_mismatch_error():
    """A module whose own load_state_dict reports unexpected keys used to trip an assert
    (gone under -O); it is the package's mismatch error naming the keys."""
    from shardkit.checkpoint import StateDictMismatchError

    class Picky(nn.Linear):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            super().load_state_dict(state_dict, strict=strict, assign=assign)
            return nn.modules.module._IncompatibleKeys([], ["bias"])

    model = Picky(2, 2)
    with pytest.raises(StateDictMismatchError, match=r"unexpected keys \['bias'\]"):
        set_model_state_dict(model, get_model_state_dict(model))
