"""shardkit SPMD tensor parallelism against torch DTensor (ColwiseParallel / RowwiseParallel).

Same MLP (fc1 column-parallel, GELU, fc2 row-parallel), same input, forward + backward,
on 2 and 4 gloo ranks of this machine, in one run. The two implementations alternate
rounds (ABBA order) so drift in machine load hits both. Bytes are what one rank hands to collectives
in one step: for shardkit from ``count_collectives``, for DTensor from a dispatch mode
that sums the input bytes of the functional collectives it issues (same definition:
an all-reduce counts its tensor, an all-gather the local shard).
Prints a table to stderr and one JSON line (medians and ratios) to stdout.

    python benchmarks/bench_spmd.py            # full run
    python benchmarks/bench_spmd.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class _CollectiveBytes(TorchDispatchMode):
    """Sums the bytes of the tensors handed to c10d collectives (either API)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        kinds = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")
        kinds += ("all_to_all", "alltoall", "broadcast")
        if ns in ("c10d", "_c10d_functional") and any(k in func.__name__ for k in kinds):
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            if tensors:
                self.calls += 1
                self.ops[str(func)] = self.ops.get(str(func), 0) + 1
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _shardkit_step_fn(model, x, world):
    import numpy as np

    import shardkit.spmd as xs

    mesh = xs.Mesh(np.arange(world), (world,), ("model",))
    plan = {"fc1.weight": ("model", None), "fc1.bias": ("model",), "fc2.weight": (None, "model")}
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        spec = plan.get(name, (None,) * p.ndim)
        setattr(model.get_submodule(owner), leaf, xs.mark_sharding(p, mesh, spec))
    sx = xs.mark_sharding(x, mesh, (None, None))

    def step():
        out = model(sx)
        loss = out.square().mean().full_tensor()
        loss.backward()
        return loss

    return step


def _dtensor_step_fn(model, x, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def step():
        out = model(x)
        loss = out.square().mean()
        loss.backward()
        return loss

    return step


def _worker(rank, world, port, cfg, queue):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    import shardkit.runtime as xr

    xr.init(backend="gloo")
    import torch.distributed as dist

    torch.manual_seed(0)
    base = MLP(cfg["dim"], cfg["hidden"])
    x = torch.randn(cfg["batch"], cfg["dim"], generator=torch.Generator().manual_seed(1))
    import copy

    steps = {
        "shardkit": _shardkit_step_fn(copy.deepcopy(base), x, world),
        "dtensor": _dtensor_step_fn(copy.deepcopy(base), x, world),
    }
    losses, comm = {}, {}
    for name, step in steps.items():
        for _ in range(2):  # warm-up (also the correctness check)
            losses[name] = float(step())
        if name == "shardkit":
            import shardkit.spmd as xs

            with xs.count_collectives() as counts:
                step()
            comm[name] = (counts.total_calls(), counts.total_bytes(), str(dict(counts.calls)))
        else:
            with _CollectiveBytes() as counter:
                step()
            comm[name] = (counter.calls, counter.bytes, str(counter.ops))
    times = {name: [] for name in steps}
    for round_ in range(cfg["repeats"]):
        order = list(steps.items())
        for name, step in order if round_ % 2 == 0 else order[::-1]:  # ABBA: no order bias
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["inner"]):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / cfg["inner"])
    if rank == 0:
        queue.put({"losses": losses, "comm": comm, "times": times})
    dist.destroy_process_group()


def run(world: int, cfg: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    sk, dt = (statistics.median(result["times"][k]) for k in ("shardkit", "dtensor"))
    return {
        "ranks": world,
        "shardkit_step_ms": round(sk * 1e3, 3),
        "dtensor_step_ms": round(dt * 1e3, 3),
        "step_time_ratio": round(sk / dt, 3),
        "shardkit_bytes": result["comm"]["shardkit"][1],
        "dtensor_bytes": result["comm"]["dtensor"][1],
        "bytes_ratio": round(
            result["comm"]["shardkit"][1] / max(result["comm"]["dtensor"][1], 1), 3
        ),
        "shardkit_collectives": result["comm"]["shardkit"][0],
        "dtensor_collectives": result["comm"]["dtensor"][0],
        "shardkit_collective_kinds": result["comm"]["shardkit"][2],
        "dtensor_collective_kinds": result["comm"]["dtensor"][2],
        "loss_diff": abs(result["losses"]["shardkit"] - result["losses"]["dtensor"]),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repeats")
    args = ap.parse_args(argv)
    if args.quick:
        cfg = {"dim": 64, "hidden": 256, "batch": 16, "repeats": 3, "inner": 2}
    else:
        cfg = {"dim": 1024, "hidden": 4096, "batch": 64, "repeats": 10, "inner": 5}
    rows = [run(world, cfg) for world in (2, 4)]
    for r in rows:
        print(
            f"{r['ranks']} ranks: shardkit {r['shardkit_step_ms']} ms vs DTensor "
            f"{r['dtensor_step_ms']} ms (x{r['step_time_ratio']}), bytes "
            f"{r['shardkit_bytes']} vs {r['dtensor_bytes']}",
            file=sys.stderr,
        )
    print(json.dumps({"model": cfg, "results": rows}))


if __name__ == "__main__":
    main()
