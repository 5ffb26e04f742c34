"""Multi-rank checkpointing: the resharding matrix, DTensor, failures on one rank, async.

One 4-rank launch saves a 2x2-mesh state (and checks failure handling and async); the
same checkpoint then loads on 2 ranks (other specs), 3 ranks (uneven) and 1 process.
"""

import math

import torch
from harness import run_ranks

import shardkit.checkpoint as dcp

# key -> (global shape, dtype, spec on the 2x2 mesh ("x", "y"))
SAVED = {
    "a": ((8, 6), torch.float32, ("x", "y")),
    "b": ((7, 5), torch.float64, (("x", "y"), None)),
    "c": ((6, 4), torch.int32, (None, "y")),
    "bf": ((5,), torch.bfloat16, ("x",)),
    "rep": ((10, 3), torch.float32, None),  # a plain tensor: replicated
}
# specs on the 1-d mesh ("x",) used when loading on 2 and 3 ranks
LOAD_SPECS = {"a": (None, "x"), "b": ("x", None), "c": ("x", None), "bf": (None,)}
LOAD_SPECS_3 = {"a": (None, "x"), "b": ("x", None), "c": ("x", None), "bf": ("x",)}  # uneven


def _full(key):
    shape, dtype, _ = SAVED[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return (torch.randn(shape, generator=g) * 50).to(dtype)


def _values():
    return {"step": 42, "sched": {"milestones": [1, 2], "gamma": 0.5}}


class _FailOnRank(dcp.FileSystemWriter):
    def __init__(self, path, rank):
        super().__init__(path)
        self.fail = rank

    def write_file(self, name, parts):
        import torch.distributed as dist

        if dist.get_rank() == self.fail:
            raise OSError("injected write failure")
        super().write_file(name, parts)


def _expect_failure(fn, rank, bad_rank, own_type):
    try:
        fn()
    except dcp.CheckpointError as exc:
        assert rank != bad_rank and f"rank(s) [{bad_rank}]" in str(exc), (rank, exc)
        return
    except own_type:
        assert rank == bad_rank
        return
    raise AssertionError(f"rank {rank} did not raise")


def _save_4(path):
    import torch.distributed as dist

    import shardkit.spmd as xs
    from shardkit.checkpoint._core import _format

    _format.BLOCK_BYTES = 16  # row-sized checksum blocks, so partial reads are row-exact
    rank = dist.get_rank()
    mesh = xs.Mesh([0, 1, 2, 3], (2, 2), ("x", "y"))
    sd = {"model": {}, **_values()}
    for key, (_, _, spec) in SAVED.items():
        full = _full(key)
        sd["model"][key] = full if spec is None else xs.mark_sharding(full, mesh, spec)
    md = dcp.save(sd, checkpoint_id=f"{path}/main")
    written = sum(
        c.nbytes for t in md.tensors.values() for c in t.chunks if f"-{rank:05d}-" in c.file
    )

    # an error on one rank: every rank raises, nothing is committed, nobody hangs
    bad = dict(sd, extra=object() if rank == 2 else 1)
    _expect_failure(lambda: dcp.save(bad, checkpoint_id=f"{path}/bad"), rank, 2, TypeError)
    writer = _FailOnRank(f"{path}/bad", 1)
    _expect_failure(lambda: dcp.save(sd, storage_writer=writer), rank, 1, OSError)
    assert not dcp.is_committed(f"{path}/bad")

    # async: staging returns at once; a failure on one rank comes out of every Future
    fut = dcp.async_save(sd, checkpoint_id=f"{path}/async")
    for t in sd["model"].values():
        t.zero_() if not isinstance(t, xs.ShardedTensor) else t.local_tensor().detach().zero_()
    md_async = fut.result(timeout=60)
    fut = dcp.async_save(sd, storage_writer=_FailOnRank(f"{path}/async-bad", 3))
    _expect_failure(lambda: fut.result(timeout=60), rank, 3, OSError)
    assert not dcp.is_committed(f"{path}/async-bad")

    # a subgroup saves on its own: ranks 0 and 1 only, sync and async
    sub = dist.new_group([0, 1])  # every rank takes part in creating it
    if rank in (0, 1):
        part = {"x": torch.full((4,), 7.0), "who": "pair"}
        dcp.save(part, checkpoint_id=f"{path}/pair", process_group=sub)
        dcp.async_save(part, checkpoint_id=f"{path}/pair-async", process_group=sub).result(60)
        assert dcp.read_metadata(f"{path}/pair-async").world_size == 2
    dist.barrier()
    return written, sorted(md.keys()), md_async.save_id


def _load_on_mesh(path, specs, world):
    import torch.distributed as dist

    import shardkit.spmd as xs

    mesh = xs.Mesh(list(range(world)), (world,), ("x",))
    sd = {"model": {}, "step": 0, "sched": None}
    for key, (shape, dtype, _) in SAVED.items():
        empty = torch.zeros(shape, dtype=dtype)
        sd["model"][key] = empty if key == "rep" else xs.mark_sharding(empty, mesh, specs[key])
    for name in ("main", "async"):
        dcp.load(sd, checkpoint_id=f"{path}/{name}")
        for key, t in sd["model"].items():
            got = t if key == "rep" else t.full_tensor()
            assert torch.equal(got, _full(key)), (name, key, dist.get_rank())
        assert {"step": sd["step"], "sched": sd["sched"]} == _values()

    # only the overlapping rows are read: "b" costs exactly this rank's rows (reads at
    # offset 0 are the files' safetensors headers, checked against the metadata)
    reads = []

    class Counting(dcp.FileSystemReader):
        def read_into(self, name, offset, out):
            if offset:
                reads.append(len(memoryview(out).cast("B")))
            super().read_into(name, offset, out)

    b = sd["model"]["b"]
    dcp.load({"model": {"b": b}}, storage_reader=Counting(f"{path}/main"), strict=False)
    return sum(reads), b.local_tensor().numel() * b.dtype.itemsize


def _load_2_and_dtensor(path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.spmd as xs

    result = _load_on_mesh(path, LOAD_SPECS, 2)
    # DTensor (torch FSDP2 / TP layout) saved on 2 ranks loads into ShardedTensor, and back
    dmesh = init_device_mesh("cpu", (2,))
    w, v = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.arange(5.0)
    dcp.save(
        {
            "w": distribute_tensor(w, dmesh, [Shard(0)]),
            "v": distribute_tensor(v, dmesh, [Replicate()]),
        },
        checkpoint_id=f"{path}/dt",
    )
    mesh = xs.Mesh([0, 1], (2,), ("x",))
    target = {"w": xs.mark_sharding(torch.zeros(6, 4), mesh, (None, "x")),
              "v": xs.mark_sharding(torch.zeros(5), mesh, ("x",))}  # fmt: skip
    dcp.load(target, checkpoint_id=f"{path}/dt")
    assert torch.equal(target["w"].full_tensor(), w) and torch.equal(target["v"].full_tensor(), v)
    back = {"w": distribute_tensor(torch.zeros(6, 4), dmesh, [Shard(1)]),
            "v": distribute_tensor(torch.zeros(5), dmesh, [Shard(0)])}  # fmt: skip
    dcp.load(back, checkpoint_id=f"{path}/dt")
    assert torch.equal(back["w"].full_tensor(), w) and torch.equal(back["v"].full_tensor(), v)
    assert dist.get_world_size() == 2
    return result


def _load_3(path):
    return _load_on_mesh(path, LOAD_SPECS_3, 3)


def test_resharding_matrix(tmp_path):
    path = str(tmp_path)
    results = run_ranks(_save_4, 4, path, timeout=120)
    total = sum(math.prod(s) * d.itemsize for s, d, _ in SAVED.values())
    written = [w for w, _, _ in results]
    assert sum(written) == total  # every byte exactly once, replicated data included
    assert max(written) - min(written) <= total // 4  # spread over the ranks
    assert results[0][1] == sorted([f"model.{k}" for k in SAVED] + ["sched", "step"])

    for read, local in run_ranks(_load_2_and_dtensor, 2, path, timeout=120):
        assert read == local
    for read, local in run_ranks(_load_3, 3, path, timeout=120):
        assert read == local

    # one process, no process group: plain tensors
    sd = {"model": {k: torch.zeros(s, dtype=d) for k, (s, d, _) in SAVED.items()}}
    sd.update(step=None, sched=None)
    dcp.load(sd, checkpoint_id=f"{path}/main")
    for key, t in sd["model"].items():
        assert torch.equal(t, _full(key)), key
    assert sd["step"] == 42


def _only_rank_zero_saves(path):
    import datetime
    import os
    import time

    import torch.distributed as dist

    import shardkit.checkpoint as dcp

    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    done = f"{path}.done"  # rank 1 stays up until rank 0 is through (else: peer closed)
    if dist.get_rank() != 0:  # never calls save: the classic `if rank == 0: save(...)`
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    try:
        dcp.save({"x": torch.ones(2)}, checkpoint_id=path, process_group=group)
    except dcp.CheckpointError as exc:
        return str(exc)
    finally:
        open(done, "w").close()
    return "saved"


def test_a_save_only_one_rank_calls_says_why_it_timed_out(tmp_path):
    """Before, rank 0 waited for the group's timeout and then failed with gloo's bare
    "Timed out waiting ... for recv operation", which does not name the mistake."""
    message, other = run_ranks(_only_rank_zero_saves, 2, str(tmp_path / "c"), timeout=90)
    assert other is None
    assert "rank 0: the other ranks did not join" in message, message
    assert "call them on every rank" in message and "no_dist=True" in message
    assert not (tmp_path / "c" / "metadata.json").exists()
