"""Non-local and failing storage, as found by a storage audit (2026-11-29):

- ``memory://g/exp[1]``: fsspec's ``rm`` read ``[1]`` as a glob, so retention in run
  ``exp[1]`` deleted the steps of run ``exp1``; such paths are now refused;
- a failed commit on a store without atomic writes truncated the previous checkpoint's
  ``metadata.json`` (``pipe_file`` rewrites the live file there); the lease file too, and
  a torn lease then stopped every later save as "taken over";
- a relative run path followed by ``os.chdir`` split the run over two directories;
- ``CheckpointManager("memory://")`` wrote to a local directory named ``memory:``;
- a transient read error while listing made ``latest_step`` answer an older step;
- a reused ``FileSystemWriter(overwrite=False)`` checked only its first save;
- ``simplecache::memory://`` on several ranks was not refused like ``memory://``.
"""

from __future__ import annotations

import errno
import os

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CheckpointError, CheckpointManager
from shardkit.checkpoint._core._fs_rules import refuse_per_process


class _FailingFS(MemoryFileSystem):
    """A private in-memory store whose writes of chosen files fail half-way (torn)."""

    protocol = "failingmem"
    store: dict = {}
    pseudo_dirs = [""]
    tear: tuple[str, ...] = ()  # file name endings whose next write is torn
    fail_reads: dict[str, int] = {}  # name ending -> how many reads fail with EIO

    def _torn(self, path: str) -> bool:
        for ending in self.tear:
            if ending in path:
                _FailingFS.tear = tuple(e for e in self.tear if e != ending)
                return True
        return False

    def pipe_file(self, path, value, **kwargs):
        if self._torn(path):
            super().pipe_file(path, bytes(value)[: len(value) // 2], **kwargs)
            raise OSError(errno.EIO, "torn write")
        return super().pipe_file(path, value, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" in mode and self._torn(path):
            write = f.write

            def torn(data):
                write(bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")

            f.write = torn
        return f

    def cat_file(self, path, *args, **kwargs):
        for ending, left in self.fail_reads.items():
            if path.endswith(ending) and left:
                self.fail_reads[ending] = left - 1
                raise OSError(errno.EIO, "injected I/O error")
        return super().cat_file(path, *args, **kwargs)


@pytest.fixture
def failing_fs():
    fsspec.register_implementation("failingmem", _FailingFS, clobber=True)
    _FailingFS.store.clear()
    _FailingFS.pseudo_dirs[:] = [""]
    _FailingFS.tear, _FailingFS.fail_reads = (), {}
    yield _FailingFS
    _FailingFS.store.clear()
    _FailingFS.tear, _FailingFS.fail_reads = (), {}


def _state(value):
    return {"w": torch.full((4, 4), float(value))}


def _manager(url, **kwargs):
    return CheckpointManager(url, 1, chkpt_on_preemption=False, **kwargs)


@pytest.mark.parametrize("url", ["memory://g/exp[1]", "memory://g/exp*", "memory://g/e?p"])
def test_glob_characters_in_non_local_paths_are_refused_before_anything_is_written(url):
    fs = fsspec.filesystem("memory")
    fs.pipe("/g/exp1/step_00000000/metadata.json", b"{}")  # another run beside it
    before = sorted(fs.find("/g"))
    with pytest.raises(ValueError, match="glob pattern"):
        _manager(url)
    with pytest.raises(ValueError, match="glob pattern"):
        dcp.save(_state(1), checkpoint_id=f"{url}/one")
    assert sorted(fs.find("/g")) == before
    fs.rm("/g", recursive=True)


def test_glob_characters_in_local_paths_still_work(tmp_path):
    steps = {}
    for name, keep in (("exp1", 0), ("exp[1]", 1)):  # exp1 keeps all; exp[1] prunes
        with _manager(str(tmp_path / name), max_to_keep=keep) as mgr:
            for step in range(3):
                mgr.save(step, _state(step))
            got = _state(0)
            mgr.restore(2, got)
        assert torch.equal(got["w"], _state(2)["w"])
    for name in ("exp1", "exp[1]"):
        with _manager(str(tmp_path / name), read_only=True) as mgr:
            steps[name] = mgr.all_steps()
    assert steps["exp1"] == [0, 1, 2]
    assert 0 not in steps["exp[1]"] and 2 in steps["exp[1]"]


def test_a_torn_commit_leaves_the_previous_checkpoint_whole(failing_fs):
    url = "failingmem://torn/ck"
    dcp.save(_state(1), checkpoint_id=url)
    failing_fs.tear = ("metadata.json",)
    with pytest.raises(OSError, match="metadata.json"):  # the error names the file
        dcp.save(_state(2), checkpoint_id=url)
    assert failing_fs.tear == ()  # the torn write really happened
    assert dcp.is_committed(url)
    got = _state(0)
    dcp.load(got, checkpoint_id=url)
    assert torch.equal(got["w"], _state(1)["w"])
    assert not [p for p in failing_fs().find("/torn") if ".tmp-" in p]


def test_a_failed_lease_renewal_leaves_the_lease_whole_and_saving_goes_on(failing_fs):
    with _manager("failingmem://lease/run", max_to_keep=0) as mgr:
        mgr.save(0, _state(0))
        failing_fs.tear = ("manager.lease",)
        with pytest.raises(OSError):
            mgr._lease.renew()  # the heartbeat's renewal fails half-way
        assert failing_fs.tear == ()  # the torn write really happened
        for step in (1, 2):
            assert mgr.save(step, _state(step))
        assert mgr.all_steps() == [0, 1, 2]


def test_the_lease_holder_rewrites_a_lease_it_finds_torn(failing_fs):
    with _manager("failingmem://lease2/run", max_to_keep=0) as mgr:
        mgr.save(0, _state(0))
        failing_fs().pipe_file("/lease2/run/manager.lease", b'{"owner": "me')  # torn
        assert mgr.save(1, _state(1))
        assert mgr.save(2, _state(2), force=True)
        assert mgr.all_steps() == [0, 1, 2]


def test_a_relative_run_path_stays_put_when_the_working_directory_changes(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    monkeypatch.chdir(tmp_path / "one")
    with _manager("runs/a", max_to_keep=0) as mgr:
        mgr.save(1, _state(1))
        os.chdir(tmp_path / "two")  # a launcher or Hydra changes it mid-run
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
        assert mgr.all_steps() == [1, 2, 3]
    run = tmp_path / "one" / "runs" / "a"
    assert sorted(n for n in os.listdir(run) if n.startswith("step_")) == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]
    assert not (tmp_path / "two" / "runs").exists()
    with _manager(str(tmp_path / "one" / "runs" / "a"), read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2, 3]


def test_a_bare_memory_root_is_the_memory_store_not_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    with _manager("memory://", max_to_keep=1) as mgr:
        mgr.save(0, _state(0))
        assert mgr.all_steps() == [0]
    assert os.listdir(tmp_path) == []
    assert fs.exists("/step_00000000/metadata.json")
    fs.rm("/step_00000000", recursive=True)


def test_a_transient_read_error_while_listing_raises_instead_of_an_older_step(failing_fs):
    url = "failingmem://listing/run"
    with _manager(url, max_to_keep=0) as mgr:
        for step in range(3):
            mgr.save(step, _state(step))
    failing_fs.fail_reads = {"step_00000002/metadata.json": 1}
    with pytest.raises(CheckpointError, match="step 2 .*failed .*injected I/O error"):
        _manager(url, read_only=True)
    with _manager(url, read_only=True) as mgr:  # the storage answers again
        assert mgr.latest_step() == 2


def test_a_reused_writer_without_overwrite_refuses_every_save_over_a_checkpoint(tmp_path):
    writer = dcp.FileSystemWriter(str(tmp_path / "a"), overwrite=False)
    dcp.save(_state(1), storage_writer=writer)
    with pytest.raises(CheckpointError, match="already exists"):
        dcp.save(_state(2), storage_writer=writer)
    dcp.save(_state(3), checkpoint_id=str(tmp_path / "b"), storage_writer=writer)  # torch's loop
    with pytest.raises(CheckpointError, match="already exists"):
        dcp.save(_state(4), checkpoint_id=str(tmp_path / "b"), storage_writer=writer)
    for name, value in (("a", 1), ("b", 3)):
        got = _state(0)
        dcp.load(got, checkpoint_id=str(tmp_path / name))
        assert torch.equal(got["w"], _state(value)["w"])


@pytest.mark.parametrize("url", ["memory://x/ck", "simplecache::memory://x/ck", "dir::memory://x"])
def test_memory_behind_a_wrapper_is_refused_on_several_ranks(url):
    fs, _ = fsspec.core.url_to_fs(url)
    refuse_per_process(fs, url, 1)  # one process: fine
    with pytest.raises(ValueError, match="per-process file system"):
        refuse_per_process(fs, url, 2)
