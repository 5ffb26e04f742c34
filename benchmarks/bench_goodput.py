"""Goodput: training time lost to checkpointing, shardkit vs torch DCP (2 ranks, gloo).

Each rank trains a transformer-style stack (embedding, ``--layers`` encoder layers of
width ``--d-model``, Adam) for ``--steps`` timed steps, checkpointing every k steps:

- ``none``: no checkpoints (each framework's own baseline);
- ``torch``: torch FSDP2 (``fully_shard``) / torch DDP with ``dcp.async_save`` as torch's
  async recipe does it: a gloo process group for checkpointing, ``get_state_dict``, and
  the previous save's future awaited before the next save;
- ``shardkit``: shardkit FSDP / DDP with ``shardkit.checkpoint.async_save`` (zero-stall);
- ``manager``: the same with ``CheckpointManager.save_async``.

Figures per (wrapper, method, k): overhead = time with checkpoints / time without - 1
(against the same framework's ``none`` run), seconds lost per save (time with checkpoints
minus time without, over the number of saves), blocking per save (time in the save call
plus, for shardkit, optimizer steps waiting for staging; for torch, the recipe's wait for
the previous save), peak RSS (VmHWM, reset per run) and bytes written per save. Every
run waits for its last save, inside the timed span. One JSON line on rank 0.
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
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Net(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _build(framework: str, wrapper: str, args):
    torch.manual_seed(0)
    model = Net(args.vocab, args.d_model, args.layers)
    if framework == "torch":
        if wrapper == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        else:
            model = nn.parallel.DistributedDataParallel(model)
    else:
        if wrapper == "fsdp":
            from shardkit.fsdp import FSDP

            model = FSDP(model, auto_wrap_policy=_layer_policy)
        else:
            from shardkit.ddp import DistributedDataParallel

            model = DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _layer_policy(module, recurse, nonwrapped_numel):
    return recurse or isinstance(module, nn.TransformerEncoderLayer)


def _rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _rss_peak_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


class _Saver:
    """One checkpointing method; ``save(step)`` returns the seconds the caller blocked."""

    def __init__(self, method, model, opt, root, k, ckpt_group):
        self.method, self.model, self.opt, self.root, self.k = method, model, opt, root, k
        self.group, self.future, self.dirs, self.bytes = ckpt_group, None, [], []
        self.mgr = None
        if method == "manager":
            from shardkit.checkpoint import CheckpointManager

            self.mgr = CheckpointManager(f"{root}/mgr", k, max_to_keep=2)

    def _state(self):
        if self.method == "torch":
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.opt)
        else:
            from shardkit.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def _retire(self):
        """Wait for the previous save; delete the one before it (both methods alike)."""
        if self.future is not None:
            self.future.result()
            self.future = None
            self.bytes.append(_dir_bytes(self.dirs[-1]))
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def save(self, step: int) -> float:
        if self.method == "manager":
            start = time.perf_counter()
            self.mgr.save_async(step, self._state())
            return time.perf_counter() - start
        if step % self.k:
            return 0.0
        start = time.perf_counter()
        self._retire()
        path = f"{self.root}/step-{step}"
        if self.method == "torch":
            import torch.distributed.checkpoint as dcp

            self.future = dcp.async_save(
                self._state(), checkpoint_id=path, process_group=self.group
            )
        else:
            import shardkit.checkpoint as sk

            self.future = sk.async_save(self._state(), checkpoint_id=path)
        self.dirs.append(path)
        return time.perf_counter() - start

    def finish(self) -> None:
        if self.mgr is not None:
            self.mgr.join()
            steps = self.mgr.all_steps()
            if steps:
                self.bytes.append(_dir_bytes(f"{self.root}/mgr") / len(steps))
            self.mgr.close()  # before its directory is removed: stops the lease heartbeat
        else:
            self._retire()


def _run(framework, wrapper, method, k, args, root, ckpt_group):
    from shardkit.checkpoint._core._zero_stall import STATS

    model, opt = _build(framework, wrapper, args)
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(args.vocab, (args.batch, args.seq), generator=g)

    def step():
        opt.zero_grad()
        out = model(batch)
        nn.functional.cross_entropy(out.flatten(0, 1), batch.flatten()).backward()
        opt.step()

    for _ in range(2):  # warm-up: optimizer state exists, allocator settled
        step()
    saver = None if method == "none" else _Saver(method, model, opt, root, k, ckpt_group)
    dist.barrier()
    _rss_reset()
    waited = STATS.wait_s
    blocks = []
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        step()
        if saver is not None:
            blocked = saver.save(i)
            if i % k == 0:  # a save was due (the manager's other calls are in total_s)
                blocks.append(blocked)
    if saver is not None:
        saver.finish()
    dist.barrier()
    total = time.perf_counter() - start
    step_wait = STATS.wait_s - waited if framework == "shardkit" else 0.0
    saves = max(1, len(blocks))
    return {
        "total_s": total,
        "saves": len(blocks),
        "block_ms_median": 1e3 * statistics.median(blocks) if blocks else 0.0,
        "step_wait_ms_per_save": 1e3 * step_wait / saves,
        "peak_rss_mib": round(_rss_peak_mib(), 1),
        "bytes_per_save": int(statistics.median(saver.bytes)) if saver and saver.bytes else 0,
    }


def _rounded(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {n: _rounded(x) for n, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_group = dist.new_group(backend="gloo")  # torch's recipe: a group for checkpointing
    runs: dict[str, list[dict]] = {}
    ratios: dict[str, list] = {}
    base = tempfile.mkdtemp(prefix="goodput-") if rank == 0 else None
    holder = [base]
    dist.broadcast_object_list(holder)
    base = holder[0]
    fws = [("torch", ["torch"]), ("shardkit", [m for m in ("shardkit", "manager")
                                               if m in args.methods])]  # fmt: skip
    for wrapper in args.wrappers:
        for rep in range(args.repeats):  # repeats interleave, so all see the same load
            over: dict[str, float] = {}
            lost: dict[str, float] = {}
            for framework, methods in fws[:: 1 if rep % 2 == 0 else -1]:
                none = _run(framework, wrapper, "none", 0, args, base, ckpt_group)
                runs.setdefault(f"{wrapper}/{framework}/none", []).append(none)
                for method in methods:
                    for k in args.ks:
                        root = f"{base}/{wrapper}-{method}-{k}"
                        r = _run(framework, wrapper, method, k, args, root, ckpt_group)
                        r["overhead"] = over[f"{method}/{k}"] = r["total_s"] / none["total_s"] - 1
                        r["lost_s_per_save"] = lost[f"{method}/{k}"] = (
                            r["total_s"] - none["total_s"]
                        ) / max(1, r["saves"])
                        runs.setdefault(f"{wrapper}/{method}/k={k}", []).append(r)
                        dist.barrier()
                        if rank == 0:
                            shutil.rmtree(root, ignore_errors=True)
            # the headline ratio: shardkit's overhead / torch's; and seconds lost per save,
            # which the two frameworks' different step times do not skew
            for name, table in (("overhead_ratio", over), ("lost_per_save_ratio", lost)):
                for k in args.ks:
                    t, sk = table[f"torch/{k}"], table.get(f"shardkit/{k}")
                    if sk is not None:
                        ratio = sk / t if t > 0 else None
                        ratios.setdefault(f"{wrapper}/{name}/k={k}", []).append(ratio)
    results: dict = {}
    for key, rs in runs.items():  # medians over the repeats, and the overheads' spread
        results[key] = {n: statistics.median(r[n] for r in rs) for n in rs[0]}
        if "overhead" in rs[0]:
            results[key]["overhead_min_max"] = [min(r["overhead"] for r in rs),
                                                max(r["overhead"] for r in rs)]  # fmt: skip
    for key, vals in ratios.items():
        ok = [v for v in vals if v is not None]
        results[key] = statistics.median(ok) if ok else None
        results[key.replace("_ratio/", "_ratio_samples/")] = vals
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        params = sum(p.numel() for p in Net(args.vocab, args.d_model, args.layers).parameters())
        out = {"bench": "goodput", "ranks": world, "params_m": round(params / 1e6, 1),
               "state_mib": round(3 * 4 * params / 2**20), "steps": args.steps,
               "d_model": args.d_model, "layers": args.layers, "repeats": args.repeats,
               "loadavg_1m_at_end": os.getloadavg()[0]}  # fmt: skip
        out.update({k: _rounded(v) for k, v in results.items()})
        print(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ks", default="1,5,20", help="checkpoint every k steps")
    parser.add_argument("--wrappers", default="fsdp,ddp")
    parser.add_argument("--methods", default="torch,shardkit,manager",
                        help="which savers run (torch and none always do)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved repeats; figures are medians over them")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="tiny model: proves it runs")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.layers, args.vocab, args.steps = 128, 2, 1024, 10
    args.ks = [int(k) for k in args.ks.split(",")]
    args.wrappers = args.wrappers.split(",")
    args.methods = args.methods.split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
