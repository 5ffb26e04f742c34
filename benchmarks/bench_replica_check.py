"""Cost of the cross-rank replica check of ``save`` (plain tensors compared by checksum).

2 ranks (gloo, CPU), a state of plain (replicated) tensors only: the worst case, since
every byte is hashed on every rank. Times ``shardkit.checkpoint.save`` with the check,
with it switched off, and torch.distributed.checkpoint.save of the same state, in
alternation; prints one JSON line of medians, spreads and ratios.

    .venv/bin/python benchmarks/bench_replica_check.py             # 1 GiB, 5 repeats
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from harness import run_ranks  # noqa: E402

MiB = 1 << 20


def _body(total_mib: int, repeats: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core import _flatten, _save

    n = 8
    rows = total_mib * MiB // 4 // n // 1024
    g = torch.Generator().manual_seed(0)  # same seed on both ranks: equal replicas
    state = {f"p{i}": torch.randn(rows, 1024, generator=g) for i in range(n)}
    real = _save.replica_digests

    def sk(check: bool, path: str):
        _save.replica_digests = real if check else (lambda flat: {})
        try:
            dcp.save(state, checkpoint_id=path)
        finally:
            _save.replica_digests = real

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"check": [], "no_check": [], "torch": [], "hash": []}
    flat = _flatten.flatten(state, for_save=True)
    for r in range(repeats + 1):  # the first round warms up
        got = {
            "check": timed(lambda r=r: sk(True, f"{root}/a{r}")),
            "no_check": timed(lambda r=r: sk(False, f"{root}/b{r}")),
            "torch": timed(lambda r=r: tdcp.save(state, checkpoint_id=f"{root}/t{r}")),
            "hash": timed(lambda: real(flat)),
        }
        if dist.get_rank() == 0:
            for d in ("a", "b", "t"):
                shutil.rmtree(f"{root}/{d}{r}", ignore_errors=True)
        if r:
            for k, v in got.items():
                times[k].append(v)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats")
    args = parser.parse_args()
    mib, repeats = (64, 2) if args.quick else (args.mib, args.repeats)
    root = tempfile.mkdtemp(prefix="bench-replica-")
    try:
        times = run_ranks(_body, 2, mib, repeats, root, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: [min(v), max(v)] for k, v in times.items()}
    print(
        json.dumps(
            {
                "bench": "replica_check",
                "ranks": 2,
                "state_mib": mib,
                "repeats": repeats,
                "median_s": med,
                "min_max_s": spread,
                "check_over_no_check": med["check"] / med["no_check"],
                "hash_share_of_save": med["hash"] / med["check"],
                "shardkit_over_torch": med["check"] / med["torch"],
            }
        )
    )


if __name__ == "__main__":
    main()
