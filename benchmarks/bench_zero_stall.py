"""Blocking time of one async save call by state size: shardkit zero-stall vs shardkit
``zero_stall=False`` vs torch DCP ``async_save`` (1 rank, gloo).

The state is ``--tensors`` parameters of an SGD optimizer that has stepped (so shardkit
knows them). Each repeat waits for the previous save first (outside the timed call), so
only the call itself is timed. One JSON line: medians in ms, their spread and ratios per size.

    python benchmarks/bench_zero_stall.py --quick    # smoke run: 16 MiB in 8 tensors, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardkit.checkpoint as sk


def _time_calls(save, repeats: int) -> list[float]:
    times, fut = [], None
    for r in range(repeats + 1):  # the first call (group creation, page faults) is dropped
        if fut is not None:
            fut.result()
        start = time.perf_counter()
        fut = save(r)
        if r:
            times.append(time.perf_counter() - start)
    fut.result()
    return [1e3 * t for t in times]


def _measure(state: dict, root: str, repeats: int) -> tuple[list, list, list]:
    def path(tag, r):
        return f"{root}/{tag}-{r % 2}"

    def torch_save(r):
        shutil.rmtree(path("dcp", r), ignore_errors=True)
        return dcp.async_save(state, checkpoint_id=path("dcp", r))

    zs = _time_calls(lambda r: sk.async_save(state, checkpoint_id=path("zs", r)), repeats)
    full = _time_calls(
        lambda r: sk.async_save(state, checkpoint_id=path("cp", r), zero_stall=False), repeats
    )
    return zs, full, _time_calls(torch_save, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="64,256,1024,2048")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 MiB in 8 tensors, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.sizes_mib, args.tensors, args.repeats = "16", 8, 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="zero-stall-")
    out = {"bench": "zero-stall-blocking", "tensors": args.tensors, "repeats": args.repeats}
    try:
        for mib in [int(m) for m in args.sizes_mib.split(",")]:
            n = (mib << 20) // 4 // args.tensors
            params = [torch.nn.Parameter(torch.randn(n)) for _ in range(args.tensors)]
            opt = torch.optim.SGD(params, lr=0.1)
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()  # shardkit learns the optimizer here
            state = {f"p{i}": p for i, p in enumerate(params)}

            zs_ms, full_ms, tdcp_ms = _measure(state, root, args.repeats)
            zs, full, tdcp = (statistics.median(v) for v in (zs_ms, full_ms, tdcp_ms))
            out[f"{mib}MiB"] = {
                "shardkit_zero_stall_ms": round(zs, 3),
                "shardkit_copy_in_call_ms": round(full, 3),
                "torch_dcp_ms": round(tdcp, 3),
                "zero_stall_vs_dcp": round(zs / tdcp, 4),
                "min_max_ms": {
                    name: [round(min(v), 3), round(max(v), 3)]
                    for name, v in (
                        ("zero_stall", zs_ms),
                        ("copy_in_call", full_ms),
                        ("torch_dcp", tdcp_ms),
                    )
                },  # fmt: skip
            }
            del params, opt, state
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["loadavg_1m_at_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
