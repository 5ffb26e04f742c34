"""Pure-logic tests of the manager's pieces: prime_optimizer, policies, preemption, storage."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardkit.checkpoint import save
from shardkit.checkpoint._manager._preemption import PreemptionWatcher
from shardkit.checkpoint._manager._prime import prime_optimizer
from shardkit.checkpoint._manager._retention import (
    AnyPreservationPolicy,
    BestN,
    EveryNSteps,
    LatestN,
    steps_to_delete,
)
from shardkit.checkpoint._manager._storage import StepStore, step_dir_name

OPTIMS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
}


def _model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    m[0].bias.requires_grad_(False)  # frozen parameter: never gets state
    return m


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=g)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(OPTIMS))
def test_prime_then_in_place_load_is_bit_exact(name):
    ref_model = _model(0)
    ref = OPTIMS[name](ref_model.parameters())
    _train(ref_model, ref, 3)

    model = _model(1)
    model.load_state_dict(ref_model.state_dict())
    opt = OPTIMS[name](model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad for p in model.parameters()]
    hparams = [dict(g) for g in opt.param_groups]
    assert prime_optimizer(opt) is opt
    # parameters, grads and hyper-parameters untouched; state allocated and zero
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert [p.grad for p in model.parameters()] == grads
    assert [dict(g) for g in opt.param_groups] == hparams
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert set(opt.state) == set(trainable)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                assert not v.any()

    # in-place load (what the checkpoint layer does) restores the state bit-exactly
    src, dst = ref.state_dict()["state"], opt.state_dict()["state"]
    assert set(src) == set(dst)
    for pid, st in dst.items():
        assert set(st) == set(src[pid])
        for key, v in st.items():
            assert v.shape == src[pid][key].shape and v.dtype == src[pid][key].dtype
            v.copy_(src[pid][key])
    _train(ref_model, ref, 2, seed=5)
    _train(model, opt, 2, seed=5)
    for (k, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum"])
def test_primed_state_trains_like_fresh_state(name):
    fresh_model, primed_model = _model(2), _model(2)
    fresh = OPTIMS[name](fresh_model.parameters())
    primed = prime_optimizer(OPTIMS[name](primed_model.parameters()))
    _train(fresh_model, fresh, 3)
    _train(primed_model, primed, 3)
    for a, b in zip(fresh_model.parameters(), primed_model.parameters()):
        assert torch.equal(a, b)


def test_prime_overwrites_existing_state_and_rejects_non_optimizers():
    model = _model(3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _train(model, opt, 2)
    prime_optimizer(opt)
    assert all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in opt.state.values())
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        prime_optimizer(model)


def test_policies():
    steps = {s: {"acc": a} for s, a in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.9), (5, 0.1)]}
    steps[6] = None
    assert LatestN(2).should_preserve(steps) == {5, 6}
    assert EveryNSteps(2).should_preserve(steps) == {2, 4, 6}
    assert BestN("acc", 2).should_preserve(steps) == {2, 4, 6}
    assert BestN("acc", 1, mode="min", keep_without_metric=False).should_preserve(steps) == {5}
    assert BestN("acc", 2, keep_without_metric=False).should_preserve(steps) == {2, 4}
    assert BestN("acc", 1).should_preserve({1: {"acc": 1.0}, 2: {"acc": 1.0}}) == {2}
    anyp = AnyPreservationPolicy([LatestN(1), EveryNSteps(3)])
    assert anyp.should_preserve(steps) == {3, 6}
    assert steps_to_delete(anyp, steps) == [1, 2, 4, 5]
    # the newest step survives even a policy that keeps nothing
    assert steps_to_delete(BestN("acc", 1, keep_without_metric=False), steps) == [1, 2, 3, 5]
    assert steps_to_delete(None, steps) == []
    for bad in (lambda: LatestN(0), lambda: EveryNSteps(-1), lambda: BestN("", 1)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="mode"):
        BestN("acc", 1, mode="best")
    with pytest.raises(TypeError, match="keep_without_metric"):
        BestN("acc", 1, keep_without_metric="no")
    with pytest.raises(TypeError, match="BestN"):
        BestN("acc", 1, "min")  # mode is keyword-only
    with pytest.raises(TypeError, match=r"LatestN\(n\).*str '3'"):
        LatestN("3")  # a wrong type is a TypeError, as CheckpointManager(max_to_keep="3")


def test_best_n_treats_a_value_that_is_no_number_as_missing():
    """Metrics come back from manager.json; None, a string or a bool must not stop
    retention (it would raise in every pass, and nothing would ever be deleted)."""
    steps = {1: {"loss": None}, 2: {"loss": 0.5}, 3: {"loss": "n/a"}, 4: {"loss": 0.2}}
    steps |= {5: {"loss": True}, 6: {"loss": 0.9}, 7: {"loss": [1]}, 8: "not a dict"}
    assert BestN("loss", 1, mode="min").should_preserve(steps) == {1, 3, 4, 5, 7, 8}
    best = BestN("loss", 2, mode="min", keep_without_metric=False)
    assert best.should_preserve(steps) == {2, 4}
    with pytest.raises(TypeError, match=r"policies\[1\]"):
        AnyPreservationPolicy([LatestN(1), object()])


def test_preemption_watcher_sets_flag_and_restores_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        a = PreemptionWatcher(signal.SIGUSR1)
        b = PreemptionWatcher(signal.SIGUSR1)
        assert not a.received() and not b.received()
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler only sets a flag
        assert a.received() and b.received() and seen == []
        a.close()
        b.close()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the previous handler is back
        c = PreemptionWatcher(signal.SIGUSR1)
        assert not c.received()
        c.trigger()
        assert c.received()
        c.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(ValueError, match="SIGKILL"):
        PreemptionWatcher(signal.SIGKILL)
    with pytest.raises(ValueError, match="not a signal"):
        PreemptionWatcher(12345)


def test_step_store_lists_commits_cleans_and_deletes(tmp_path):
    for url in (str(tmp_path / "run"), "memory://unit-store/run"):
        store = StepStore(url)
        assert store.committed_steps() == []
        store.write_metrics(3, {"loss": 0.5})
        for step in (3, 12, 100000000, 7):
            store.fs.makedirs(f"{store.root}/{step_dir_name(step)}", exist_ok=True)
            store.fs.pipe(f"{store.root}/{step_dir_name(step)}/data.bin", b"x")
        for step in (3, 100000000, 7):
            save({"x": torch.ones(2)}, checkpoint_id=store.step_url(step))
        # step 7 is committed but damaged: not listed, and not cleaned up either
        data = [f for f in store.fs.ls(f"{store.root}/{step_dir_name(7)}", detail=False)]
        store.fs.rm([f for f in data if f.endswith(".safetensors")])
        store.fs.pipe(f"{store.root}/notes.txt", b"kept")
        assert store.list_step_dirs() == [3, 7, 12, 100000000]
        assert store.committed_steps() == [3, 100000000]
        assert store.has_marker(7) and not store.has_marker(12)
        assert store.step_url(3) == f"{url}/step_00000003"
        assert store.read_metrics(3) == {"loss": 0.5} and store.read_metrics(12) is None
        assert store.remove_incomplete() == [12]
        store.delete(3)
        assert store.list_step_dirs() == [7, 100000000]
        assert store.fs.exists(f"{store.root}/notes.txt")
