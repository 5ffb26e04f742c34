"""shardkit DDP against torch DDP: step time and bytes per step for every hook.

Two gloo ranks on this machine, same model, same data, same optimizer; single steps
of the two implementations are interleaved so drift in machine load hits both.
``bytes_per_step`` is what each rank hands to collectives (a ring all-reduce moves
about 2 (W-1) / W times that; the same for W = 2).
Prints a table to stderr and one JSON line (medians and ratios) to stdout.

    python benchmarks/bench_ddp.py            # full run (a few minutes on 2 CPU cores)
    python benchmarks/bench_ddp.py --quick    # smoke run
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
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HOOKS = ["none", "allreduce", "fp16", "bf16", "powerSGD", "batched_powerSGD", "noop"]


def _models():
    def mlp():
        layers = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers[:-1]), lambda g: (torch.randn(32, 1024, generator=g),)

    def transformer():
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), lambda g: (
            torch.randn(4, 48, 256, generator=g),
        )

    return {"mlp_4x1024": mlp, "transformer_4x256": transformer}


def _hooks(impl: str, name: str):
    """(state factory, hook, note) for one implementation; note says what stood in."""
    import torch.distributed.algorithms.ddp_comm_hooks as tch

    from shardkit.ddp.comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

    def ps_state(mod):
        return lambda: mod.PowerSGDState(
            None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=2
        )

    ours = {
        "allreduce": (lambda: None, default_hooks.allreduce_hook),
        "fp16": (lambda: None, default_hooks.fp16_compress_hook),
        "bf16": (lambda: None, default_hooks.bf16_compress_hook),
        "powerSGD": (ps_state(powerSGD_hook), powerSGD_hook.powerSGD_hook),
        "batched_powerSGD": (ps_state(powerSGD_hook), powerSGD_hook.batched_powerSGD_hook),
        "noop": (lambda: None, debugging_hooks.noop_hook),
    }
    ps = tch.powerSGD_hook
    theirs = {
        "allreduce": (lambda: None, tch.default_hooks.allreduce_hook),
        "fp16": (lambda: None, tch.default_hooks.fp16_compress_hook),
        "bf16": (lambda: None, tch.default_hooks.bf16_compress_hook),
        "powerSGD": (ps_state(ps), ps.powerSGD_hook),
        # torch's batched hook raises AssertionError once compression starts (see
        # torch_defects in the output), so torch's DDP runs shardkit's batched hook.
        "batched_powerSGD": ours["batched_powerSGD"],
        "noop": (lambda: None, tch.debugging_hooks.noop_hook),
    }
    if name == "none":
        return None
    return (ours if impl == "shardkit" else theirs)[name]


class _Runner:
    def __init__(self, impl, make_model, make_input, hook_name, bucket_cap_mb=25):
        from shardkit.ddp import DistributedDataParallel as SkDDP

        torch.manual_seed(0)
        self.model = make_model()
        wrapper = SkDDP if impl == "shardkit" else nn.parallel.DistributedDataParallel
        self.ddp = wrapper(self.model, bucket_cap_mb=bucket_cap_mb)
        self.note = ""
        if impl == "torch" and hook_name == "batched_powerSGD":
            self.note = "torch's hook crashes; ran shardkit's"
        spec = _hooks(impl, hook_name)
        if spec is not None:
            state_factory, hook = spec
            try:
                self.ddp.register_comm_hook(state_factory(), hook)
            except Exception as exc:  # torch refuses its bf16 hook on gloo
                self.note = f"torch refused ({type(exc).__name__}); ran shardkit's"
                state_factory, hook = _hooks("shardkit", hook_name)
                self.ddp.register_comm_hook(state_factory(), hook)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(100 + dist.get_rank())
        self.make_input = make_input

    def step(self) -> float:
        inputs = self.make_input(self.gen)
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        out = self.ddp(*inputs)
        out.float().pow(2).mean().backward()
        self.opt.step()
        return time.perf_counter() - start


def _torch_defects() -> dict:
    """Reproduce the torch PowerSGD defects shardkit fixes (recorded, not timed)."""
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as ps

    found = {}
    for name, hook in (
        ("powerSGD_zero_grad", ps.powerSGD_hook),
        ("batched", ps.batched_powerSGD_hook),
    ):
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(ps.PowerSGDState(None, start_powerSGD_iter=2), hook)
        try:
            for _ in range(4):
                model.zero_grad()
                scale = 0.0 if name.endswith("zero_grad") else 1.0
                (ddp(torch.randn(4, 64)) * scale).sum().backward()
            found[name] = "nan" if not torch.isfinite(model.weight.grad).all() else "ok"
        except Exception as exc:
            found[name] = f"{type(exc).__name__}"
    return found


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardkit.ddp import count_comm

    results = {}
    for model_name, factory in _models().items():
        if args.models and model_name not in args.models:
            continue
        make_model = lambda f=factory: f()[0]  # noqa: E731
        make_input = factory()[1]
        for n_config, hook in enumerate(args.hooks or HOOKS):
            runners = {
                impl: _Runner(impl, make_model, make_input, hook) for impl in ("shardkit", "torch")
            }
            times = {impl: [] for impl in runners}
            # The first config of a process also pays for allocator and thread warm-up.
            warmup = args.warmup + (10 if n_config == 0 else 0)
            for _ in range(warmup):
                for r in runners.values():
                    r.step()
            nbytes = 0
            # Interleave single steps, alternating which goes first, so load spikes on a
            # shared machine hit both implementations alike.
            for i in range(args.steps):
                order = list(runners) if i % 2 == 0 else list(runners)[::-1]
                for impl in order:
                    with count_comm() as counter:
                        times[impl].append(runners[impl].step())
                    if impl == "shardkit":
                        nbytes += counter.bytes
            med = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
            results.setdefault(model_name, {})[hook] = {
                "shardkit_ms": round(med["shardkit"], 3),
                "torch_ms": round(med["torch"], 3),
                # median of per-pair ratios: each pair ran back to back, under the same load
                "ratio": round(
                    statistics.median(a / b for a, b in zip(times["shardkit"], times["torch"])), 3
                ),
                "bytes_per_step": nbytes // args.steps,
                "torch_note": runners["torch"].note,
            }
            if rank == 0:
                r = results[model_name][hook]
                print(
                    f"{model_name:>18} {hook:>17}: shardkit {r['shardkit_ms']:8.2f} ms  "
                    f"torch {r['torch_ms']:8.2f} ms  ratio {r['ratio']:.3f}  "
                    f"bytes/step {r['bytes_per_step']:>10}  {r['torch_note']}",
                    file=sys.stderr,
                    flush=True,
                )
    defects = _torch_defects() if not args.quick else {}
    if rank == 0:
        queue.put((results, defects))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per config")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps (>= 3: PowerSGD on)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="3 timed steps per config")
    parser.add_argument("--hooks", nargs="*", choices=HOOKS, help="default: all")
    parser.add_argument("--models", nargs="*", choices=list(_models()), help="default: all")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = 2
    started = time.time()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = defects = None
    while results is None:
        try:
            results, defects = queue.get(timeout=5)
        except Exception:  # queue.Empty: make sure a rank has not died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("bench_ddp: a rank failed; see its traceback above") from None
    for p in procs:
        p.join()
    ratios = [h["ratio"] for m in results.values() for k, h in m.items() if k != "noop"]
    line = {
        "bench": "ddp",
        "world_size": world,
        "backend": "gloo",
        "device": "cpu",
        "torch": torch.__version__,
        "steps_per_config": args.steps,
        "results": results,
        "median_ratio": round(statistics.median(ratios), 3),
        "max_ratio": round(max(ratios), 3),
        "target_ratio": 1.1,
        "torch_defects": defects,
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
