"""Per-rank program of the two-machine RAM-tier tests (one rank per "machine").

``train DIR RAM STEPS``: saves steps 0..STEPS-1 (RAM tier every step, storage every 5)
of a state whose shard is a function of (rank, step), waits until every copy and replica
has landed, prints ``READY rank pid`` and waits to be SIGKILLed: the copies stay in RAM.
``restore DIR RAM``: restores the newest step every rank can get, checks it bit-exactly
against the expected shard and prints ``RESTORED rank step tier tiers_by_rank``.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

from shardkit import runtime as xr
from shardkit import spmd as xs
from shardkit.checkpoint import CheckpointManager, LocalTier

N = 1 << 16  # floats per shard


def shard(rank: int, step: int) -> torch.Tensor:
    return torch.randn(1, N, generator=torch.Generator().manual_seed(1000 * step + rank))


def state(local: torch.Tensor) -> dict:
    world = xr.world_size()
    mesh = xs.Mesh(list(range(world)), (world,), ("rank",))
    return {"w": xs.ShardedTensor.from_local(local, mesh, ("rank", None), (world, N))}


def main(mode: str, path: str, ram: str, steps: int = 0) -> None:
    xr.init(backend="gloo")
    rank = xr.global_ordinal()
    tier = LocalTier(interval=1, directory=ram, max_to_keep=2)
    mgr = CheckpointManager(path, 5, max_to_keep=2, local_tier=tier, chkpt_on_preemption=False)
    if mode == "train":
        for step in range(steps):
            mgr.save_async(step, state(shard(rank, step)))
        mgr.join()  # every local copy and replica written
        dist.barrier()
        print(f"READY {rank} {os.getpid()}", flush=True)
        signal.pause()  # until the test SIGKILLs this "machine"
    step = mgr.latest_step()
    out = mgr.restore(step, state(torch.zeros(1, N)))
    assert torch.equal(out["w"].local_tensor(), shard(rank, step)), (rank, step)
    info = mgr.last_restore
    print(f"RESTORED {rank} {step} {info.tier} {','.join(info.tiers_by_rank)}", flush=True)
    mgr.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:]))
