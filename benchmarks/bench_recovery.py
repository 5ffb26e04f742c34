"""Recovery: SIGKILL of one rank -> first resumed training step, RAM tier vs storage only.

Each run is a real ``torchrun --max-restarts 1`` job of ``--nproc`` ranks (gloo, one
machine). Every rank trains its own shard of a stack of linear layers (SGD with momentum:
state = weights + momentum, ``--mib`` MiB per rank; each step all-reduces the loss), saves
to storage every ``--save-interval`` steps (blocking, so that step is committed), and rank
1 SIGKILLs itself before step ``--kill-at`` on the first attempt. torchrun restarts every
rank; they restore the newest step every rank can get and run one step. Two variants:

- ``ram``: ``CheckpointManager(..., local_tier=LocalTier(interval=1))``: the RAM tier in
  ``/dev/shm`` every step (async), storage every ``--save-interval`` steps;
- ``persistent``: the same manager without a local tier (storage only).

Before the kill the storage files are dropped from the page cache (``posix_fadvise``
``DONTNEED``; ``--warm`` keeps them), as a restarted job reading a network file system or
an object store would find them. torch has no in-memory tier: the ``persistent`` variant
is the baseline. Figures (medians over ``--repeats``, spread = [min, max]): time from the
kill to the end of the first resumed step on the slowest rank, broken down into restart
(kill -> new process), rendezvous (process start -> process group, imports included),
setup (model, optimizer, manager), restore and first step; the tier each rank used; lost
work (steps computed before the kill that are redone); per-step time before the kill
(steps without a storage save), ram vs persistent; the RAM tier's peak memory per rank
after the restart (``tier_memory()["peak"]``). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("restart", "rendezvous", "setup", "restore", "first_step")


def _evict(root: str) -> None:
    """Drop the files under ``root`` from the page cache (written back first)."""
    for base, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:  # one write per line: ranks never interleave
        f.write(json.dumps(record) + "\n")


def worker(args: argparse.Namespace) -> None:
    from shardkit.cli._demo_restart import RecoveryClock

    clock = RecoveryClock(args.kill_file)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    clock.mark("rendezvous")
    from shardkit.checkpoint import CheckpointManager, prime_optimizer

    rank = dist.get_rank()
    width = args.width
    layers = max(1, (args.mib << 20) // (2 * 4 * width * width))  # weights + momentum
    torch.manual_seed(rank)  # each rank holds its own shard
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    optim = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    extra = {}
    if args.variant == "ram":
        from shardkit.checkpoint import LocalTier

        extra["local_tier"] = LocalTier(interval=1, directory=args.local_dir)
    mgr = CheckpointManager(
        args.ckpt, args.save_interval, max_to_keep=2, chkpt_on_preemption=False, **extra
    )
    clock.mark("setup")
    start = 0
    restored = mgr.latest_step()
    tier = None
    if restored is not None:
        prime_optimizer(optim)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        mgr.restore(restored, state)
        optim.load_state_dict(state["optim"])
        info = getattr(mgr, "last_restore", None)
        tier = info.tiers_by_rank[rank] if info is not None else "persistent"
        start = restored + 1
    clock.mark("restore")
    times = []
    for step in range(start, args.kill_at + 2):
        if step == args.kill_at and not clock.restarted:
            _append(args.result, {"attempt": 0, "rank": rank, "step_times": times})
            if rank == 1:
                if not args.warm:
                    _evict(args.ckpt)
                with open(args.kill_file, "w") as f:
                    f.write(json.dumps({"rank": rank, "step": step, "time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(step * 7 + rank))
        loss = model(x).square().mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        dist.all_reduce(loss.detach())
        if step % args.save_interval == 0:
            mgr.save(step, {"model": model.state_dict(), "optim": optim.state_dict()})
        else:
            mgr.save_async(step, {"model": model.state_dict(), "optim": optim.state_dict()})
            times.append(time.perf_counter() - t0)
        if clock.restarted:
            clock.mark("first_step")
            lost = None if restored is None else args.kill_at - 1 - restored
            record = {"attempt": clock.restart_count, "rank": rank, "restored": restored}
            record.update(tier=tier, lost_steps=lost, layers=layers, **clock.breakdown())
            if args.variant == "ram":
                record["tier_memory"] = mgr.tier_memory()
            _append(args.result, record)
            break
    mgr.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(variant: str, args: argparse.Namespace, work: str) -> list[dict]:
    """One torchrun job with one kill; the records its ranks wrote."""
    run_dir = tempfile.mkdtemp(prefix=f"{variant}-", dir=work)
    shm = tempfile.mkdtemp(prefix="shardkit-bench-recovery-", dir=args.shm_root)
    result = os.path.join(run_dir, "result.jsonl")
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)),
        *("--max-restarts", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{_free_port()}", os.path.abspath(__file__)),
        *("--worker", "--variant", variant, "--mib", str(args.mib), "--width", str(args.width)),
        *("--save-interval", str(args.save_interval), "--kill-at", str(args.kill_at)),
        *("--ckpt", os.path.join(run_dir, "ckpt"), "--local-dir", shm, "--result", result),
        *("--kill-file", os.path.join(run_dir, "kill.json")),
    ] + (["--warm"] if args.warm else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    # a fresh store per attempt: with torchrun's shared one a restarted rank can read its
    # predecessor's stale gloo address (pytorch/pytorch#135712)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{err[-4000:]}")
        with open(result) as f:
            return [json.loads(line) for line in f]
    finally:
        if proc.poll() is None:  # torchrun stops its ranks on SIGTERM
            proc.terminate()
            proc.wait(timeout=60)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _summary(runs: list[list[dict]]) -> dict:
    totals, slowest, tiers, lost, times = [], [], [], [], []
    for records in runs:
        after = [r for r in records if r["attempt"] > 0]
        worst = max(after, key=lambda r: sum(r.get(p, 0.0) for p in PHASES))
        totals.append(sum(worst.get(p, 0.0) for p in PHASES))
        slowest.append(worst)
        tiers.append(sorted({r["tier"] for r in after if r["tier"]}))
        lost.append(after[0]["lost_steps"])
        times += [t for r in records if r["attempt"] == 0 for t in r["step_times"]]
    out = {
        "recover_s": statistics.median(totals),
        "recover_spread_s": [min(totals), max(totals)],
    }
    for p in PHASES:
        out[f"{p}_s"] = statistics.median(w.get(p, float("nan")) for w in slowest)
    out["tiers"] = sorted({t for ts in tiers for t in ts})
    out["lost_steps"] = statistics.median(x for x in lost if x is not None) if any(lost) else 0
    out["step_s"] = statistics.median(times) if times else None
    peaks = [r["tier_memory"]["peak"] for rs in runs for r in rs if "tier_memory" in r]
    if peaks:  # what the RAM tier held at most on one rank: copies + replicas + staging
        out["tier_peak_mib"] = max(peaks) / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state per rank (256 MiB)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=13)
    parser.add_argument("--warm", action="store_true", help="leave storage in the page cache")
    parser.add_argument("--shm-root", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--quick", action="store_true", help="16 MiB per rank, one repeat")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per torchrun job")
    for internal in ("--variant", "--ckpt", "--local-dir", "--result", "--kill-file"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.mib, args.width, args.repeats = 16, 512, 1
    if args.kill_at <= args.save_interval:
        parser.error("--kill-at must come after the first storage save (--save-interval)")
    work = tempfile.mkdtemp(prefix="shardkit-bench-recovery-")
    runs: dict[str, list] = {"ram": [], "persistent": []}
    try:
        for _ in range(args.repeats):
            for variant in runs:
                runs[variant].append(_run(variant, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ram, persistent = _summary(runs["ram"]), _summary(runs["persistent"])
    step_ratio = None
    if ram["step_s"] and persistent["step_s"]:
        step_ratio = ram["step_s"] / persistent["step_s"]
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "mib_per_rank": args.mib,
                "ranks": args.nproc,
                "repeats": args.repeats,
                "storage": "page cache" if args.warm else "cold (evicted)",
                "ram": ram,
                "persistent": persistent,
                "recover_ratio": ram["recover_s"] / persistent["recover_s"],
                "restore_ratio": ram["restore_s"] / persistent["restore_s"],
                "step_time_ratio_local_interval_1": step_ratio,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
