"""Under torchrun with no init call: FSDP shards, DDP averages, a checkpoint records N ranks.

Run by tests/e2e/test_torchrun.py; each rank prints one JSON line prefixed ``RESULT``.
"""

import json
import sys

import torch
from torch import nn

import shardkit.checkpoint as dist_cp
from shardkit.ddp import DistributedDataParallel as DDP
from shardkit.fsdp import FSDP

path = sys.argv[1]

torch.manual_seed(0)
fsdp = FSDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))  # joins the world
full = 16 * 32 + 32 + 32 * 4 + 4
held = sum(p.numel() for p in fsdp.parameters())

rank = fsdp.rank
torch.manual_seed(100 + rank)  # every rank its own initial weights ...
ddp = DDP(nn.Linear(8, 3))  # ... until DDP broadcasts rank 0's
batch = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))  # and its own data
local = nn.Linear(8, 3)
local.load_state_dict(ddp.module.state_dict())
ddp(batch).square().sum().backward()
local(batch).square().sum().backward()  # this rank's own, unaveraged gradient
grad = ddp.module.weight.grad.flatten().tolist()
own = local.weight.grad.flatten().tolist()

torch.manual_seed(0)
md = dist_cp.save({"w": torch.randn(4, 4), "fsdp": fsdp.state_dict()}, checkpoint_id=path)

result = dict(
    rank=rank,
    world=fsdp.world_size,
    held=held,
    full=full,
    grad=grad,
    own=own,
    saved_world=md.world_size,
)
# One write per line: print() writes the text and the newline separately when unbuffered,
# so another rank's line could land between them on the shared pipe.
sys.stdout.write("RESULT " + json.dumps(result) + "\n")
sys.stdout.flush()
