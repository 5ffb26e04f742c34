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
        assert "2 replicated tensor(s) differ" in r["warned"][0], r["warned"]
        assert "'w': ranks [0] vs ranks [1]" in r["warned"][0], r["warned"]
        assert "'t': ranks [0] vs ranks [1]" in r["warned"][0], r["warned"]
        assert r["t_is_rank0_copy"]
        assert "'w': ranks [0] vs ranks [1], saved the copy of rank 0" in r["warned"][0]
        assert r["is_rank0_copy"] and r["same_ok"]
        assert r["equal_warned"] == []
        assert r["strict"] and "differ between ranks" in r["strict"], r["strict"]
        assert r["strict_files"] == [], r["strict_files"]
        assert r["mgr_warned"] and r["mgr_rank0_copy"]


def _mismatch_warnings(caught) -> list[str]:
    from shardkit.checkpoint import ReplicaMismatchWarning

    return [str(w.message) for w in caught if issubclass(w.category, ReplicaMismatchWarning)]


def _two(rank: int) -> torch.Tensor:
    """Differs on rank 1 in its first and last element: rows that different ranks write."""
    t = _copy(rank)
    if rank == 1:
        t[0, 0] += 1
    return t


def _switch_body(tmp):
    import warnings

    import torch.distributed as dist

    import shardkit.checkpoint as dcp

    rank = dist.get_rank()
    out = {}

    def load(path):
        got = {"w": torch.zeros(ROWS, 1024)}
        dcp.load(got, checkpoint_id=path)
        return got["w"]

    def saved(fn, path):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn(path)
        return _mismatch_warnings(caught), load(path)

    # off: no check, so the pieces written by each rank are kept as they are (a mix)
    warned, w = saved(
        lambda p: dcp.save({"w": _two(rank)}, checkpoint_id=p, verify_replicas=False),
        f"{tmp}/off",
    )
    out["off"] = (warned, torch.equal(w, _two(0)), torch.equal(w, _two(1)))
    # on, with small file caps: the rewrite of the keeper's whole copy is capped too
    warned, w = saved(
        lambda p: dcp.save(
            {"w": _two(rank)}, storage_writer=dcp.FileSystemWriter(p, max_file_bytes=1 << 19)
        ),
        f"{tmp}/capped",
    )
    out["capped"] = (len(warned), torch.equal(w, _two(0)))
    out["capped_files"] = sorted(n for n in os.listdir(f"{tmp}/capped") if n.startswith("data-"))
    # async_save (checks before staging), on and off
    for name, flag in (("async_on", True), ("async_off", False)):
        warned, w = saved(
            lambda p, f=flag: dcp.async_save(
                {"w": _two(rank)}, checkpoint_id=p, zero_stall=False, verify_replicas=f
            ).result(),
            f"{tmp}/{name}",
        )
        out[name] = (len(warned), torch.equal(w, _two(0)), torch.equal(w, _two(1)))
    # the manager passes its switch on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dcp.CheckpointManager(
            f"{tmp}/mgr", 1, chkpt_on_preemption=False, verify_replicas=False
        ) as mgr:
            mgr.save(1, {"w": _two(rank)})
            got = mgr.restore(1, {"w": torch.zeros(ROWS, 1024)})
    out["mgr_off"] = (_mismatch_warnings(caught), torch.equal(got["w"], _two(0)))
    # equal replicas saved with the check: nothing rewritten, one file per rank
    dcp.save({"w": _two(0)}, checkpoint_id=f"{tmp}/equal")
    out["equal"] = torch.equal(load(f"{tmp}/equal"), _two(0))
    return out


def test_verify_replicas_switch_save_async_and_manager(tmp_path):
    for r in run_ranks(_switch_body, 2, str(tmp_path)):
        assert r["off"] == ([], False, False), r["off"]  # a mix of both copies, no warning
        assert r["capped"] == (1, True), r["capped"]
        # only the files of the final write are left: 4 MiB of rank 0's copy in 512 KiB files
        assert len(r["capped_files"]) == 8, r["capped_files"]
        assert r["async_on"] == (1, True, False), r["async_on"]
        assert r["async_off"] == (0, False, False), r["async_off"]
        assert r["mgr_off"] == ([], False), r["mgr_off"]
        assert r["equal"]


def test_verify_replicas_must_be_a_bool(tmp_path):
    import pytest

    import shardkit.checkpoint as dcp

    state = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match="verify_replicas must be True or False, got 'no'"):
        dcp.save(state, checkpoint_id=str(tmp_path / "a"), verify_replicas="no")
    with pytest.raises(TypeError, match="verify_replicas must be True or False, got 0"):
        dcp.async_save(state, checkpoint_id=str(tmp_path / "b"), verify_replicas=0)
    with pytest.raises(TypeError, match="verify_replicas must be True or False, got None"):
        dcp.CheckpointManager(str(tmp_path / "m"), 1, verify_replicas=None)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
