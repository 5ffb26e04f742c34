"""Megatron-style tensor parallelism by sharding propagation: a transformer block written
for one device, its weights sharded with ``mark_sharding``, its input batch-sharded on a
2-D mesh ``('data', 'model')``. It trains and matches one device.

    python examples/spmd_tensor_parallel.py --nproc 4      # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 examples/spmd_tensor_parallel.py

Column-parallel layers (q, k, v, fc1) split their output features over ``'model'``;
row-parallel layers (o, fc2) split their input features, so each produces a sum pending
over ``'model'`` that is resolved by one all-reduce only when the value is needed (the
next layer norm, or the loss). Every other parameter is replicated; its gradient is a
sum pending over ``'data'``, resolved when it lands in ``.grad`` (data parallelism).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import shardkit.runtime as xr
import shardkit.spmd as xs

#: parameter name -> partition spec (Megatron: column-parallel in, row-parallel out)
TP_PLAN = {
    "q.weight": ("model", None),
    "q.bias": ("model",),
    "k.weight": ("model", None),
    "k.bias": ("model",),
    "v.weight": ("model", None),
    "v.bias": ("model",),
    "o.weight": (None, "model"),
    "fc1.weight": ("model", None),
    "fc1.bias": ("model",),
    "fc2.weight": (None, "model"),
}


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            lin(h).view(b, s, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def shard_block(block: nn.Module, mesh: xs.Mesh) -> nn.Module:
    """Replace every parameter by a sharded one: TP_PLAN's specs, replicated otherwise."""
    return xs.shard_module(block, mesh, TP_PLAN)


def train(steps: int = 5, *, batch: int = 4, seq: int = 6, dim: int = 32) -> dict:
    """Train the block sharded and on one device side by side; returns the comparison."""
    world = xr.world_size()
    model_size = 2 if world % 2 == 0 else world  # an odd world: all of it on "model"
    mesh = xs.Mesh(np.arange(world), (world // model_size, model_size), ("data", "model"))
    torch.manual_seed(0)
    reference = Block(dim)
    sharded = shard_block(copy.deepcopy(reference), mesh)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt_shd = torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    losses, collectives = [], {}
    for step in range(steps):
        x, target = (
            torch.randn(batch, seq, dim, generator=gen),
            torch.randn(batch, seq, dim, generator=gen),
        )
        loss_ref = F.mse_loss(reference(x), target)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()

        sx = xs.mark_sharding(x, mesh, ("data", None, None))
        st = xs.mark_sharding(target, mesh, ("data", None, None))
        with xs.count_collectives() as fwd:
            out = sharded(sx)
        loss = F.mse_loss(out, st).full_tensor()
        loss.backward()
        opt_shd.step()
        opt_shd.zero_grad()
        losses.append((loss_ref.item(), loss.item()))
        if step == 0:
            collectives = {f"{k}:{','.join(a)}": n for (k, a), n in fwd.calls.items()}
    param_err = max(
        float((p.full_tensor() - r).detach().abs().max())
        for p, r in zip(sharded.parameters(), reference.parameters())
    )
    return {
        "mesh": dict(mesh.shape()),
        "losses_ref_vs_sharded": losses,
        "max_param_err": param_err,
        "forward_collectives": collectives,
        "fallbacks": dict(xs.fallback_counts()),
    }


def _spawned(rank: int, world: int, port: int, steps: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    xr.init()
    result = train(steps)
    if rank == 0:
        print(json.dumps(result))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many local ranks")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.nproc and "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_spawned, (args.nproc, port, args.steps), nprocs=args.nproc)
        return
    result = train(args.steps)  # under torchrun, its Mesh joins the world
    if xr.global_ordinal() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
