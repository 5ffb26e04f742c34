"""Incremental vs full checkpoints with 90% frozen state (a frozen base model plus trained
adapters and their Adam state), CheckpointManager, 1 process; torch DCP's full save (it has
no incremental mode) side by side as the reference. Prints one JSON line.

Figures: per-save bytes written and time (median over steps), disk use of 10 retained
steps, bit-exact restores, and two ways to decide that a chunk is unchanged: its XXH3
block checksums alone (not collision safe, shown for scale) against the byte comparison
with the base that shardkit does.

    python benchmarks/bench_incremental.py [--quick] [--mib N]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from shardkit.checkpoint import CheckpointManager, read_metadata

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="smoke run: 32 MiB, 4 steps")
parser.add_argument("--mib", type=int, help="state size in MiB (default 512, quick 32)")
args = parser.parse_args()
torch.set_num_threads(1)
total = (args.mib or (32 if args.quick else 512)) << 20  # bytes of state
steps = 4 if args.quick else 10
frozen_n = int(total * 0.9) // 4 // 16  # 16 frozen tensors, float32
train_n = (total - 16 * frozen_n * 4) // 4 // 4  # adapters + 3 Adam-like tensors
g = torch.Generator().manual_seed(0)
state = {
    "base": {f"layer{i}": torch.randn(frozen_n, generator=g) for i in range(16)},
    "lora": {"a": torch.randn(train_n, generator=g), "b": torch.randn(train_n, generator=g)},
    "optim": {"m": torch.zeros(train_n), "v": torch.zeros(train_n)},
}
trainable = [state["lora"]["a"], state["lora"]["b"], state["optim"]["m"], state["optim"]["v"]]
root = tempfile.mkdtemp()


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run(incremental: bool) -> dict:
    url = f"{root}/{'inc' if incremental else 'full'}"
    mgr = CheckpointManager(
        url, 1, max_to_keep=10, incremental=incremental, chkpt_on_preemption=False
    )
    times, written, saved = [], [], {}
    for step in range(steps + 1):
        for t in trainable:
            t.add_(0.001 * (step + 1))
        before = du(url) if os.path.isdir(url) else 0
        t0 = time.perf_counter()
        mgr.save(step, state)
        dt = time.perf_counter() - t0
        mgr.join()
        if step > 0:  # step 0 is a full save either way
            times.append(dt)
            written.append(du(url) - before)
        saved[step] = [t.clone() for t in trainable]
    exact = True
    for step in mgr.all_steps():
        target = {p: {k: torch.empty_like(v) for k, v in d.items()} for p, d in state.items()}
        mgr.restore(step, target)
        got = [target["lora"]["a"], target["lora"]["b"], target["optim"]["m"], target["optim"]["v"]]
        exact &= all(torch.equal(a, b) for a, b in zip(got, saved[step]))
        exact &= all(torch.equal(target["base"][k], state["base"][k]) for k in state["base"])
    mgr.close()
    out = {
        "save_s": statistics.median(times),
        "save_s_spread": [min(times), max(times)],
        "bytes_per_save": statistics.median(written),
        "disk_bytes": du(url),
        "restores_exact": exact,
    }
    if incremental:
        md = read_metadata(f"{url}/step_{steps:08d}")
        out["shared_fraction"] = md.shared_bytes() / total
    return out


def dedup_check_costs() -> dict:
    """Time to confirm the frozen chunks unchanged: hash only, vs hash + byte comparison."""
    from shardkit.checkpoint._core._incremental import _same_bytes, check_sibling, open_base
    from shardkit.checkpoint._core._save import bytes_view
    from shardkit.checkpoint._core._storage import FileSystemWriter

    base_url = f"{root}/inc/step_{steps:08d}"
    base = open_base(check_sibling(FileSystemWriter(f"{root}/inc/probe"), base_url))
    frozen = [
        (base.chunks[(f"base.layer{i}", c.box.offsets, c.box.sizes)][1], state["base"][f"layer{i}"])
        for i in range(16)
        for c in base.metadata.tensors[f"base.layer{i}"].chunks
    ]
    t0 = time.perf_counter()
    for chunk, t in frozen:
        view = bytes_view(t)
        block = chunk.block_rows * 4
        sums = [xxhash.xxh3_64_hexdigest(view[s : s + block]) for s in range(0, len(view), block)]
        assert tuple(sums) == chunk.checksums
    hash_only = time.perf_counter() - t0
    t0 = time.perf_counter()
    for chunk, t in frozen:
        assert _same_bytes(base, chunk, bytes_view(t))
    verify = time.perf_counter() - t0
    return {"hash_only_s": hash_only, "byte_compare_s": verify}


def dcp_full() -> float:
    ts = []
    for r in range(min(3, steps)):
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=f"{root}/dcp{r}", no_dist=True)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


try:
    full = run(False)
    inc = run(True)
    costs = dedup_check_costs()
    dcp_s = dcp_full()
    print(
        json.dumps(
            {
                "bench": "incremental",
                "state_bytes": total,
                "frozen_fraction": 16 * frozen_n * 4 / total,
                "retained_steps": steps,
                "full": full,
                "incremental": inc,
                "bytes_ratio": inc["bytes_per_save"] / full["bytes_per_save"],
                "time_ratio": inc["save_s"] / full["save_s"],
                "disk_ratio": inc["disk_bytes"] / full["disk_bytes"],
                "dedup_check": costs,
                "torch_dcp_full_save_s": dcp_s,
                "full_vs_torch_dcp": full["save_s"] / dcp_s,
                "incremental_vs_torch_dcp": inc["save_s"] / dcp_s,
            }
        )
    )
finally:
    shutil.rmtree(root, ignore_errors=True)
