"""Train an MLP on scikit-learn's digits with shardkit DDP and a communication hook.

    torchrun --nproc_per_node 2 examples/ddp_digits.py --hook powerSGD --rank 2
    python examples/ddp_digits.py --hook fp16          # a world of one works too

Prints the test accuracy and the bytes each rank handed to collectives per step.
Hooks: none, allreduce, fp16, bf16, powerSGD, batched_powerSGD, noop.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import shardkit.runtime as xr
from shardkit.ddp import DistributedDataParallel as DDP
from shardkit.ddp import count_comm
from shardkit.ddp.comm_hooks import debugging_hooks, default_hooks, powerSGD_hook


def register(ddp: DDP, hook: str, rank: int, start: int) -> None:
    if hook == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook in ("powerSGD", "batched_powerSGD"):
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=start
        )
        fn = (
            powerSGD_hook.powerSGD_hook
            if hook == "powerSGD"
            else powerSGD_hook.batched_powerSGD_hook
        )
        ddp.register_comm_hook(state, fn)
    elif hook == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif hook != "none":
        raise ValueError(f"unknown --hook {hook!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", default="powerSGD")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD matrix rank")
    # not --start: torchrun's own parser would take it for an abbreviation of its
    # --start-method when written after the script name
    parser.add_argument("--powersgd-start", type=int, default=20, help="start_powerSGD_iter")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    args = parser.parse_args()

    rank, world = xr.global_ordinal(), xr.world_size()  # joins torchrun's world, if any
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0)
    x_tr, x_te = torch.tensor(x_tr, dtype=torch.float32), torch.tensor(x_te, dtype=torch.float32)
    y_tr, y_te = torch.tensor(y_tr), torch.tensor(y_te)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    ddp = DDP(model)
    register(ddp, args.hook, args.rank, args.powersgd_start)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    global_batch = args.batch * world
    rng = np.random.default_rng(0)  # same permutation on every rank; each takes its slice
    steps = 0
    with count_comm() as counter:
        for _ in range(args.epochs):
            order = torch.tensor(rng.permutation(len(x_tr)))
            for start in range(0, len(order) - global_batch + 1, global_batch):
                idx = order[start + rank * args.batch : start + (rank + 1) * args.batch]
                opt.zero_grad()
                F.cross_entropy(ddp(x_tr[idx]), y_tr[idx]).backward()
                opt.step()
                steps += 1
    with torch.no_grad():
        acc = (model(x_te).argmax(1) == y_te).float().mean().item()
    if rank == 0:
        print(
            f"hook={args.hook} world={world} test_acc={acc:.4f} "
            f"bytes_per_step={counter.bytes / steps:.0f} steps={steps}"
        )


if __name__ == "__main__":
    main()
