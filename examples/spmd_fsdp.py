"""FSDP through SPMD sharding (XLA's FSDPv2): parameters and batch sharded over an
``'fsdp'`` mesh axis, parameters gathered layer by layer. Trains and matches one device.

    python examples/spmd_fsdp.py --nproc 4        # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 examples/spmd_fsdp.py
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


def build_model(dim: int = 24, hidden: int = 40, classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.GELU(),
        nn.LayerNorm(hidden),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def train(steps: int = 5, *, batch: int = 30, dim: int = 24) -> dict:
    """Train the model wrapped in SpmdFullyShardedDataParallel and on one device."""
    world = xr.world_size()
    mesh = xs.Mesh(np.arange(world), (world,), ("fsdp",))
    torch.manual_seed(0)
    reference = build_model(dim)
    model = xs.SpmdFullyShardedDataParallel(copy.deepcopy(reference), mesh)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, collectives = [], {}
    for step in range(steps):
        x = torch.randn(batch, dim, generator=gen)
        y = torch.randint(0, 5, (batch,), generator=gen)
        loss_ref = F.cross_entropy(reference(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()

        with xs.count_collectives() as fwd:
            logits = model(x)
        loss = F.cross_entropy(logits, xs.mark_sharding(y, mesh, ("fsdp",))).full_tensor()
        with xs.count_collectives() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss_ref.item(), loss.item()))
        if step == 0:
            collectives = {
                phase: {f"{k}:{','.join(a)}": n for (k, a), n in counts.calls.items()}
                for phase, counts in (("forward", fwd), ("backward", bwd))
            }
    specs = sorted({str(p.partition_spec) for p in model.parameters()})
    param_err = max(
        float((p.full_tensor() - r).detach().abs().max())
        for p, r in zip(model.parameters(), reference.parameters())
    )
    return {
        "mesh": dict(mesh.shape()),
        "param_specs": specs,
        "losses_ref_vs_fsdp": losses,
        "max_param_err": param_err,
        "collectives": collectives,
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
