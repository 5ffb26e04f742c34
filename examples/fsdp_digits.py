"""Train an MLP on scikit-learn's digits with FSDP, save per-rank checkpoints, consolidate.

    torchrun --nproc-per-node 2 examples/fsdp_digits.py --out /tmp/fsdp_digits
    python examples/fsdp_digits.py --out /tmp/fsdp_digits        # a world of one

Rank 0 then merges the rank files into one state dict and checks that a plain (unwrapped)
model loaded from it scores the same held-out accuracy.
"""

from __future__ import annotations

import argparse
import functools
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/fsdp_digits", help="checkpoint directory")
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn

    import shardkit.runtime as xr
    from shardkit.fsdp import FSDP, consolidate_sharded_model_checkpoints
    from shardkit.fsdp.wrap import size_based_auto_wrap_policy

    rank, world = xr.global_ordinal(), xr.world_size()  # joins torchrun's world, if any
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
    xtr, xte = (torch.tensor(a, dtype=torch.float32) for a in (xtr, xte))
    ytr, yte = torch.tensor(ytr), torch.tensor(yte)

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def accuracy(model):
        with torch.no_grad():
            return float((model(xte).argmax(-1) == yte).float().mean())

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=5000)
    model = FSDP(make_model(), auto_wrap_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.epochs):
        order = torch.randperm(len(xtr), generator=g)
        for start in range(0, len(order) - 127, 128):
            idx = order[start : start + 128].chunk(world)[rank]  # this rank's slice
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    acc = accuracy(model)
    mine = sum(p.numel() for p in model.parameters())  # this rank's shard of every unit
    total = sum(p.numel() for p in make_model().parameters())
    print(f"rank {rank} of {world}: holds {mine} of {total} parameters", flush=True)

    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, "digits")
    ckpt = {
        "model": model.state_dict(),
        "shard_metadata": model.get_shard_metadata(),
        "optimizer": opt.state_dict(),
    }
    torch.save(ckpt, f"{prefix}_rank-{rank:08d}-of-{world:08d}.pth")
    if world > 1:
        dist.barrier()
    if rank == 0:
        full, path = consolidate_sharded_model_checkpoints(prefix, "_rank-*-of-*.pth")
        plain = make_model()
        plain.load_state_dict(full)
        print(f"FSDP accuracy {acc:.4f}; consolidated into {path}; plain {accuracy(plain):.4f}")


if __name__ == "__main__":
    main()
