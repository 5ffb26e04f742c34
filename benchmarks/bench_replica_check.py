"""Cost of the cross-rank replica check of ``save``: ``verify_replicas=True`` vs ``False``.

2 ranks (gloo, CPU), fsync on. Two states of ``--mib`` MiB:

- ``replicated``: plain (replicated) tensors only, the worst case: every rank holds every
  byte, and each rank hashes the half the other rank writes;
- ``mixed``: ``benchmarks/bench_checkpoint.py``'s state, 75 % DTensor shards and 25 %
  plain tensors.

Per state and repeat, the saves with the check and without it run back to back, swapping
places every round (so load on the machine hits both alike), then torch.distributed.checkpoint's.
Prints one JSON line of medians, spreads and ratios, with the load average.

    .venv/bin/python benchmarks/bench_replica_check.py             # 1 GiB, 7 repeats
    .venv/bin/python benchmarks/bench_replica_check.py --quick     # 64 MiB smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from harness import run_ranks  # noqa: E402

MiB = 1 << 20


def _replicated(total_mib: int) -> dict:
    import torch

    n = 8
    rows = total_mib * MiB // 4 // n // 1024
    g = torch.Generator().manual_seed(0)  # the same seed on both ranks: equal replicas
    return {f"p{i}": torch.randn(rows, 1024, generator=g) for i in range(n)}


def _body(total_mib: int, repeats: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from bench_checkpoint import _state

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core._replicas import STATS
    from shardkit.checkpoint._core._save import join_cleanups

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    out: dict = {}
    for name, state in (
        ("replicated", _replicated(total_mib)),
        ("mixed", _state(total_mib, dist.get_rank())),
    ):
        runs = {
            "check": lambda s=state, n=name: dcp.save(s, checkpoint_id=f"{root}/{n}-on"),
            "no_check": lambda s=state, n=name: dcp.save(
                s, checkpoint_id=f"{root}/{n}-off", verify_replicas=False
            ),
            "torch": lambda s=state, n=name: tdcp.save(s, checkpoint_id=f"{root}/{n}-torch"),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        hashing = {"hashed_bytes": [], "hash_cpu_s": [], "waited_s": []}
        for r in range(repeats + 1):  # the first round warms up (page cache, allocations)
            # check and no_check swap places each round; each follows torch's save equally
            order = ["check", "no_check", "torch"] if r % 2 else ["no_check", "check", "torch"]
            for k in order:
                before = dict(vars(STATS))
                seconds = timed(runs[k])
                join_cleanups()  # the previous save's files go in the background: untimed
                if r:
                    times[k].append(seconds)
                    if k == "check":  # this rank's hashing of the pieces others write
                        for f in hashing:
                            hashing[f].append(getattr(STATS, f) - before[f])
        out[name] = {"times": times, "hashing": hashing}
        del state
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    mib, repeats = (64, 2) if args.quick else (args.mib, args.repeats)
    root = tempfile.mkdtemp(prefix="bench-replica-", dir=args.dir)
    load_start = os.getloadavg()[0]
    try:
        res = run_ranks(_body, 2, mib, repeats, root, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict = {
        "bench": "replica_check",
        "ranks": 2,
        "state_mib": mib,
        "repeats": repeats,
        "loadavg_1m": [load_start, os.getloadavg()[0]],
    }
    for name, both in res.items():
        times, hashing = both["times"], both["hashing"]
        med = {k: statistics.median(v) for k, v in times.items()}
        # per-repeat ratios: both saves of a pair ran back to back, under the same load
        pairs = sorted(a / b for a, b in zip(times["check"], times["no_check"]))
        result[name] = {
            "median_s": med,
            "min_max_s": {k: [round(min(v), 3), round(max(v), 3)] for k, v in times.items()},
            "check_over_no_check": med["check"] / med["no_check"],
            "paired_ratio_median": statistics.median(pairs),
            "paired_ratio_min_max": [round(pairs[0], 3), round(pairs[-1], 3)],
            "check_over_torch": med["check"] / med["torch"],
            # robust to load: CPU time of the hashing, and how long the save waited for it
            "rank0_hashed_mib": hashing["hashed_bytes"][0] / MiB,
            "rank0_hash_cpu_s_median": statistics.median(hashing["hash_cpu_s"]),
            "rank0_hash_cpu_over_save": statistics.median(hashing["hash_cpu_s"]) / med["check"],
            "rank0_waited_s_max": max(hashing["waited_s"]),
        }
    result["target_check_over_no_check"] = 1.03
    print(json.dumps(result))


if __name__ == "__main__":
    main()
