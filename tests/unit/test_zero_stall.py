"""Zero-stall async_save in one process: the checkpoint holds the state at the call, bit for
bit, while training steps on at once; steps wait for staging; changes made outside
optimizer.step() before staging are refused; buffers and JSON values are taken at the call."""

import threading

import pytest
import torch
from torch import nn

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _async, _zero_stall
from shardkit.checkpoint._core._zero_stall import STATS


def _model(seed=0, width=256):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, width),
        nn.Tanh(), nn.Linear(width, 4),
    )  # fmt: skip


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(32, 16, generator=g)).square().mean().backward()
    opt.step()


def _state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"seen": [1, 2]}}


def _snapshot(sd):
    """A deep copy of a state dict: tensors cloned."""
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _snapshot(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_snapshot(v) for v in sd)
    return sd


def _blank(sd):
    """The same structure with tensors to load into (filled with a sentinel)."""
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, 7) if sd.dtype != torch.bool else torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_blank(v) for v in sd)
    return sd


def _bits(t):
    """Compare floats bit for bit (NaN payloads and -0.0 included)."""
    return t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _assert_same(a, b, path="sd"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bits(a), _bits(b)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _load(path, like):
    target = _blank(like)
    dcp.load(target, checkpoint_id=path)
    return target


class _Gate:
    """Makes the background staging copy wait until ``open()`` (patches its copy call)."""

    def __init__(self, monkeypatch):
        self.event = threading.Event()
        real = _async.copy_into

        def gated(dst, src):
            self.event.wait()
            real(dst, src)

        monkeypatch.setattr(_async, "copy_into", gated)

    def open(self):
        self.event.set()


@pytest.fixture
def gate(monkeypatch):
    g = _Gate(monkeypatch)
    yield g
    g.open()  # a failed test must not leave the save thread waiting forever


def test_immediate_large_steps_do_not_leak_into_the_checkpoint(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=10.0)  # every step changes every byte
    _step(model, opt, 0)  # the optimizer is known once it has stepped
    staged_before = STATS.staged_saves
    for i in range(3):
        expected = _snapshot(_state(model, opt))
        fut = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path / f"s{i}")
        opt.step()  # at once (the last gradients are still there), long before staging ends
        for k in range(2):  # and on, with large updates
            _step(model, opt, 10 * i + k + 1)
        fut.result(timeout=60)
        _assert_same(_load(tmp_path / f"s{i}", expected), expected)
        now = _state(model, opt)["model"]["0.weight"]
        assert not torch.equal(now, expected["model"]["0.weight"])  # training moved on
    assert STATS.staged_saves == staged_before + 3  # every save took the zero-stall path


def test_a_step_waits_until_its_tensors_are_staged(tmp_path, gate):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    _step(model, opt, 0)
    expected = _snapshot(_state(model, opt))
    fut = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path)
    _step_thread = threading.Thread(target=_step, args=(model, opt, 1))
    waited = STATS.steps_waited
    _step_thread.start()
    with _zero_stall._lock:  # the step reached its pre-hook and waits there
        assert _zero_stall._lock.wait_for(lambda: STATS.waiting == 1, timeout=30)
    for name, p in model.named_parameters():  # not stepped yet (forward did run: BatchNorm)
        _assert_same(p.detach(), expected["model"][name], name)
    gate.open()
    _step_thread.join(timeout=60)
    assert not _step_thread.is_alive() and STATS.steps_waited == waited + 1
    fut.result(timeout=60)
    _assert_same(_load(tmp_path, expected), expected)
    assert not torch.equal(model.state_dict()["3.weight"], expected["model"]["3.weight"])


def test_in_place_change_outside_step_before_staging_is_refused(tmp_path, gate):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    previous = _snapshot(_state(model, opt))
    dcp.save(_state(model, opt), checkpoint_id=tmp_path)
    fut = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path)
    with torch.no_grad():
        model[3].weight.mul_(2.0)  # a user's edit, not an optimizer step
    gate.open()
    with pytest.raises(dcp.CheckpointError, match=r"'model\.3\.weight'.*zero_stall=False"):
        fut.result(timeout=60)
    _assert_same(_load(tmp_path, previous), previous)  # the previous checkpoint is intact
    _step(model, opt, 1)  # steps do not hang after a failed save


def test_opt_out_stages_in_the_call(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    expected = _snapshot(_state(model, opt))
    blocking = STATS.blocking_saves
    fut = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path, zero_stall=False)
    with torch.no_grad():
        model[3].weight.mul_(2.0)  # allowed: everything was copied before the call returned
    fut.result(timeout=60)
    assert STATS.blocking_saves == blocking + 1
    _assert_same(_load(tmp_path, expected), expected)
    with pytest.raises(TypeError, match="zero_stall"):
        dcp.async_save({}, checkpoint_id=tmp_path, zero_stall="yes")


def test_buffers_and_values_are_taken_at_the_call(tmp_path, gate):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    state = _state(model, opt)
    expected = _snapshot(state)
    fut = dcp.async_save(state, checkpoint_id=tmp_path)
    with torch.no_grad():
        model(torch.randn(32, 16))  # BatchNorm updates its running stats in place
    state["meta"]["seen"].append(3)
    assert not torch.equal(model[1].running_mean, expected["model"]["1.running_mean"])
    gate.open()
    fut.result(timeout=60)
    _assert_same(_load(tmp_path, expected), expected)


def test_planning_error_releases_waiting_steps(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    fut = dcp.async_save({"model": model.state_dict(), "bad": object()}, checkpoint_id=tmp_path)
    _step(model, opt, 1)  # must not hang on the failed save
    with pytest.raises(TypeError, match="'bad'"):
        fut.result(timeout=60)
    assert not dcp.is_committed(tmp_path)


def test_load_into_the_staged_tensors_waits_for_staging(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    _step(model, opt, 0)
    old = _snapshot(_state(model, opt))
    dcp.save(_state(model, opt), checkpoint_id=tmp_path / "old")
    _step(model, opt, 1)
    expected = _snapshot(_state(model, opt))
    fut = dcp.async_save(_state(model, opt), checkpoint_id=tmp_path / "new")
    live = _state(model, opt)
    dcp.load(live, checkpoint_id=tmp_path / "old")  # writes into the tensors being staged
    fut.result(timeout=60)  # not refused: the load waited for staging
    _assert_same(_load(tmp_path / "new", expected), expected)
    _assert_same(_snapshot(model.state_dict()), old["model"])


def _copied():
    """Wait until the save's staging copy is done, without its final check (which
    ``wait_for_staging`` makes, as a load or a step would)."""
    staging = _zero_stall._active
    if staging is not None:
        staging.wait()


class _HeldWriter(dcp.FileSystemWriter):
    """Writes nothing until ``release`` is set: the save stays before its commit."""

    def __init__(self, path):
        super().__init__(path)
        self.release = threading.Event()

    def write_file(self, name, parts):
        assert self.release.wait(timeout=60)
        super().write_file(name, parts)


def _trained():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    return model, opt


def _held_save(tmp_path):
    """A trained model's zero-stall save whose writer holds until released."""
    model, opt = _trained()
    expected = _snapshot(_state(model, opt))
    writer = _HeldWriter(tmp_path / "ckpt")
    fut = dcp.async_save(_state(model, opt), storage_writer=writer)
    return model, opt, expected, writer, fut


def _in_flight_op_then(tmp_path, after_staging):
    """An in-place op that was still running while its tensor was copied: torch bumps the
    version when the op ends, so the per-piece check saw nothing. Simulated by a bump
    (``add_(0)``) once staging is done; ``after_staging`` then runs before the save may
    write. Returns the save's future."""
    model, opt, _, writer, fut = _held_save(tmp_path)
    _copied()  # every piece copied and checked
    with torch.no_grad():
        model[3].weight.add_(0.0)  # the op that ran during the copy ends now
    after_staging(model, opt)
    writer.release.set()
    return fut


def test_an_op_that_ends_after_its_copy_fails_the_save_at_the_next_step(tmp_path):
    """Found by the walkthrough (2026-11-28): 1-3 of 15 such saves committed a mix of old
    and new rows, and the manager then restored them without a word."""
    fut = _in_flight_op_then(tmp_path, lambda model, opt: _step(model, opt, 1))
    with pytest.raises(dcp.CheckpointError, match=r"'model\.3\.weight'.*in progress"):
        fut.result(timeout=60)
    assert not dcp.is_committed(tmp_path / "ckpt")


def test_an_op_that_ends_after_its_copy_fails_the_save_without_a_step(tmp_path):
    fut = _in_flight_op_then(tmp_path, lambda model, opt: None)
    with pytest.raises(dcp.CheckpointError, match=r"'model\.3\.weight'.*in progress"):
        fut.result(timeout=60)
    assert not dcp.is_committed(tmp_path / "ckpt")


def test_changes_after_the_next_step_do_not_fail_the_save(tmp_path):
    """A clamp after optimizer.step() (weight constraints) while the save still writes is
    legitimate: the step's check came first and the copy is long done."""
    model, opt, expected, writer, fut = _held_save(tmp_path)
    _step(model, opt, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.01, 0.01)
    writer.release.set()
    fut.result(timeout=60)
    _assert_same(_load(tmp_path / "ckpt", expected), expected)


def test_a_load_after_staging_does_not_fail_the_save(tmp_path):
    """load() waits for staging and makes the final check first: its own writes into the
    tensors come after it and do not count against the save still writing. The other
    checkpoint is float64, so the load casts through copy_, which bumps the versions (a
    load in the saved dtype reads straight into memory and bumps nothing)."""
    other = tmp_path / "other"
    blank = _blank(_state(*_trained()))  # 7 everywhere
    for part in (blank["model"],):
        for key, value in part.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                part[key] = value.double()
    dcp.save(blank, checkpoint_id=other)
    model, opt, expected, writer, fut = _held_save(tmp_path)
    dcp.load(_state(model, opt), checkpoint_id=other)  # into the saved model, in place
    writer.release.set()
    fut.result(timeout=60)
    _assert_same(_load(tmp_path / "ckpt", expected), expected)
    assert all(bool((p == 7).all()) for p in model.parameters())
