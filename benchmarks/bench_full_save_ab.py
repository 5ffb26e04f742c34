"""Full (non-incremental) save and load: this tree against an earlier one, A/B interleaved.

The issue-17 target "a full save keeps within 5% of today's save and load times" needs
the code from before incremental checkpoints and zero-stall staging. Export that tree
once, then run both in one process tree, rounds interleaved (A B, B A, ...), each round
in fresh ranks that import ``shardkit`` from the tree under test:

    git archive 51f999f | tar -x -C /tmp/before     # main just before issue 17 landed
    .venv/bin/python benchmarks/bench_full_save_ab.py --before /tmp/before --mib 256

2 ranks (gloo), the state of ``bench_checkpoint.py`` (Shard(0) DTensors and replicated
tensors), fsync on. Per round and tree: one untimed warm-up save, then ``--repeats``
timed saves and loads. Figures: medians over every timed sample, the ratio now / before
per round (paired) with its spread, and the load average. Not torch against shardkit:
both sides are shardkit, so there is no torch column.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from bench_checkpoint import _state, _timed  # noqa: E402
from harness import run_ranks  # noqa: E402


def _phase(tree: str, root: str, mib: int, repeats: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core._save import join_cleanups

    assert os.path.realpath(shardkit.__file__).startswith(os.path.realpath(tree)), shardkit.__file__
    init_device_mesh("cpu", (2,))
    sd = _state(mib, dist.get_rank())
    path = f"{root}/ck"
    dcp.save(sd, checkpoint_id=path)  # warm-up: files created, allocator settled
    join_cleanups()
    saves, loads = [], []
    for _ in range(repeats):
        saves.append(_timed(lambda: dcp.save(sd, checkpoint_id=path), dist.barrier))
        join_cleanups()  # superseded files are deleted in the background: not timed
    for _ in range(repeats):
        loads.append(_timed(lambda: dcp.load(sd, checkpoint_id=path), dist.barrier))
    return {"save": saves, "load": loads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="an exported earlier tree")
    parser.add_argument("--mib", type=int, default=256, help="total state size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="timed saves/loads per round")
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one tree's ranks
    args = parser.parse_args()
    if args.worker:
        root = tempfile.mkdtemp(prefix="bench_ab_")
        try:
            res = run_ranks(_phase, 2, args.worker, root, args.mib, args.repeats, timeout=1800)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(res))
        return
    if args.quick:
        args.mib, args.rounds = 32, 2
    trees = {
        "before": os.path.abspath(args.before),
        "now": os.path.abspath(os.path.join(HERE, "..")),
    }
    samples = {t: {"save": [], "load": []} for t in trees}
    paired = {"save": [], "load": []}
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        med = {}
        for name in order:
            # A process per tree: PYTHONPATH puts the tree before the editable install. Its
            # working directory is the tree too: the harness's forkserver imports shardkit
            # before its ranks get this process's sys.path, and on Python < 3.12.8 it looks
            # in its working directory first (CPython gh-117378). From the repository root,
            # the "before" ranks would otherwise run this tree's shardkit.
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", trees[name],
                   "--mib", str(args.mib), "--repeats", str(args.repeats),
                   "--before", trees["before"]]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": trees[name]}
            proc = subprocess.run(
                cmd, env=env, cwd=trees[name], capture_output=True, text=True, check=False
            )
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            for kind in ("save", "load"):
                samples[name][kind] += res[0][kind]
            med[name] = {kind: statistics.median(res[0][kind]) for kind in ("save", "load")}
        for kind in ("save", "load"):
            paired[kind].append(med["now"][kind] / med["before"][kind])
    out = {"bench": "full-save-ab", "ranks": 2, "state_mib": args.mib, "rounds": args.rounds,
           "repeats": args.repeats, "before": trees["before"],
           "loadavg_1m_at_end": os.getloadavg()[0],
           "median_s": {t: {k: statistics.median(v) for k, v in d.items()}
                        for t, d in samples.items()},
           "ratios_now_vs_before": {k: statistics.median(v) for k, v in paired.items()},
           "ratio_per_round": {k: [round(x, 3) for x in v] for k, v in paired.items()},
           "samples_s_rank0": {t: {k: [round(x, 3) for x in v] for k, v in d.items()}
                               for t, d in samples.items()},
           "targets": {"save": 1.05, "load": 1.05}}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
