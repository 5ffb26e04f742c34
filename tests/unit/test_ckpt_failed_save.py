"""A save that fails part-way (ENOSPC) removes its own partial files at once.

Without that, a full disk stays full of the failed save's files, and every following
save fails too until some later save succeeds and cleans up.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _storage


def _state(v: float) -> dict:
    return {"a": torch.full((256, 64), v), "b": torch.full((128, 64), -v)}


@pytest.fixture
def disk_full_after(monkeypatch):
    """Make local data files fail with ENOSPC after ``limit[0]`` bytes of them."""
    limit = [None]
    real = _storage._write_local

    def write(path, parts, *, exclusive, sync, **kw):
        def limited():
            written = 0
            for part in parts:
                if limit[0] is not None and "data-" in path and written + len(part) > limit[0]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                written += len(part)
                yield part

        real(path, limited(), exclusive=exclusive, sync=sync, **kw)

    monkeypatch.setattr(_storage, "_write_local", write)
    return limit


def test_enospc_leaves_no_partial_file_and_keeps_the_old_checkpoint(tmp_path, disk_full_after):
    path = str(tmp_path / "ckpt")
    dcp.save(_state(1.0), storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    before = sorted(os.listdir(path))
    disk_full_after[0] = 40_000  # the bigger file (64 KiB) fails part-way
    with pytest.raises(OSError, match="No space left"):
        dcp.save(_state(2.0), storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    assert sorted(os.listdir(path)) == before  # nothing of the failed save is left
    got = {"a": torch.zeros(256, 64), "b": torch.zeros(128, 64)}
    dcp.load(got, checkpoint_id=path)
    assert torch.equal(got["a"], _state(1.0)["a"]) and torch.equal(got["b"], _state(1.0)["b"])
    disk_full_after[0] = None  # space is back: the next save succeeds
    dcp.save(_state(3.0), storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    dcp.load(got, checkpoint_id=path)
    assert torch.equal(got["a"], _state(3.0)["a"])


def test_failed_metadata_commit_leaves_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    real = _storage._write_local

    def write(p, parts, *, exclusive, sync, **kw):
        if ".tmp-" in p:
            real(p, [b"{partial"], exclusive=exclusive, sync=sync, **kw)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
        real(p, parts, exclusive=exclusive, sync=sync, **kw)

    monkeypatch.setattr(_storage, "_write_local", write)
    with pytest.raises(OSError, match="No space left"):
        dcp.save(_state(1.0), checkpoint_id=path)
    # nothing committed, so nothing of the save is left: the data files and the
    # directory the save made are gone too
    assert not os.path.exists(path)
    assert not dcp.is_committed(path)


def test_a_commit_that_landed_before_failing_keeps_its_files(tmp_path, monkeypatch):
    """An object store may store the metadata and still raise (a timeout after the PUT):
    the data files of that committed checkpoint must stay."""
    path = str(tmp_path / "ckpt")
    real = _storage.FileSystemWriter.commit

    def commit_then_fail(self, metadata):
        real(self, metadata)
        raise TimeoutError("connection lost after the upload")

    monkeypatch.setattr(_storage.FileSystemWriter, "commit", commit_then_fail)
    with pytest.raises(TimeoutError):
        dcp.save(_state(1.0), checkpoint_id=path)
    got = {"a": torch.zeros(256, 64), "b": torch.zeros(128, 64)}
    dcp.load(got, checkpoint_id=path)
    assert torch.equal(got["a"], _state(1.0)["a"]) and torch.equal(got["b"], _state(1.0)["b"])


def test_failed_save_removes_the_directory_it_made(tmp_path, disk_full_after):
    disk_full_after[0] = 40_000
    path = tmp_path / "runs" / "ckpt"
    with pytest.raises(OSError, match="No space left"):
        dcp.save(_state(1.0), storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    assert not path.exists()
    assert os.listdir(tmp_path / "runs") == []  # only the leaf: parents may be shared


def test_failed_save_keeps_a_directory_it_did_not_make(tmp_path, disk_full_after):
    disk_full_after[0] = 40_000
    path = tmp_path / "ckpt"
    path.mkdir()  # the user's directory, empty before the save
    with pytest.raises(OSError, match="No space left"):
        dcp.save(_state(1.0), checkpoint_id=path)
    assert path.is_dir() and os.listdir(path) == []


def test_failed_async_save_removes_the_directory_it_made(tmp_path, disk_full_after):
    disk_full_after[0] = 40_000
    path = tmp_path / "ckpt"
    weights = _state(1.0)
    with pytest.raises(OSError, match="No space left"):
        dcp.async_save(weights, checkpoint_id=path).result(timeout=60)
    assert not path.exists()


def test_a_write_error_names_the_file(tmp_path, monkeypatch):
    """write() and fsync() errors carry no file name: a full disk said only "[Errno 28]
    No space left on device", not where."""
    real = os.write

    def full(fd, data):
        if len(data) > 1000:  # the data files, not the small metadata
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(_storage.os, "write", full)
    with pytest.raises(OSError) as info:
        dcp.save(_state(1.0), checkpoint_id=tmp_path / "c")
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename and info.value.filename.startswith(str(tmp_path / "c"))
    assert str(tmp_path / "c") in str(info.value)
