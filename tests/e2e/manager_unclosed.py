"""A user script that never closes its CheckpointManager (nor tears anything down)."""

import json
import os
import sys

import torch

from shardkit.checkpoint import CheckpointManager, LocalTier

out, tiers = sys.argv[1], sys.argv[2] == "tiers"
rank = int(os.environ["RANK"])
local = LocalTier(interval=1, directory=os.path.join(out, "ram", str(rank))) if tiers else None
mgr = CheckpointManager(os.path.join(out, "ckpt"), save_interval=2, local_tier=local)
state = {"w": torch.arange(8.0)}  # replicated: the same on every rank
for step in range(1, 4):
    state["w"].add_(1.0)
    mgr.save_async(step, state)
line = {"rank": rank, "world": torch.distributed.get_world_size(), "latest": mgr.latest_step()}
os.write(1, f"RESULT {json.dumps(line)}\n".encode())  # one write: ranks share the pipe
