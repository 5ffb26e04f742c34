"""Train a small MLP on the digits dataset with CheckpointManager: resume, async saves,
retention and preemption.

    python examples/train_with_manager.py --ckpt /tmp/digits-run --steps 300
    # interrupt it (Ctrl-C, kill -9, or SIGTERM for a clean preemption checkpoint),
    # run the same command again: it resumes from the newest committed step.
    torchrun --nproc-per-node 2 examples/train_with_manager.py --ckpt /tmp/digits-ddp

``--ckpt`` takes any fsspec URL (a local path, ``memory://...``, ``s3://bucket/run``).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits

import shardkit.runtime as xr
from shardkit.checkpoint import CheckpointManager, prime_optimizer


def batches(x, y, batch_size, rank, world, start_step):
    """Deterministic batches from ``start_step`` on: a resumed run sees the same data."""
    step = start_step
    while True:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(x), (batch_size * world,), generator=g)
        mine = idx[rank * batch_size : (rank + 1) * batch_size]
        yield step, (x[mine], y[mine])
        step += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="/tmp/shardkit-digits", help="fsspec URL of the run")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-interval", type=int, default=25)
    ap.add_argument("--max-to-keep", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)

    rank, world = xr.global_ordinal(), xr.world_size()  # joins torchrun's world, if any
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)

    mgr = CheckpointManager(
        args.ckpt, save_interval=args.save_interval, max_to_keep=args.max_to_keep
    )
    start = 0
    if mgr.all_steps():
        prime_optimizer(optim)  # Adam's moments exist only after a step: create them, zeroed
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        latest = max(mgr.all_steps())
        mgr.restore(latest, state)  # in place, into the tensors above
        optim.load_state_dict(state["optim"])  # hyper-parameters (param_groups) too
        start = latest + 1
        checksum = sum(float(t.double().sum()) for t in model.state_dict().values())
        print(f"rank {rank} of {world}: resumed from step {latest} (weights sum {checksum:.6f})")

    for step, (xb, yb) in batches(x, y, args.batch_size, rank, world, start):
        if step >= args.steps:
            break
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        if world > 1:  # plain data parallel: average the gradients
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optim.step()
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        if mgr.save_async(step, state, metrics={"loss": loss.item()}) and rank == 0:
            print(f"checkpoint at {step} (loss {loss.item():.4f})")
        if mgr.reached_preemption(step):
            mgr.close()  # waits for the preemption checkpoint to commit
            if rank == 0:
                print(f"preempted: saved step {step}, exiting")
            return 0

    mgr.close()
    steps = mgr.all_steps()  # a collective: every rank calls it
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    if rank == 0:
        print(f"done: steps {steps} on disk, train accuracy {acc:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
