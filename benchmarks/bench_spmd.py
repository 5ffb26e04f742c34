"""shardkit SPMD tensor parallelism against torch DTensor (ColwiseParallel / RowwiseParallel).

Same MLP (fc1 column-parallel, GELU, fc2 row-parallel), same input, forward + backward,
on 2 and 4 gloo ranks of this machine, in one run. Then a Hugging Face Llama
(``LlamaForCausalLM`` from a config, random init, GQA, SDPA, a padding mask) on 2 ranks:
shardkit's ``shard_module`` with the Megatron plan against DTensor's
``parallelize_module`` with torch's Llama-style plan (``PrepareModuleInput`` on attention
and MLP, q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``), and the same
plan with ``activations="local"`` (Megatron-style plain local activations, as DTensor's
plan has by default): forward, backward and an AdamW step; step time, bytes moved, and each side's peak RSS measured
in a world of its own (same model, same steps). The two implementations alternate
rounds (ABBA order) so drift in machine load hits both. Bytes are what one rank hands to collectives
in one step: for shardkit from ``count_collectives``, for DTensor from a dispatch mode
that sums the input bytes of the functional collectives it issues (same definition:
an all-reduce counts its tensor, an all-gather the local shard).
Prints a table to stderr and one JSON line (medians and ratios) to stdout.

    python benchmarks/bench_spmd.py            # full run
    python benchmarks/bench_spmd.py --quick    # smoke run
    python benchmarks/bench_spmd.py --llama-only   # only the Llama rows
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from unittest import mock

import torch
from _common import spawn_ranks, spread, time_abba
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
    xs.shard_module(model, mesh, plan)
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


LLAMA_PLAN = {
    "*.self_attn.q_proj.weight": ("model", None),
    "*.self_attn.k_proj.weight": ("model", None),
    "*.self_attn.v_proj.weight": ("model", None),
    "*.self_attn.o_proj.weight": (None, "model"),
    "*.mlp.gate_proj.weight": ("model", None),
    "*.mlp.up_proj.weight": ("model", None),
    "*.mlp.down_proj.weight": (None, "model"),
}


def _llama(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=cfg["seq"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _llama_batch(cfg):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    mask = torch.ones_like(ids)
    mask[-1, : cfg["seq"] // 4] = 0  # left padding on the last sequence
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _shardkit_llama_step_fn(model, batch, world, activations="sharded"):
    import numpy as np

    import shardkit.spmd as xs

    mesh = xs.Mesh(np.arange(world), (world,), ("model",))
    xs.shard_module(model, mesh, LLAMA_PLAN, activations=activations)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def _dtensor_llama_step_fn(model, batch, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Replicate()},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _warm_up_and_count(steps: dict, warmups: int) -> tuple[dict, dict]:
    """Run each side ``warmups`` times (the last loss checks agreement), then one step
    counting its collectives (and, for shardkit, its fallbacks)."""
    import shardkit.spmd as xs

    losses, comm = {}, {}
    for name, step in steps.items():
        for _ in range(warmups):
            loss = step()
            losses[name] = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if name.startswith("shardkit"):
            xs.reset_fallback_counts()
            with xs.count_collectives() as counts:
                step()
            comm[name] = (counts.total_calls(), counts.total_bytes(), str(dict(counts.calls)))
            comm[name.replace("shardkit", "fallbacks")] = dict(xs.fallback_counts())
        else:
            with _CollectiveBytes() as counter:
                step()
            comm[name] = (counter.calls, counter.bytes, str(counter.ops))
    return losses, comm


def _llama_worker(rank, world, cfg, only):
    """Time both sides (ABBA) in one world, or, with ``only``, run one side for its RSS.
    Rank 0 returns the figures."""
    import copy

    import shardkit.runtime as xr

    xr.init(backend="gloo")
    import torch.distributed as dist

    base = _llama(cfg)
    batch = _llama_batch(cfg)
    makers = {
        "shardkit": _shardkit_llama_step_fn,
        "shardkit_local": functools.partial(_shardkit_llama_step_fn, activations="local"),
        "dtensor": _dtensor_llama_step_fn,
    }
    if only is not None:
        step = makers[only](copy.deepcopy(base), batch, world)
        del base
        for _ in range(cfg["inner"] + 1):
            step()
        peak = torch.tensor([_peak_rss_mb()])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
        return float(peak) if rank == 0 else None
    steps = {name: make(copy.deepcopy(base), batch, world) for name, make in makers.items()}
    losses, comm = _warm_up_and_count(steps, 1)
    times, cpu = time_abba(steps, cfg["repeats"], cfg["inner"], dist.barrier)
    faults = {name: _minor_faults_per_step(step, cfg["inner"]) for name, step in steps.items()}
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"losses": losses, "comm": comm, "times": times, "cpu": cpu, "faults": faults}


def _minor_faults_per_step(step, num_steps: int) -> float:
    """Fresh pages this rank touched per step (the heap regrown after glibc trimmed it)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(num_steps):
        step()
    return round((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / num_steps)


#: glibc settings that stop the heap from being trimmed and regrown every step (the
#: ranks read them at start-up): with them neither side faults in fresh pages each step,
#: which separates the SPMD layers' own cost from the allocator's
STEADY_HEAP_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 26)}


def run_llama_steady_heap(world: int, cfg: dict) -> dict:
    """The timing half of :func:`run_llama`, with :data:`STEADY_HEAP_ENV` in the ranks."""
    with mock.patch.dict(os.environ, STEADY_HEAP_ENV):
        result = spawn_ranks(_llama_worker, world, cfg, None, results=1)[0]
    row = _row(world, result)
    keys = ("shardkit_step_ms", "dtensor_step_ms", "step_time_ratio", "cpu_time_ratio")
    local = _local_row(result)
    local_keys = ("local_step_ms", "local_step_time_ratio", "local_cpu_time_ratio")
    return (
        {k: row[k] for k in keys}
        | {k: local[k] for k in local_keys}
        | {"minor_faults_per_step": result["faults"]}
    )


def run_llama(world: int, cfg: dict) -> dict:
    result = spawn_ranks(_llama_worker, world, cfg, None, results=1)[0]
    rss = {
        name: spawn_ranks(_llama_worker, world, cfg, name, results=1)[0]
        for name in ("shardkit", "shardkit_local", "dtensor")
    }
    return (
        _row(world, result)
        | _local_row(result)
        | {
            "minor_faults_per_step": result["faults"],
            "shardkit_fallbacks": result["comm"]["fallbacks"],
            "local_fallbacks": result["comm"]["fallbacks_local"],
            "shardkit_peak_rss_mb": round(rss["shardkit"], 1),
            "local_peak_rss_mb": round(rss["shardkit_local"], 1),
            "dtensor_peak_rss_mb": round(rss["dtensor"], 1),
            "peak_rss_ratio": round(rss["shardkit"] / rss["dtensor"], 3),
            "local_peak_rss_ratio": round(rss["shardkit_local"] / rss["dtensor"], 3),
        }
    )


def _against_dtensor(result: dict, side: str) -> dict:
    """Medians and ratios of one shardkit side (``"shardkit"`` or ``"shardkit_local"``)
    against DTensor, from one world's timing and traffic."""
    t, c = (
        {n: statistics.median(result[k][n]) for n in (side, "dtensor")} for k in ("times", "cpu")
    )
    ours, theirs = result["comm"][side], result["comm"]["dtensor"]
    return {
        "step_ms": round(t[side] * 1e3, 3),
        "dtensor_step_ms": round(t["dtensor"] * 1e3, 3),
        "step_time_ratio": round(t[side] / t["dtensor"], 3),
        "cpu_ms": round(c[side] * 1e3, 3),
        "dtensor_cpu_ms": round(c["dtensor"] * 1e3, 3),
        "cpu_time_ratio": round(c[side] / c["dtensor"], 3),
        "bytes": ours[1],
        "bytes_ratio": round(ours[1] / max(theirs[1], 1), 3),
        "collectives": ours[0],
        "loss_diff": abs(result["losses"][side] - result["losses"]["dtensor"]),
    }


def _local_row(result: dict) -> dict:
    """``shard_module(..., activations="local")`` against DTensor, ``local_``-prefixed."""
    a = _against_dtensor(result, "shardkit_local")
    keys = ("step_ms", "step_time_ratio", "cpu_time_ratio", "bytes", "bytes_ratio",
            "collectives", "loss_diff")  # fmt: skip
    return {f"local_{k}": a[k] for k in keys}


def _row(world: int, result: dict) -> dict:
    """Medians, spreads and ratios of one world's timing and traffic."""
    a = _against_dtensor(result, "shardkit")
    return {
        "ranks": world,
        "shardkit_step_ms": a["step_ms"],
        "dtensor_step_ms": a["dtensor_step_ms"],
        "step_time_ratio": a["step_time_ratio"],
        "step_time_spread": {k: spread(v) for k, v in result["times"].items()},
        "shardkit_cpu_ms": a["cpu_ms"],
        "dtensor_cpu_ms": a["dtensor_cpu_ms"],
        "cpu_time_ratio": a["cpu_time_ratio"],
        "shardkit_bytes": a["bytes"],
        "dtensor_bytes": result["comm"]["dtensor"][1],
        "bytes_ratio": a["bytes_ratio"],
        "shardkit_collectives": a["collectives"],
        "dtensor_collectives": result["comm"]["dtensor"][0],
        "shardkit_collective_kinds": result["comm"]["shardkit"][2],
        "dtensor_collective_kinds": result["comm"]["dtensor"][2],
        "loss_diff": a["loss_diff"],
    }


def _worker(rank, world, cfg):
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
    losses, comm = _warm_up_and_count(steps, 2)
    times, cpu = time_abba(steps, cfg["repeats"], cfg["inner"], dist.barrier)
    dist.destroy_process_group()
    return {"losses": losses, "comm": comm, "times": times, "cpu": cpu} if rank == 0 else None


def run(world: int, cfg: dict) -> dict:
    return _row(world, spawn_ranks(_worker, world, cfg, results=1)[0])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repeats")
    ap.add_argument("--llama-only", action="store_true", help="skip the MLP rows")
    args = ap.parse_args(argv)
    if args.quick:
        cfg = {"dim": 64, "hidden": 256, "batch": 16, "repeats": 3, "inner": 2}
    else:
        cfg = {"dim": 1024, "hidden": 4096, "batch": 64, "repeats": 10, "inner": 5}
    if args.quick:
        llama_cfg = {"vocab": 128, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4}
        llama_cfg.update(kv_heads=2, seq=32, batch=2, repeats=3, inner=2)
    else:
        llama_cfg = {"vocab": 2048, "hidden": 512, "intermediate": 1376, "layers": 4}
        llama_cfg.update(heads=8, kv_heads=4, seq=256, batch=4, repeats=8, inner=3)
    llama_row = run_llama(2, llama_cfg)
    llama_row["steady_heap"] = run_llama_steady_heap(2, llama_cfg)
    print(
        f"Llama, 2 ranks: shardkit {llama_row['shardkit_step_ms']} ms vs DTensor "
        f"{llama_row['dtensor_step_ms']} ms (x{llama_row['step_time_ratio']}), bytes "
        f"{llama_row['shardkit_bytes']} vs {llama_row['dtensor_bytes']}, peak RSS "
        f"{llama_row['shardkit_peak_rss_mb']} vs {llama_row['dtensor_peak_rss_mb']} MB; "
        f"local activations {llama_row['local_step_ms']} ms "
        f"(x{llama_row['local_step_time_ratio']}), bytes {llama_row['local_bytes']}, peak RSS "
        f"{llama_row['local_peak_rss_mb']} MB; "
        f"minor faults per step {llama_row['minor_faults_per_step']}; with a steady heap "
        f"({' '.join(f'{k}={v}' for k, v in STEADY_HEAP_ENV.items())}): "
        f"x{llama_row['steady_heap']['step_time_ratio']}",
        file=sys.stderr,
    )
    rows = [] if args.llama_only else [run(world, cfg) for world in (2, 4)]
    for r in rows:
        print(
            f"{r['ranks']} ranks: shardkit {r['shardkit_step_ms']} ms vs DTensor "
            f"{r['dtensor_step_ms']} ms (x{r['step_time_ratio']}), bytes "
            f"{r['shardkit_bytes']} vs {r['dtensor_bytes']}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {"model": cfg, "results": rows, "llama": {"model": llama_cfg, "result": llama_row}}
        )
    )


if __name__ == "__main__":
    main()
