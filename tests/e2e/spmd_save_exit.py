"""SPMD + save + async_save, then simply end: no init call, no teardown call.

Run by tests/e2e/test_torchrun.py under ``torchrun --nproc-per-node 3``; every rank must
exit 0 (shardkit joins the world on first use and tears it down at exit).
"""

import sys

import numpy as np
import torch

import shardkit.checkpoint as dist_cp
import shardkit.runtime as xr
import shardkit.spmd as xs

torch.manual_seed(0)
n = xr.world_size()
mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
w = xs.mark_sharding(torch.nn.Parameter(torch.randn(6, 4)), mesh, ("data", None))
x = xs.mark_sharding(torch.randn(5, 6), mesh, (None, "data"))
(x @ w).relu().sum().full_tensor().backward()  # a partial sum resolved over "data"
path = sys.argv[1]
dist_cp.save({"w": w.detach(), "step": 1}, checkpoint_id=f"{path}/sync")
future = dist_cp.async_save({"w": w.detach(), "step": 2}, checkpoint_id=f"{path}/async")
# no future.result(), no destroy_process_group(): the async save is still in flight here
print(f"rank {xr.global_ordinal()} of {n}: shard {tuple(w.local_tensor().shape)}", flush=True)
