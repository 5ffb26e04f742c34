"""A save that fails on one rank leaves nothing behind on any rank: no data file, and
not the directory the save made (a directory that was there before stays)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _storage


def _state(rank: int) -> dict:
    return {
        "replicated": torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64),
        f"own_{rank}": torch.full((128, 64), float(rank)),
    }


def _fail_on(rank: int, failing_rank: int, what: str) -> None:
    """Make this rank's data files (``"data"``) or its metadata commit (``"commit"``) fail
    with ENOSPC, if it is ``failing_rank``."""
    if rank != failing_rank:
        return
    real = _storage._write_local

    def write(path, parts, *, exclusive, sync, **kw):
        if (what == "data" and "data-" in path) or (what == "commit" and ".tmp-" in path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, parts, exclusive=exclusive, sync=sync, **kw)

    _storage._write_local = write


def _body(tmp: str, failing_rank: int, what: str, premade: bool) -> dict:
    rank = dist.get_rank()
    path = os.path.join(tmp, "ckpt")
    if premade and rank == 0:
        os.mkdir(path)
    dist.barrier()
    _fail_on(rank, failing_rank, what)
    try:
        dcp.save(_state(rank), checkpoint_id=path)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # every rank has cleaned up
    return {
        "error": error,
        "left": sorted(os.listdir(path)) if os.path.isdir(path) else None,
        "committed": dcp.is_committed(path),
    }


@pytest.mark.parametrize(
    ("failing_rank", "what"), [(1, "data"), (0, "data"), (0, "commit")], ids=str
)
def test_failed_save_leaves_no_file_and_no_directory_it_made(tmp_path, failing_rank, what):
    res = run_ranks(_body, 2, str(tmp_path), failing_rank, what, False)
    for r in res:
        assert r["error"] and "No space left" in r["error"], r
        assert r["left"] is None and not r["committed"], r
    if failing_rank == 1:  # the other rank says which rank failed
        assert "rank(s) [1]" in res[0]["error"], res[0]["error"]


def test_failed_save_keeps_a_directory_that_was_there(tmp_path):
    res = run_ranks(_body, 2, str(tmp_path), 1, "data", True)
    for r in res:
        assert r["error"] and r["left"] == [] and not r["committed"], r
