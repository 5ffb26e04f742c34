"""Two ranks: plain values only some ranks hold are saved, and a load that fails on one
rank fails on every rank, as with torch's DCP.

Found side by side with torch DCP (2026-11-28): values only rank 1 held were dropped at
save without a word, and a load that failed on rank 1 (a shape mismatch, a damaged chunk
only rank 1 reads) returned normally on rank 0, so ``try: load() except: start fresh``
left the ranks in different states.
"""

from __future__ import annotations

import os
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as tdcp
from harness import run_ranks

import shardkit.checkpoint as dcp
import shardkit.spmd as xs


def _values_body(tmp: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for name, lib in (("shardkit", dcp), ("torch", tdcp)):
        path = os.path.join(tmp, name)
        state = {"t": torch.ones(2), "common": rank, "extra": {"a": 1}}
        if rank == 1:
            state["r1_val"] = 5
            state["extra"]["per_rank"] = {"seed": 1234}
        lib.save(state, checkpoint_id=path)
        got = {"t": torch.zeros(2), "common": -1, "r1_val": 0,
               "extra": {"a": 0, "per_rank": {"seed": 0}}}  # fmt: skip
        lib.load(got, checkpoint_id=path)
        out[name] = {k: v for k, v in got.items() if k != "t"}
    return out


def test_values_only_one_rank_holds_are_saved_as_in_torch(tmp_path):
    for r in run_ranks(_values_body, 2, str(tmp_path)):
        # a value every rank holds: shardkit keeps rank 0's copy; torch one rank's,
        # chosen by balancing its write plans (rank 1's here)
        assert r["shardkit"].pop("common") == 0, r
        assert r["torch"].pop("common") in (0, 1), r
        assert r["shardkit"] == r["torch"] == {
            "r1_val": 5,
            "extra": {"a": 1, "per_rank": {"seed": 1234}},
        }, r


def _objects_body(tmp: str) -> dict:
    rank = dist.get_rank()
    out = {}
    for name, lib, save_kw, load_kw in (
        (
            "shardkit",
            dcp,
            {"planner": dcp.DefaultSavePlanner(allow_pickle=True)},
            {"planner": dcp.DefaultLoadPlanner(allow_pickle=True)},
        ),
        ("torch", tdcp, {}, {}),
    ):
        path = os.path.join(tmp, name)
        state = {"t": torch.ones(2), f"r{rank}_obj": Fraction(rank + 1, 3)}
        lib.save(state, checkpoint_id=path, **save_kw)
        got = {"t": torch.zeros(2), "r0_obj": Fraction(0), "r1_obj": Fraction(0)}
        lib.load(got, checkpoint_id=path, **load_kw)
        out[name] = {k: v for k, v in got.items() if k != "t"}
    return out


def test_pickled_values_only_one_rank_holds_are_saved_as_in_torch(tmp_path):
    # each rank's own pickled value, rank 1's included (it was dropped: only rank 0
    # wrote pickles), and each rank reads both back
    for r in run_ranks(_objects_body, 2, str(tmp_path)):
        assert r["shardkit"] == r["torch"] == {
            "r0_obj": Fraction(1, 3),
            "r1_obj": Fraction(2, 3),
        }, r


def _failing_load_body(tmp: str, how: str) -> dict:
    rank = dist.get_rank()
    mesh = xs.Mesh([0, 1], (2,), ("data",))
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    path = os.path.join(tmp, "ckpt")
    dcp.save({"w": xs.mark_sharding(full.clone(), mesh, ("data", None))}, checkpoint_id=path)
    dist.barrier()
    if how == "damaged" and rank == 0:  # damage a byte that only rank 1's rows cover
        md = dcp.read_metadata(path)
        (chunk,) = [c for c in md.tensors["w"].chunks if c.box.offsets[0] == 32]
        with open(os.path.join(path, chunk.file), "r+b") as f:
            f.seek(chunk.offset + 8)
            f.write(b"\xff\xff\xff\xff")
    dist.barrier()
    # "shape": rank 1 alone gives the tensor another global shape
    rows = 62 if how == "shape" and rank == 1 else 64
    state = {"w": xs.mark_sharding(torch.zeros(rows, 4), mesh, ("data", None))}
    try:
        dcp.load(state, checkpoint_id=path)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "untouched": bool((state["w"].local_tensor() == 0).all())}


def test_a_load_failing_on_one_rank_fails_on_every_rank_before_anything_is_read(tmp_path):
    res = run_ranks(_failing_load_body, 2, str(tmp_path), "shape")
    assert res[1]["error"] and "StateDictMismatchError" in res[1]["error"], res
    assert res[0]["error"] and "rank(s) [1]" in res[0]["error"], res
    assert res[0]["untouched"] and res[1]["untouched"], res  # checked before any read


def test_a_damaged_chunk_one_rank_reads_fails_the_load_on_every_rank(tmp_path):
    res = run_ranks(_failing_load_body, 2, str(tmp_path), "damaged")
    assert res[1]["error"] and "checksum mismatch" in res[1]["error"], res
    assert res[0]["error"] and "rank(s) [1]" in res[0]["error"], res
