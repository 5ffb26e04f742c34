"""The per-rank training program of ``shardkit demo`` (started by torchrun).

One invocation is one phase: it resumes from the latest committed checkpoint if there is
one, trains until ``--steps`` or until a preemption (SIGTERM) is agreed on by all ranks,
and saves asynchronously every ``--save-every`` steps. After the last step it saves,
consolidates the model to one safetensors file and evaluates it on the held-out split.
Global rank 0 appends one JSON line per phase to ``--report`` for the launcher.

Fault injection for torchrun's elastic restart (``--max-restarts``): with ``--kill-rank R
--kill-at-step S`` rank R SIGKILLs itself before step S on the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``). torchrun then restarts every rank; each resumes from
the newest step every rank can get (RAM tier first) and prints the tier it used and the
time from the kill to its first resumed step, broken down.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from .. import runtime as xr
from ._demo_ckpt import DemoCheckpoints
from ._demo_parts import (
    CommCounter,
    accuracy,
    batch_indices,
    build_strategy,
    load_digits_split,
    make_mlp,
)
from ._demo_restart import RecoveryClock

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shardkit.cli._demo_worker")
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "ddp", "spmd"))
    p.add_argument("--hook", default="none", choices=("none", "fp16", "powersgd"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--preempt-at", type=int, default=-1, help="rank 0 SIGTERMs itself here")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-file", required=True, help="consolidated safetensors file")
    p.add_argument("--report", required=True, help="JSON lines file written by rank 0")
    p.add_argument("--phase", type=int, default=1)
    p.add_argument("--local-every", type=int, default=0, help="RAM tier interval (0: off)")
    p.add_argument("--local-dir", default=None, help="RAM tier directory (default /dev/shm)")
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself...")
    p.add_argument("--kill-at-step", type=int, default=-1, help="...before this step")
    p.add_argument("--kill-file", default=None, help="where the killed rank notes the time")
    return p.parse_args(argv)


def _kill_self(args: argparse.Namespace, rank: int, step: int) -> None:
    """SIGKILL this rank before ``step``, on the first attempt only, noting when."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if args.kill_file:
        with open(args.kill_file, "w") as f:
            f.write(json.dumps({"rank": rank, "step": step, "time": time.time()}))
            f.flush()
            os.fsync(f.fileno())
    print(f"[shardkit demo] rank {rank}: SIGKILL before step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _progress(total: int, initial: int, phase: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=f"phase {phase}",
        unit="step",
        disable=not enabled,
        file=sys.stderr,
        mininterval=0.5,
        dynamic_ncols=True,
    )


def _init_process_group() -> torch.device:
    """Join torchrun's group: NCCL on GPUs when each local rank can have its own,
    gloo on the CPU otherwise (e.g. the default 2 ranks on a 1-GPU machine)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        xr.init()
        return xr.device()
    xr.init(backend="gloo")
    return torch.device("cpu")


def _evaluate(out_file: str, x_test, y_test) -> float:
    from safetensors.torch import load_file

    model = make_mlp(seed=0)
    model.load_state_dict(load_file(out_file))
    return accuracy(model, x_test, y_test)


def run(args: argparse.Namespace) -> dict:
    """Train one phase; returns the report dict (meaningful on global rank 0)."""
    counter = CommCounter().install()
    clock = RecoveryClock(args.kill_file)
    device = _init_process_group()
    clock.mark("rendezvous")
    rank, world = xr.global_ordinal(), xr.world_size()
    lead = rank == 0
    if args.batch_size < world:
        raise ValueError(f"--batch-size {args.batch_size} is smaller than the world ({world})")
    x_train, y_train, x_test, y_test = load_digits_split(args.seed)
    x_train, y_train = x_train.to(device), y_train.to(device)
    model = make_mlp(args.seed).to(device)
    strategy = build_strategy(args.strategy, args.hook, model, args.lr)
    model, optimizer = strategy.module, strategy.optimizer
    ckpts = DemoCheckpoints(
        args.ckpt_dir,
        args.save_every,
        strategy.hook_state,
        local_every=args.local_every,
        local_dir=args.local_dir,
    )
    clock.mark("setup")

    start = 0
    resumed = ckpts.restore_latest(model, optimizer)
    clock.mark("restore")
    tier = ckpts.restored_tier(rank)
    if resumed is not None:
        start = resumed + 1
        if lead:
            print(f"[shardkit demo] resumed from step {resumed}", flush=True)

    step_times, block_times, preempted_at, loss = [], [], None, float("nan")
    bar = _progress(args.steps, start, args.phase, lead)
    step = start - 1
    recovery = None
    for step in range(start, args.steps):
        if rank == args.kill_rank and step == args.kill_at_step:
            _kill_self(args, rank, step)
        if lead and step == args.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as a scheduler sends it
        t0 = time.perf_counter()
        with counter.step():
            idx = batch_indices(step, len(y_train), args.batch_size, args.seed)
            mine = idx.chunk(world)[rank] if world > 1 else idx
            x, y = strategy.shard_batch(x_train[mine], y_train[mine], len(idx))
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss_t = F.cross_entropy(model(x), y)
            loss_t.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the step, not its launch
        step_times.append(time.perf_counter() - t0)
        if step == start and clock.restarted:
            clock.mark("first_step")
            recovery = _recovery_report(clock, rank, world, resumed, tier)
        if step % 10 == 0 or step == args.steps - 1:
            loss = strategy.scalar(loss_t.detach())
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.update(1)
        blocked = ckpts.save(step, model, optimizer, force=step == args.steps - 1)
        if blocked is not None:
            block_times.append(blocked)
        if ckpts.reached_preemption(step):
            preempted_at = step
            break
    bar.close()
    memory = ckpts.mgr.tier_memory() if args.local_every else None  # before close drops it
    ckpts.join()

    report = {
        "phase": args.phase,
        "strategy": args.strategy,
        "hook": args.hook,
        "world_size": world,
        "start_step": start,
        "resumed_from": resumed,
        "last_step": step,
        "preempted_at": preempted_at,
        "steps_run": len(step_times),
        "step_time_s": statistics.median(step_times) if step_times else None,
        "ckpt_blocking_s": block_times,
        "comm_bytes": counter.bytes,
        "comm_calls": counter.calls,
        "final_loss": loss,
        "accuracy": None,
        "restart_count": clock.restart_count,
        "restored_tier": tier,
        "recovery": recovery,
        "tier_memory": memory,
    }
    if preempted_at is not None:
        if lead:
            print(
                f"[shardkit demo] preempted (SIGTERM) at step {step}; checkpoint saved", flush=True
            )
    elif step == args.steps - 1 and lead:
        ckpts.consolidate(step, args.out_file)
        report["accuracy"] = _evaluate(args.out_file, x_test, y_test)
        report["consolidated"] = args.out_file
    counter.uninstall()
    if lead:
        with open(args.report, "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


def _recovery_report(clock, rank: int, world: int, resumed, tier) -> list[dict]:
    """Print this rank's recovery line; every rank's breakdown, gathered (a collective)."""
    import torch.distributed as dist

    mine = {"rank": rank, "step": resumed, "tier": tier, **clock.breakdown()}
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in clock.breakdown().items())
    where = f"step {resumed} from the {tier} tier" if resumed is not None else "nothing (step 0)"
    print(
        f"[shardkit demo] rank {rank} restart {clock.restart_count}: restored {where}; "
        f"{'kill' if clock.killed_at is not None else 'start'} -> first step "
        f"{clock.total():.2f} s ({parts})",
        flush=True,
    )
    if world == 1:
        return [mine]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def main(argv: list[str] | None = None) -> int:
    """Run one phase of the demo on this rank."""
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a rank is stuck
    try:
        run(_parse(argv))
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line each, not a traceback
        print(f"[shardkit demo] rank {os.environ.get('RANK', '0')} interrupted", flush=True)
        return 130
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
