"""A replicated (plain) tensor whose copies differ between ranks is never saved as a mix.

Each rank writes a row slice of a replicated tensor, so before the check a copy that
differed in one element on rank 1 came back as rank 0's rows plus rank 1's rows. Now
the save keeps rank 0's copy whole and warns on every rank, or fails on every rank
when the warning is made an error.
"""

from __future__ import annotations

import os

import torch
from harness import run_ranks

ROWS = 1024  # 4 MiB of float32: split into row pieces written by both ranks


def _copy(rank: int) -> torch.Tensor:
    t = torch.arange(ROWS * 1024, dtype=torch.float32).reshape(ROWS, 1024)
    if rank == 1:
        t[-1, -1] += 1  # one element differs, in the rows rank 1 writes
    return t


def _strided(rank: int) -> torch.Tensor:
    """A non-contiguous replica (hashed from a host copy), differing in one element."""
    t = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64)
    if rank == 1:
        t[0, 0] = -1
    return t.t()


def _body(tmp):
    import warnings

    import torch.distributed as dist

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint import CheckpointError, ReplicaMismatchWarning

    rank = dist.get_rank()
    out = {}
    same = torch.ones(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = {"w": _copy(rank), "same": same, "t": _strided(rank)}
        dcp.save(state, checkpoint_id=f"{tmp}/warn")
    mine = [w for w in caught if issubclass(w.category, ReplicaMismatchWarning)]
    out["warned"] = [str(w.message) for w in mine]
    got = {"w": torch.zeros(ROWS, 1024), "same": torch.zeros(8, 4), "t": torch.zeros(64, 32)}
    dcp.load(got, checkpoint_id=f"{tmp}/warn")
    out["t_is_rank0_copy"] = torch.equal(got["t"], _strided(0))
    out["is_rank0_copy"] = torch.equal(got["w"], _copy(0))
    out["same_ok"] = torch.equal(got["same"], same)
    # equal copies: no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"w": _copy(0)}, checkpoint_id=f"{tmp}/equal")
    out["equal_warned"] = [
        str(w.message) for w in caught if issubclass(w.category, ReplicaMismatchWarning)
    ]
    # the warning as an error fails the save on every rank, before any data is written
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicaMismatchWarning)
        try:
            dcp.save({"w": _copy(rank)}, checkpoint_id=f"{tmp}/strict")
            out["strict"] = None
        except (CheckpointError, ReplicaMismatchWarning) as exc:
            out["strict"] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    out["strict_files"] = (
        sorted(os.listdir(f"{tmp}/strict")) if os.path.isdir(f"{tmp}/strict") else []
    )
    # the same through the manager (the flow of issue 14's FSDP state dicts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dcp.CheckpointManager(f"{tmp}/mgr", 1, chkpt_on_preemption=False) as mgr:
            mgr.save(1, {"w": _copy(rank)})
            got = mgr.restore(1, {"w": torch.zeros(ROWS, 1024)})
    out["mgr_warned"] = any(issubclass(w.category, ReplicaMismatchWarning) for w in caught)
    out["mgr_rank0_copy"] = torch.equal(got["w"], _copy(0))
    return out


def test_differing_replica_saves_one_copy_whole_and_warns(tmp_path):
    for r in run_ranks(_body, 2, str(tmp_path)):
        assert len(r["warned"]) == 1, r["warned"]
        assert "2 replicated (plain) tensor(s) differ" in r["warned"][0], r["warned"]
        assert "'w': ranks [0] vs ranks [1]" in r["warned"][0], r["warned"]
        assert "'t': ranks [0] vs ranks [1]" in r["warned"][0], r["warned"]
        assert r["t_is_rank0_copy"]
        assert "rank(s) [0] whole" in r["warned"][0]
        assert r["is_rank0_copy"] and r["same_ok"]
        assert r["equal_warned"] == []
        assert r["strict"] and "differ between ranks" in r["strict"], r["strict"]
        assert r["strict_files"] == [], r["strict_files"]
        assert r["mgr_warned"] and r["mgr_rank0_copy"]
