"""CheckpointManager in one process (no process group): local disk, memory://, loopback S3."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
from s3_server import LoopbackS3

from shardkit.checkpoint import (
    BestN,
    CheckpointError,
    CheckpointManager,
    EveryNSteps,
)


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3, 4, generator=g), "n": torch.tensor([step]), "meta": {"s": step}}


def _empty():
    return {"w": torch.empty(3, 4), "n": torch.empty(1, dtype=torch.int64), "meta": {"s": -1}}


def _check_restores(mgr, step):
    got = mgr.restore(step, _empty())
    want = _state(step)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["n"], want["n"])
    assert got["meta"] == want["meta"]


def _exercise(url, storage_options=None):
    """Sync + async saves, interval, retention, restore and a restart, on one URL."""
    kw = {"storage_options": storage_options, "chkpt_on_preemption": False}
    mgr = CheckpointManager(url, 2, max_to_keep=2, **kw)
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    assert [s for s in range(7) if mgr.should_save(s)] == [0, 2, 4, 6]
    saved = []
    for step in range(7):
        save = mgr.save if step % 4 else mgr.save_async
        if save(step, _state(step)):
            saved.append(step)
    assert saved == [0, 2, 4, 6]
    mgr.join()
    assert mgr.all_steps() == [4, 6]
    assert mgr.save(7, _state(7), force=True)
    mgr.join()
    assert mgr.all_steps() == [6, 7] and mgr.latest_step() == 7
    assert not mgr.should_save(6)
    with pytest.raises(ValueError, match="not newer"):
        mgr.save(7, _state(7), force=True)
    _check_restores(mgr, 6)
    _check_restores(mgr, 7)
    with pytest.raises(ValueError, match=r"step 2 has no committed checkpoint.*\[6, 7\]"):
        mgr.restore(2, _empty())
    mgr.close()
    # a restart sees the same steps and keeps the interval going
    with CheckpointManager(url, 2, max_to_keep=2, **kw) as mgr:
        assert mgr.all_steps() == [6, 7]
        assert mgr.save(8, _state(8))
        mgr.join()
        assert mgr.all_steps() == [7, 8]
        _check_restores(mgr, 8)


def test_local_disk_round_trip(tmp_path):
    _exercise(str(tmp_path / "run"))


def test_memory_round_trip():
    _exercise("memory://manager-test/run")


def test_s3_round_trip():
    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        _exercise("s3://ckpt/run", s3.storage_options)
        fs = s3.filesystem()
        assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt/run")) == [
            "step_00000007",
            "step_00000008",
        ]
        assert fs.exists("ckpt/run/step_00000008/metadata.json")


def test_policies_keep_every_k_and_best_n(tmp_path):
    url = str(tmp_path / "run")
    losses = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.5, 5: 0.7, 6: 0.95, 7: 0.6}
    with CheckpointManager(
        url,
        1,
        max_to_keep=1,
        preservation_policy=EveryNSteps(3),
        chkpt_on_preemption=False,
    ) as mgr:
        for step in range(1, 8):
            mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [3, 6, 7]
    url = str(tmp_path / "best")
    policy = BestN("loss", 2, mode="min")
    with CheckpointManager(url, 1, preservation_policy=policy, chkpt_on_preemption=False) as mgr:
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.join()
        assert mgr.all_steps() == [2, 4, 7]  # the best two, and the newest
    # after a restart the metrics come from storage
    with CheckpointManager(url, 1, preservation_policy=policy, chkpt_on_preemption=False) as mgr:
        mgr.save(8, _state(8), metrics={"loss": 0.1})
        mgr.join()
        assert mgr.all_steps() == [2, 8]


def test_a_metric_that_is_no_number_does_not_stop_retention(tmp_path):
    """A None metric used to make every retention pass raise (and only log): with
    max_to_keep=2 every step stayed on disk."""
    policy = BestN("val_loss", 1, mode="min", keep_without_metric=False)
    kw = {"max_to_keep": 2, "preservation_policy": policy, "chkpt_on_preemption": False}
    with CheckpointManager(str(tmp_path / "run"), 1, **kw) as mgr:
        for step in range(6):
            mgr.save(
                step, _state(step), metrics={"val_loss": None if step == 1 else 1.0 / (step + 1)}
            )
        mgr.join()
        assert mgr.all_steps() == [4, 5]  # the newest two; 5 is also the best


def test_failed_background_save_names_the_step(tmp_path, monkeypatch):
    from shardkit.checkpoint._manager import _io as _manager_io

    real = _manager_io._writer

    def broken(mgr, step):
        writer = real(mgr, step)
        if step in (2, 4):

            def fail(name, parts):
                raise OSError("disk full")

            writer.write_file = fail
        return writer

    monkeypatch.setattr(_manager_io, "_writer", broken)
    mgr = CheckpointManager(str(tmp_path / "run"), 1, chkpt_on_preemption=False)
    assert mgr.save_async(1, _state(1))
    assert mgr.save_async(2, _state(2))
    with pytest.raises(CheckpointError, match="step 2.*disk full"):
        mgr.join()  # raised by join ...
    assert mgr.all_steps() == [1]
    assert mgr.save_async(3, _state(3))
    assert mgr.save_async(4, _state(4))
    with pytest.raises(CheckpointError, match="background save of step 4"):
        mgr.save_async(5, _state(5))  # ... or by the next call
    mgr.join()  # each failure is raised once
    assert mgr.save_async(5, _state(5))
    mgr.close()
    assert mgr.all_steps() == [1, 3, 5]


def test_preemption_signal_forces_one_off_interval_save(tmp_path):
    with CheckpointManager(str(tmp_path / "run"), 10, preemption_signal=signal.SIGUSR1) as mgr:
        saved = []
        for step in range(1, 30):
            if step == 13:
                os.kill(os.getpid(), signal.SIGUSR1)
            if mgr.save_async(step, _state(step)):
                saved.append(step)
            if mgr.reached_preemption(step):
                break
        assert saved == [10, 13] and step == 13
        assert not mgr.reached_preemption(12) and mgr.reached_preemption(14)
        mgr.join()
        assert mgr.all_steps() == [10, 13]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # a manager dropped without close() gives the signal back too
    mgr = CheckpointManager(str(tmp_path / "other"), 10, preemption_signal=signal.SIGUSR2)
    assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL
    del mgr
    gc.collect()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_should_save_reports_a_received_preemption_signal_as_torch_xla(tmp_path):
    """torch_xla's loop ``if mgr.should_save(step): mgr.save(step, state)`` never took the
    preemption checkpoint: should_save looked at the interval only."""
    with CheckpointManager(str(tmp_path / "run"), 10, preemption_signal=signal.SIGUSR1) as mgr:
        saved = []
        for step in range(1, 30):
            if step == 13:
                os.kill(os.getpid(), signal.SIGUSR1)
            if mgr.should_save(step) and mgr.save(step, _state(step)):
                saved.append(step)
            if mgr.reached_preemption(step):
                break
        assert saved == [10, 13] and step == 13
        assert not mgr.should_save(14)  # the preemption checkpoint is taken: the interval again


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"save_interval": 0}, ValueError, "save_interval"),
        ({"save_interval": 1.5}, TypeError, "save_interval"),
        ({"save_interval": 1.0}, TypeError, "save_interval must be an int >= 1, got float 1.0"),
        ({"save_interval": None}, TypeError, "save_interval must be an int >= 1, got NoneType"),
        ({"max_to_keep": True}, TypeError, "max_to_keep"),
        ({"num_of_threads": "2"}, TypeError, "num_of_threads"),
        ({"lease_ttl": "60"}, TypeError, "lease_ttl"),
        ({"lease_ttl": 0.5}, ValueError, "lease_ttl"),
        ({"max_to_keep": -1}, ValueError, "max_to_keep"),
        ({"max_pending_async": 0}, ValueError, "max_pending_async"),
        ({"chkpt_on_preemption": "yes"}, TypeError, "chkpt_on_preemption"),
        ({"preservation_policy": 3}, TypeError, "preservation_policy"),
        ({"storage_options": "x"}, TypeError, "storage_options"),
        ({"preemption_signal": signal.SIGKILL}, ValueError, "SIGKILL"),
        (
            {"process_group": object()},
            TypeError,
            "process_group must be a torch.distributed.ProcessGroup",
        ),
        ({"process_group": 4}, TypeError, "num_of_threads is keyword-only"),
        ({"max_file_bytes": 0}, ValueError, "max_file_bytes"),
        ({"zero_stall": 1}, TypeError, "zero_stall"),
    ],
)
def test_argument_validation(tmp_path, kwargs, exc, match):
    kwargs = {"save_interval": 1, **kwargs}
    with pytest.raises(exc, match=match):
        CheckpointManager(str(tmp_path), **kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"async_process_group": 4}, {"process_group": object()}, {"process_group": "4"}]
)
def test_num_of_threads_hint_only_for_an_int_process_group(tmp_path, kwargs):
    """The hint is about torch_xla's positional num_of_threads landing in process_group;
    async_process_group is keyword-only and a non-int is no thread count."""
    with pytest.raises(TypeError, match="must be a torch.distributed.ProcessGroup") as info:
        CheckpointManager(str(tmp_path), 1, **kwargs)
    assert "num_of_threads" not in str(info.value)


def test_call_validation(tmp_path):
    with CheckpointManager(str(tmp_path), 1, chkpt_on_preemption=False) as mgr:
        with pytest.raises(ValueError, match="step must be >= 0"):
            mgr.save(-1, {})
        with pytest.raises(TypeError, match="step must be an int"):
            mgr.should_save(1.0)
        with pytest.raises(TypeError, match="state_dict must be a dict"):
            mgr.save(1, [1])
        with pytest.raises(TypeError, match="metrics"):
            mgr.save(1, _state(1), metrics={"loss": object()})
    with pytest.raises(ValueError, match="closed"):
        mgr.save(2, _state(2))


def test_a_path_that_is_a_file_is_refused_at_construction(tmp_path):
    """Before, the first save failed taking the writer's lease, with a FileExistsError."""
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(ValueError, match="is a file; it must be a directory"):
        CheckpointManager(str(path), 1, chkpt_on_preemption=False)
    assert path.read_text() == "x"


def test_torch_xla_step_directories_are_named_and_convert_to_steps(tmp_path, caplog):
    """torch_xla's manager keeps each step as ``<path>/<step>/`` (torch DCP). shardkit's
    listed none of them without a word, so a migrated run restarted from step 0."""
    import logging
    import warnings

    import torch.distributed.checkpoint as torch_dcp

    from shardkit.checkpoint.format_utils import import_torch_dcp

    root = tmp_path / "xla_run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "assuming the intent is to save in a single..."
        torch_dcp.save({"x": torch.arange(4.0)}, checkpoint_id=root / "100", no_dist=True)
    with caplog.at_level(logging.WARNING):
        mgr = CheckpointManager(str(root), 100, chkpt_on_preemption=False)
        assert mgr.all_steps() == []
    message = next(  # torch's DCP logger may log too, and the tmp path holds "torch_xla"
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("shardkit") and "named like torch_xla" in r.getMessage()
    )
    assert "['100']" in message and "--from torch-dcp" in message and "step_00000100" in message
    import_torch_dcp(root / "100", root / "step_00000100", progress=False)  # what it says
    assert mgr.all_steps() == [100]
    assert torch.equal(mgr.restore(100, {"x": torch.zeros(4)})["x"], torch.arange(4.0))
    mgr.close()


def test_max_file_bytes_caps_each_data_file_and_retention_removes_them_all(tmp_path):
    """The core's file cap through the manager (it had no way to set it): a step's share
    spans several files; restore, verify and retention handle them."""
    from shardkit.cli import main

    def state(step):
        g = torch.Generator().manual_seed(step)
        return {f"t{i}": torch.randn(64, 64, generator=g) for i in range(6)}  # 16 KiB each

    run = tmp_path / "run"
    with CheckpointManager(str(run), 1, max_to_keep=1, max_file_bytes=40_000) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
        got = mgr.restore(2, {f"t{i}": torch.empty(64, 64) for i in range(6)})
    assert all(torch.equal(got[k], v) for k, v in state(2).items())
    assert sorted(os.listdir(run)) == ["step_00000002"]  # step 1 and all its files went
    data = [n for n in os.listdir(run / "step_00000002") if n.startswith("data-")]
    assert len(data) == 3  # two 16 KiB tensors per 40 KB file
    assert all(os.path.getsize(run / "step_00000002" / n) < 40_000 + 4096 for n in data)
    assert main(["ckpt", "verify", "--no-progress", str(run / "step_00000002")]) == 0


@pytest.mark.parametrize("tier", [False, True], ids=["persistent", "ram_tier"])
def test_zero_stall_off_lets_the_loop_change_weights_right_after_save_async(tmp_path, tier):
    """The manager had no opt-out: a loop that edits weights outside optimizer.step()
    right after saving (manual decay, EMA written back) failed every save."""
    from shardkit.checkpoint import LocalTier

    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 32)).sum().backward()
    opt.step()  # the optimizer is known: its tensors would be staged in the background
    local = LocalTier(interval=1, directory=str(tmp_path / "node")) if tier else None
    with CheckpointManager(
        str(tmp_path / "run"), 1, chkpt_on_preemption=False, zero_stall=False, local_tier=local
    ) as mgr:
        for step in (1, 2, 3):
            want = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save_async(step, {"model": model.state_dict()})
            with torch.no_grad():
                model.weight.mul_(0.5)  # at once, outside optimizer.step()
        mgr.join()
        got = mgr.restore(3, {"model": torch.nn.Linear(32, 32).state_dict()})
    assert all(torch.equal(got["model"][k], want[k]) for k in want)


def test_the_next_writer_removes_temporaries_a_killed_writer_left(tmp_path, caplog):
    """A SIGKILL during a lease or manager.json write left ``manager.lease.tmp-<hex>``
    for good (kill audit). Only old ones go: a renewal may be writing one right now."""
    import os
    import time

    run = tmp_path / "run"
    run.mkdir()
    stale = [run / f"manager.{kind}.tmp-{'a' * 32}" for kind in ("lease", "json", "run")]
    fresh = run / f"manager.lease.tmp-{'b' * 32}"
    other = run / "manager.lease.tmp-notours"
    for path in (*stale, fresh, other):
        path.write_text("{}")
    old = time.time() - 3600
    for path in (*stale, other):
        os.utime(path, (old, old))
    caplog.set_level("WARNING")
    with CheckpointManager(str(run), 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    assert not any(p.exists() for p in stale)
    assert fresh.exists() and other.exists()
    assert any("removed temporary files" in r.getMessage() for r in caplog.records)


def test_a_manager_given_one_checkpoint_says_it_is_not_a_run_directory(tmp_path, caplog):
    """It listed no steps without a word (errors audit); `shardkit ckpt ls` named it."""
    import shardkit.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "one")
    caplog.set_level("WARNING")
    with CheckpointManager(str(tmp_path / "one"), 1, chkpt_on_preemption=False) as mgr:
        assert mgr.all_steps() == []
    assert any("is one checkpoint" in r.getMessage() for r in caplog.records)
