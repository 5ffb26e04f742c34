"""Checkpoint calls whose ranks disagree raise on every rank, or warn, never pass silently.

Found by an audit of rank-divergent inputs (2026-11-29): each case below used to return
normally: ``async_save`` of a tensor shaped differently per rank only warned (``save``
raised); a plain value such as ``step`` that differed kept rank 0's without a word;
``restore`` and ``load`` of a different step or checkpoint per rank left the ranks with
different models; ``save`` to a per-rank path committed metadata naming files rank 0
could not see, and the load then called the checkpoint damaged.
"""

from __future__ import annotations

import os

import torch
from harness import outcome, run_ranks



def _body(tmp):
    import warnings

    import torch.distributed as dist

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint import ReplicaMismatchWarning

    rank = dist.get_rank()
    out = {}
    w = torch.arange(16.0).reshape(4, 4)

    # a tensor shaped differently per rank: async_save refuses it as save does
    shaped = {"w": w if rank == 0 else torch.zeros(8, 4)}
    out["async_shape"] = outcome(
        lambda: dcp.async_save(shaped, checkpoint_id=f"{tmp}/shape").result(timeout=60)
    )
    out["async_shape_files"] = (
        sorted(os.listdir(f"{tmp}/shape")) if os.path.isdir(f"{tmp}/shape") else []
    )

    # a plain value that differs: saved (rank 0's) with a warning naming it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"w": w, "step": 10 + rank}, checkpoint_id=f"{tmp}/value")
    out["value_warned"] = [
        str(c.message) for c in caught if issubclass(c.category, ReplicaMismatchWarning)
    ]
    back = {"w": torch.zeros(4, 4), "step": -1}
    dcp.load(back, checkpoint_id=f"{tmp}/value")
    out["value_loaded"] = back["step"]

    # a different checkpoint per rank in one load
    dcp.save({"w": w + 1}, checkpoint_id=f"{tmp}/other")
    mine = f"{tmp}/value" if rank == 0 else f"{tmp}/other"
    out["load_two"] = outcome(lambda: dcp.load({"w": torch.zeros(4, 4)}, checkpoint_id=mine))

    # save to a path that differs per rank: refused before the commit, nothing left
    # (4 MiB, so that both ranks write pieces of it)
    big = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    per_rank = f"{tmp}/per_rank_{rank}"
    out["save_two"] = outcome(lambda: dcp.save({"big": big}, checkpoint_id=per_rank))
    dist.barrier()
    out["save_two_left"] = sorted(os.listdir(per_rank)) if os.path.isdir(per_rank) else []

    # the manager: restoring a different step per rank
    with dcp.CheckpointManager(f"{tmp}/mgr", 1, chkpt_on_preemption=False) as mgr:
        mgr.save(1, {"w": w})
        mgr.save(2, {"w": w * 2})
        out["restore_two"] = outcome(lambda: mgr.restore(1 + rank, {"w": torch.zeros(4, 4)}))
        got = mgr.restore(2, {"w": torch.zeros(4, 4)})
        out["restore_same"] = torch.equal(got["w"], w * 2)
        # save on one rank, save_async on the other: the blocking one waited for good
        call = mgr.save if rank == 0 else mgr.save_async
        out["save_or_async"] = outcome(lambda: call(3, {"w": w}))
        out["after"] = mgr.save(4, {"w": w}) and mgr.all_steps()[-1]
    return out


def test_checkpoint_calls_whose_ranks_disagree_fail_or_warn_on_every_rank(tmp_path):
    for rank, r in enumerate(run_ranks(_body, 2, str(tmp_path))):
        assert r["async_shape"].startswith("ValueError"), r["async_shape"]
        assert (
            "'w' is torch.float32 [4, 4] on rank 0 but torch.float32 [8, 4] on rank 1"
            in r["async_shape"]
        )
        assert "metadata.json" not in r["async_shape_files"], r["async_shape_files"]
        assert len(r["value_warned"]) == 1, r["value_warned"]
        assert "'step': ranks [1]" in r["value_warned"][0], r["value_warned"]
        assert r["value_loaded"] == 10
        assert r["load_two"].startswith("ValueError: the ranks are loading different"), r[
            "load_two"
        ]
        assert "CheckpointError" in r["save_two"], r["save_two"]
        assert "not in" in r["save_two"] and "rank 1" in r["save_two"], r["save_two"]
        assert r["save_two_left"] == [], (rank, r["save_two_left"])
        assert r["restore_two"].startswith("ValueError: the ranks passed steps from 1 to 2")
        assert r["restore_same"]
        assert r["save_or_async"].startswith("ValueError: some ranks called save()"), r
        assert r["after"] == 4
