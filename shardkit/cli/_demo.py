"""``shardkit demo``: the main job, end to end, through torch's own launcher.

Phase 1 starts N ranks with ``python -m torch.distributed.run`` (torchrun), trains, and
halfway through rank 0 receives a real SIGTERM: the ranks agree on the step, checkpoint
and exit. Phase 2 is a fresh torchrun that resumes from the latest step, finishes,
consolidates the model into one safetensors file and evaluates it. The launcher then
prints a summary from the JSON report rank 0 wrote.

With --max-restarts N torchrun restarts the ranks after a failure (up to N times) and
they resume from the newest step every rank can get: the RAM tier (--local-every, on by
default then), a peer's replica, or storage. --kill-rank R --kill-at-step S makes rank R
SIGKILL itself before step S on the first attempt, to show it: each rank prints the tier
it restored from and the time from the kill to its first resumed step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from ._main import CliError

__all__ = ["DESCRIPTION", "add_arguments", "run_demo", "torchrun_command"]

DESCRIPTION = __doc__.split("\n\n", 1)[1].replace("``", "") + (
    "\nMulti-machine: run the same command on every machine with --nnodes, --node-rank, "
    "--master-addr, --master-port and an --out directory they all share; phase 2 uses "
    "--master-port + 1. See docs/cli.md."
)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument("--nproc", type=_positive, default=2, help="ranks per machine (2)")
    parser.add_argument("--strategy", choices=("fsdp", "ddp", "spmd"), default="fsdp")
    parser.add_argument(
        "--hook", choices=("none", "fp16", "powersgd"), default="none", help="ddp comm hook"
    )
    parser.add_argument("--steps", type=_positive, default=300, help="training steps (300)")
    parser.add_argument("--batch-size", type=_positive, default=64, help="global batch (64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (0.003)")
    parser.add_argument(
        "--save-every", type=_positive, default=50, help="checkpoint every N steps (50)"
    )
    parser.add_argument(
        "--no-preempt", action="store_true", help="skip the simulated preemption (one phase)"
    )
    parser.add_argument(
        "--out", default=None, help="work directory (default: a new temporary directory)"
    )
    restart = parser.add_argument_group("automatic restart (torchrun's elastic restart)")
    restart.add_argument(
        "--max-restarts", type=int, default=0, help="restarts torchrun may make (0)"
    )
    restart.add_argument(
        "--kill-rank", type=int, default=None, help="this rank SIGKILLs itself (first attempt)"
    )
    restart.add_argument("--kill-at-step", type=int, default=None, help="... before this step")
    restart.add_argument(
        "--local-every",
        type=int,
        default=None,
        help="RAM tier every N steps; 0 turns it off (default: 1 with --max-restarts, else 0)",
    )
    restart.add_argument(
        "--local-dir", default=None, help="RAM tier directory on each machine (/dev/shm)"
    )
    multi = parser.add_argument_group("multiple machines (passed to torchrun)")
    multi.add_argument("--nnodes", type=_positive, default=1)
    multi.add_argument("--node-rank", type=int, default=0)
    multi.add_argument("--master-addr", default=None)
    multi.add_argument("--master-port", type=int, default=None)
    parser.set_defaults(func=run_demo)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args: argparse.Namespace, port: int, worker_args: list[str]) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line for one phase."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
    if getattr(args, "max_restarts", 0):
        cmd += ["--max-restarts", str(args.max_restarts)]
    if args.nnodes == 1:
        endpoint = f"{args.master_addr or '127.0.0.1'}:{port}"
        cmd += ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    else:  # static rendezvous: node ranks are the ones the user gave
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank)]
        cmd += ["--master-addr", args.master_addr, "--master-port", str(port)]
    return cmd + ["-m", "shardkit.cli._demo_worker", *worker_args]


def _check(args: argparse.Namespace) -> None:
    if args.nnodes > 1:
        missing = [f for f in ("master_addr", "master_port", "out") if getattr(args, f) is None]
        if missing:
            flags = ", ".join("--" + m.replace("_", "-") for m in missing)
            raise CliError(
                f"--nnodes {args.nnodes} needs {flags}: every machine must reach node 0 and "
                "share the --out directory"
            )
        if not 0 <= args.node_rank < args.nnodes:
            raise CliError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}")
    if args.hook != "none" and args.strategy != "ddp":
        raise CliError(f"--hook {args.hook} applies to --strategy ddp only, not {args.strategy}")
    _check_restart(args)
    world = args.nproc * args.nnodes
    if args.batch_size < world:
        raise CliError(
            f"--batch-size {args.batch_size} is smaller than the number of ranks ({world})"
        )
    per_rank = -(-args.batch_size // world)  # rows are split as torch.chunk splits them
    if per_rank * (world - 1) >= args.batch_size:
        raise CliError(
            f"--batch-size {args.batch_size} leaves rank {world - 1} no rows: the ranks take "
            f"{per_rank} each in turn; use a multiple of {world}"
        )


def _check_restart(args: argparse.Namespace) -> None:
    if args.max_restarts < 0:
        raise CliError(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.local_every is None:
        args.local_every = 1 if args.max_restarts > 0 else 0
    if args.local_every < 0:
        raise CliError(f"--local-every {args.local_every} must be >= 0 (0 turns the tier off)")
    if args.local_every and args.hook == "powersgd":
        raise CliError(
            "--hook powersgd keeps per-rank memory the RAM tier does not restore yet: "
            "add --local-every 0"
        )
    if (args.kill_rank is None) != (args.kill_at_step is None):
        raise CliError("--kill-rank and --kill-at-step go together: give both or neither")
    if args.kill_rank is None:
        return
    world = args.nproc * args.nnodes
    if not 0 <= args.kill_rank < world:
        raise CliError(f"--kill-rank {args.kill_rank} is outside the ranks 0..{world - 1}")
    if not 1 <= args.kill_at_step < args.steps:
        raise CliError(f"--kill-at-step {args.kill_at_step} is outside 1..{args.steps - 1}")
    if args.max_restarts < 1:
        raise CliError(
            f"--kill-rank {args.kill_rank} needs --max-restarts 1 or more, or the run just fails"
        )


def _check_dataset() -> None:
    """Refuse to start when the ranks could not load the digits: their ImportError would
    surface only inside torchrun's failure report, once per rank."""
    from ._demo_parts import DIGITS_MISSING, digits_csv_path

    try:
        if digits_csv_path() is None:
            import sklearn.datasets  # noqa: F401  (another layout: the ranks import it too)
    except ImportError as exc:
        if str(exc) == DIGITS_MISSING:
            raise CliError(DIGITS_MISSING) from None
        raise CliError(  # installed but broken (a dependency of its missing, say)
            f"the demo trains on scikit-learn's digits dataset and importing scikit-learn "
            f"failed ({exc}): pip install 'shardkit[demo]'"
        ) from None


def _check_out(out: str) -> None:
    """Refuse an --out the demo would clobber or cannot write, before any rank starts."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--out {out} is a file; give a directory (new or empty)")
    ckpt_dir = os.path.join(out, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise CliError(f"{ckpt_dir} already holds checkpoints; pass an empty --out directory")
    model = os.path.join(out, "model.safetensors")
    if os.path.exists(model):
        raise CliError(f"{model} exists and the demo would replace it; pass an empty --out")
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise CliError(f"--out {out} cannot be written: {exc.strerror or exc}") from None


def _run_phase(args, phase: int, port: int, worker_args: list[str], env: dict) -> None:
    cmd = torchrun_command(args, port, [*worker_args, "--phase", str(phase)])
    if args.debug:
        print("[shardkit demo] " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    finally:  # interrupted (Ctrl-C, SIGTERM): do not leave torchrun and its ranks behind
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if code != 0:
        raise CliError(
            f"demo phase {phase} failed: torchrun exited with status {code} "
            "(the failing rank's output is above)"
        )


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def summarize(reports: list[dict], wall: float) -> str:
    """The summary printed at the end, from the per-phase reports of rank 0."""
    last = reports[-1]
    steps = sum(r["steps_run"] for r in reports)
    times = [r["step_time_s"] for r in reports if r["step_time_s"] is not None]
    blocks = [b for r in reports for b in r["ckpt_blocking_s"]]
    comm = sum(r["comm_bytes"] for r in reports)
    name = last["strategy"] + (f" + {last['hook']} hook" if last["hook"] != "none" else "")
    lines = [
        "shardkit demo summary",
        f"  strategy            {name}, {last['world_size']} rank{'s' if last['world_size'] != 1 else ''}",
    ]
    for r in reports:
        note = (
            f"steps {r['start_step']}..{r['last_step']}"
            if r["steps_run"]
            else f"no steps left to run (all {r['start_step']} done)"
        )
        if r["resumed_from"] is not None:
            note += f", resumed from step {r['resumed_from']}"
        if r["preempted_at"] is not None:
            note += f", preempted (SIGTERM) at step {r['preempted_at']}"
        lines.append(f"  phase {r['phase']}             {note}")
        if r.get("recovery"):
            lines.append("  restart " + _restart_line(r))
        if r.get("tier_memory"):
            lines.append("  RAM tier " + _memory_line(r["tier_memory"]))
    acc = last["accuracy"]
    lines.append(f"  accuracy            {acc:.4f} (held-out digits)" if acc is not None else "")
    if times:
        lines.append(f"  step time           {1e3 * statistics.median(times):.2f} ms (median)")
    if blocks:
        lines.append(
            f"  checkpoint blocking {1e3 * statistics.median(blocks):.1f} ms median, "
            f"{1e3 * max(blocks):.1f} ms max over {len(blocks)} async saves"
        )
    lines.append(
        f"  bytes communicated  {_mib(comm)} per rank in total, "
        f"{_mib(comm / max(steps, 1))} per step (payload handed to collectives)"
    )
    if last.get("consolidated"):
        lines.append(f"  consolidated        {last['consolidated']}")
    lines.append(f"  wall time           {wall:.1f} s")
    return "\n".join(line for line in lines if line)


def _memory_line(memory: dict) -> str:
    """``RAM tier`` summary line: what rank 0 holds in node-local RAM at the phase's end."""
    parts = ", ".join(f"{k} {_mib(memory[k])}" for k in ("local", "replica", "staging"))
    return f"          {parts}; peak {_mib(memory['peak'])} (rank 0)"


def _restart_line(report: dict) -> str:
    """``restart`` summary line: tiers per rank, the slowest rank's breakdown."""
    ranks = report["recovery"]
    tiers = ", ".join(f"rank {r['rank']} {r['tier']}" for r in ranks)
    phases = ("restart", "rendezvous", "setup", "restore", "first_step")
    slowest = max(ranks, key=lambda r: sum(r.get(p, 0.0) for p in phases))
    parts = ", ".join(f"{p.replace('_', ' ')} {slowest[p]:.2f} s" for p in phases if p in slowest)
    total = sum(slowest.get(p, 0.0) for p in phases)
    return (
        f"{report['restart_count']:<11} resumed step {ranks[0]['step']} from: {tiers}\n"
        f"                      {'kill' if 'restart' in slowest else 'start'} -> "
        f"first resumed step {total:.2f} s ({parts})"
    )


def run_demo(args: argparse.Namespace) -> int:
    """Run both phases and print the summary; returns the exit code.

    A SIGTERM stops the launcher as Ctrl-C does (its torchrun children get it too); the
    caller's handler is back in place when this returns, however it ends."""
    _check(args)
    _check_dataset()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run_phases(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_phases(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    out = args.out or tempfile.mkdtemp(prefix="shardkit-demo-")
    _check_out(out)
    ckpt_dir = os.path.join(out, "checkpoints")
    report = os.path.join(out, "report.jsonl")
    if args.node_rank == 0:
        for stale in (report, os.path.join(out, "kill.json")):
            if os.path.exists(stale):
                os.remove(stale)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.max_restarts:
        # torchrun's c10d rendezvous shares its TCP store with the ranks' process group by
        # default, and a restarted rank can then read its predecessor's stale gloo address
        # (pytorch/pytorch#135712): a fresh store per attempt avoids it.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.nnodes == 1 and sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback (macOS calls it lo0)
    worker = [
        *("--strategy", args.strategy, "--hook", args.hook, "--steps", str(args.steps)),
        *("--batch-size", str(args.batch_size), "--lr", str(args.lr)),
        *("--save-every", str(args.save_every), "--ckpt-dir", ckpt_dir),
        *("--out-file", os.path.join(out, "model.safetensors"), "--report", report),
        *("--local-every", str(args.local_every), "--kill-file", os.path.join(out, "kill.json")),
    ]
    if args.local_dir is not None:
        worker += ["--local-dir", args.local_dir]
    if args.kill_rank is not None:
        worker += ["--kill-rank", str(args.kill_rank), "--kill-at-step", str(args.kill_at_step)]
    print(f"[shardkit demo] work directory {out}", flush=True)
    base_port = args.master_port
    if args.no_preempt:
        _run_phase(args, 1, base_port or _free_port(), worker, env)
    else:
        preempt = ["--preempt-at", str(args.steps // 2)]
        _run_phase(args, 1, base_port or _free_port(), worker + preempt, env)
        _run_phase(args, 2, base_port + 1 if base_port else _free_port(), worker, env)
    if not os.path.exists(report):
        print("[shardkit demo] done; the summary is printed on node 0", flush=True)
        return 0
    with open(report) as f:
        reports = [json.loads(line) for line in f if line.strip()]
    print(summarize(reports, time.perf_counter() - began), flush=True)
    if reports[-1]["accuracy"] is None:
        raise CliError("the demo finished without evaluating the model")
    return 0
