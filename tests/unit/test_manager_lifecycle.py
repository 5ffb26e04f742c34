"""CheckpointManager's lifecycle beside other runs and other managers, in one process:
how a run is named, dropped managers, close after a failure, Ctrl-C, forked children."""

from __future__ import annotations

import errno
import gc
import multiprocessing as mp
import os
import signal
import threading

import pytest
import torch

from shardkit.checkpoint import CheckpointError, CheckpointManager, LocalTier
from shardkit.checkpoint._core import _storage
from shardkit.checkpoint._manager import _local

NO_SIGNAL = {"chkpt_on_preemption": False}


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value)}


def _crash(url: str, ram, steps) -> None:
    """A run that saves RAM copies of ``steps`` and dies (the tier is kept)."""
    with pytest.raises(RuntimeError):
        with CheckpointManager(url, 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL) as m:
            for step in steps:
                m.save(step, _state(step))
            raise RuntimeError("the run dies")


def test_a_run_is_named_by_its_directory_however_spelled(tmp_path, monkeypatch):
    """Runs started from two directories with the same relative path are two runs; one
    run reopened as ``file://`` or through a symlink is the same run."""
    ram = tmp_path / "ram"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    _crash("ckpt", ram, [1, 2, 3])
    monkeypatch.chdir(tmp_path / "b")
    with CheckpointManager("ckpt", 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL) as b:
        assert b.latest_step() is None  # a fresh run: run a's copies are not its own
    os.symlink(tmp_path / "a", tmp_path / "link")
    for url in (f"file://{tmp_path}/a/ckpt", str(tmp_path / "link" / "ckpt")):
        with pytest.raises(RuntimeError, match="keep"):  # a clean exit would remove them
            with CheckpointManager(url, 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL) as a:
                assert a.latest_step() == 3
                assert torch.equal(a.restore(3, _state(0))["w"], _state(3)["w"])
                raise RuntimeError("keep the copies")


def test_runs_sharing_a_directory_never_replace_each_others_copies(tmp_path):
    ram = tmp_path / "ram"
    _crash(str(tmp_path / "a"), ram, [1, 2, 7])
    copy = ram / "local" / "rank_00000" / "step_00000007"
    inode = os.stat(copy / "tier.json").st_ino
    stranger = copy.parent / "step_00000009.tmp-0123abcd-000000000000"  # run a's, writing
    stranger.mkdir()
    b = CheckpointManager(str(tmp_path / "b"), 100, local_tier=LocalTier(directory=ram))
    b.save(5, _state(50))  # its retention sweeps only its own temporaries
    with pytest.raises(CheckpointError, match=r"step_00000007 holds another run's copy"):
        b.save(7, _state(70))
        b.join()
    b.close()
    assert os.stat(copy / "tier.json").st_ino == inode and stranger.is_dir()
    with CheckpointManager(
        str(tmp_path / "a"), 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL
    ) as a:
        assert a.latest_step() == 7
        assert torch.equal(a.restore(7, _state(0))["w"], _state(7)["w"])


def test_a_manager_beside_a_live_trainer_deletes_nothing(tmp_path):
    """An evaluator opened on a running trainer's path reads its RAM copies and closes
    without deleting them; saving would make it a second writer, which is refused."""
    ram, url = tmp_path / "ram", str(tmp_path / "run")
    trainer = CheckpointManager(url, 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL)
    for step in (1, 2, 3):
        trainer.save(step, _state(step))
    trainer.join()
    own = ram / "local" / "rank_00000"
    with CheckpointManager(url, 100, local_tier=LocalTier(directory=ram), **NO_SIGNAL) as ev:
        assert ev.latest_step() == 3
        assert torch.equal(ev.restore(2, _state(0))["w"], _state(2)["w"])  # newer 3 stays
        with pytest.raises(CheckpointError, match="being written by another CheckpointManager"):
            ev.save(4, _state(4))
    assert sorted(os.listdir(own)) == ["step_00000002", "step_00000003"]
    trainer.save(4, _state(4))
    trainer.close()
    assert not ram.exists()  # the trainer's clean exit removes its copies


def test_a_dropped_manager_is_collected_after_async_saves(tmp_path):
    """The core keeps its last future, and a future keeps its callbacks: the manager's
    callback must not keep a dropped manager (its lease, its signal handler) alive."""
    url = tmp_path / "run"
    mgr = CheckpointManager(str(url), 1, preemption_signal=signal.SIGUSR2)
    mgr.save_async(1, _state(1))
    mgr.join()
    assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL
    assert (url / "manager.lease").exists()
    del mgr
    gc.collect()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    assert not (url / "manager.lease").exists()
    with CheckpointManager(str(url), 1, **NO_SIGNAL) as again:  # the lease is free
        assert again.save(2, _state(2)) and again.all_steps() == [1, 2]


def test_close_after_a_tier_failure_waits_for_the_persistent_save(tmp_path, monkeypatch):
    ram, url = tmp_path / "ram", str(tmp_path / "run")
    committing, release = threading.Event(), threading.Event()
    real_write_own, real_commit = _local.LocalStore.write_own, _storage.FileSystemWriter.commit

    def write_own(self, step, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_own(self, step, *args, **kwargs)

    def commit(self, metadata):
        if "step_00000002" in str(self.root) and str(ram) not in str(self.root):
            committing.set()
            release.wait(30)
        return real_commit(self, metadata)

    monkeypatch.setattr(_local.LocalStore, "write_own", write_own)
    monkeypatch.setattr(_storage.FileSystemWriter, "commit", commit)
    mgr = CheckpointManager(url, 1, local_tier=LocalTier(directory=ram), **NO_SIGNAL)
    mgr.save(1, _state(1))
    mgr.save_async(2, _state(2))
    assert committing.wait(30)
    threading.Timer(0.5, release.set).start()
    with pytest.raises(CheckpointError, match="local checkpoint tier: saving step 2"):
        mgr.close()
    assert not os.path.exists(os.path.join(url, "manager.lease"))  # freed only now
    with CheckpointManager(url, 1, **NO_SIGNAL) as again:
        assert again.all_steps() == [1, 2]
        assert torch.equal(again.restore(2, _state(0))["w"], _state(2)["w"])


def test_ctrl_c_in_a_save_leaves_the_step_to_save_again(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    real = _storage.FileSystemWriter.write_file
    armed = [True]

    def write_file(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if armed[0] and "step_00000002" in str(self.root):
            armed[0] = False
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(_storage.FileSystemWriter, "write_file", write_file)
    with CheckpointManager(url, 1, **NO_SIGNAL) as mgr:
        mgr.save(1, _state(1))
        with pytest.raises(KeyboardInterrupt):
            mgr.save(2, _state(2))
        assert mgr.all_steps() == [1] and mgr.should_save(2)
        assert mgr.save(2, _state(2))  # what the interrupted save left is replaced
        assert mgr.all_steps() == [1, 2]
        assert torch.equal(mgr.restore(2, _state(0))["w"], _state(2)["w"])


def _sleep() -> None:
    import time

    time.sleep(60)


def test_a_forked_child_stops_on_sigterm(tmp_path):
    """A DataLoader worker or helper forked after the manager is not the training
    process: it gets the previous SIGTERM handler back, so terminate() stops it."""
    with CheckpointManager(str(tmp_path / "run"), 1):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        child = mp.get_context("fork").Process(target=_sleep)
        child.start()
        try:
            child.join(0.3)  # let it start sleeping
            child.terminate()
            child.join(20)
            assert child.exitcode == -signal.SIGTERM
        finally:
            if child.is_alive():
                child.kill()
                child.join()
