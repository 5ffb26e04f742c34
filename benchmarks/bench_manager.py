"""Manager vs torch DCP: blocking time of async save, total time of sync save (1 rank, gloo).

python benchmarks/bench_manager.py [--quick]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import free_port

from shardkit.checkpoint import CheckpointManager
from shardkit.checkpoint import save as sk_save

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, 2 repeats")
args = parser.parse_args()
# a free port: a fixed one fails when another job on the machine holds it
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
n = (1 << 20) if args.quick else (8 << 20)  # float32 elements per tensor
state = {f"t{i}": torch.randn(n) for i in range(4)}  # 4 x 32 MiB = 128 MiB (full run)
reps = 2 if args.quick else 5
root = tempfile.mkdtemp()


def med(f):
    ts = []
    for r in range(reps):
        ts.append(f(r))
    return statistics.median(ts)


mgr = CheckpointManager(f"{root}/mgr", 1, max_to_keep=2, chkpt_on_preemption=False)
step = [0]


def mgr_async(r):
    mgr.join()
    step[0] += 1
    t = time.perf_counter()
    mgr.save_async(step[0], state)
    d = time.perf_counter() - t
    mgr.join()
    return d


def mgr_sync(r):
    step[0] += 1
    t = time.perf_counter()
    mgr.save(step[0], state)
    d = time.perf_counter() - t
    mgr.join()
    return d


def core_sync(r):
    t = time.perf_counter()
    sk_save(state, checkpoint_id=f"{root}/core{r}")
    return time.perf_counter() - t


def dcp_async(r):
    t = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=f"{root}/dcpa{r}")
    d = time.perf_counter() - t
    fut.result()
    return d


def dcp_sync(r):
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=f"{root}/dcps{r}")
    return time.perf_counter() - t


def dcp_load(r):
    tgt = {k: torch.empty_like(v) for k, v in state.items()}
    t = time.perf_counter()
    dcp.load(tgt, checkpoint_id=f"{root}/dcps0")
    return time.perf_counter() - t


def mgr_restore(r):
    tgt = {k: torch.empty_like(v) for k, v in state.items()}
    t = time.perf_counter()
    mgr.restore(mgr.latest_step(), tgt)
    return time.perf_counter() - t


for f in (mgr_async, dcp_async, mgr_sync, core_sync, dcp_sync):  # warm-up
    f(99)
res = {
    k: med(f)
    for k, f in [
        ("mgr_save_async_block_s", mgr_async),
        ("dcp_async_save_block_s", dcp_async),
        ("mgr_save_s", mgr_sync),
        ("core_save_s", core_sync),
        ("dcp_save_s", dcp_sync),
        ("mgr_restore_s", mgr_restore),
        ("dcp_load_s", dcp_load),
    ]
}
res["mb"] = 4 * n * 4 / 2**20
res["async_block_ratio_mgr_over_dcp"] = (
    res["mgr_save_async_block_s"] / res["dcp_async_save_block_s"]
)
res["save_ratio_mgr_over_dcp"] = res["mgr_save_s"] / res["dcp_save_s"]
res["mgr_overhead_over_core"] = res["mgr_save_s"] / res["core_save_s"]
res["restore_ratio_mgr_over_dcp"] = res["mgr_restore_s"] / res["dcp_load_s"]
mgr.close()
print(json.dumps({k: round(v, 4) for k, v in res.items()}))
shutil.rmtree(root)
dist.destroy_process_group()
