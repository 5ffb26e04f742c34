"""shardkit.checkpoint vs torch.distributed.checkpoint on the same state, side by side.

2 ranks (gloo, CPU), >= 1 GiB of state: DTensor shards (Shard(0)) plus plain replicated
tensors; fsync on for both. Prints one JSON line of medians and shardkit/torch ratios.

    .venv/bin/python benchmarks/bench_checkpoint.py            # 1 GiB, 7 repeats
    .venv/bin/python benchmarks/bench_checkpoint.py --quick    # 64 MiB smoke run
    .venv/bin/python benchmarks/bench_checkpoint.py --reshard-only --repeats 7
    .venv/bin/python benchmarks/bench_checkpoint.py --save-only --repeats 9
    .venv/bin/python benchmarks/bench_checkpoint.py --checks-only --repeats 5

``--checks-only`` isolates the cost of the reader's safety checks (issue 15: metadata
checksum, bounds, chunk tiling, file names, file sizes and safetensors headers), of the
writer's metadata seal, and of the replica check (saves with ``verify_replicas`` on and
off, alternating), as a share of a whole load and save of the same state.
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


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _timed(fn, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    barrier()
    return time.perf_counter() - t0


def _state(total_mib: int, rank: int):
    """75% sharded DTensors (Shard(0) over 2 ranks), 25% replicated plain tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    sharded_mib, rep_mib = total_mib * 3 // 4, total_mib // 4
    n_sh, n_rep = 12, 8
    rows_sh = sharded_mib * MiB // 4 // n_sh // 1024
    rows_rep = rep_mib * MiB // 4 // n_rep // 1024
    g = torch.Generator().manual_seed(0)
    sd = {"model": {}, "step": 7}
    for i in range(n_sh):
        local = torch.randn(rows_sh // 2, 1024, generator=g).add_(rank)
        sd["model"][f"sharded{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows_sh, 1024), stride=(1024, 1)
        )
    for i in range(n_rep):
        sd["model"][f"rep{i}"] = torch.randn(rows_rep, 1024, generator=g)
    return sd


def _local_tensors(sd):
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in sd["model"].values()]


def _memcpy(tensors, share: int) -> dict:
    """Seconds for one copy of the rank's state, and of its first ``share`` bytes, into
    preallocated, already-touched buffers (the strictest memcpy baseline): with
    ``copy_`` (a plain memcpy)."""
    import torch

    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    part, left = [], share
    for t in flat:
        part.append(t[: max(0, min(left, t.numel()))])
        left -= part[-1].numel()
    out = {}
    for name, srcs, copy in (
        ("state", flat, torch.Tensor.copy_),
        ("share", part, torch.Tensor.copy_),
    ):
        dst = [torch.empty_like(t) for t in srcs]
        for d, t in zip(dst, srcs):
            copy(d, t)
        t0 = time.perf_counter()
        for d, t in zip(dst, srcs):
            copy(d, t)
        out[name] = time.perf_counter() - t0
    return out


def _main_phase(root: str, total_mib: int, repeats: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor  # noqa: F401  (import cost outside the base)

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core._save import join_cleanups

    rank = dist.get_rank()
    barrier = dist.barrier
    init_device_mesh("cpu", (2,))
    base_rss = _rss("VmRSS")  # after imports: the RSS figure is about the save's own memory
    sd = _state(total_mib, rank)
    locals_ = _local_tensors(sd)
    state_bytes = sum(t.numel() * t.element_size() for t in locals_)
    out: dict = {"state_bytes_rank": state_bytes}

    # -- async first, so shardkit's peak RSS is not inflated by earlier allocations ---------
    sk = {"async_block": [], "save": [], "load": []}
    th = {"async_block": [], "save": [], "load": []}
    peak, memcpy, share = 0, {"state": [], "share": []}, 0
    for i in range(repeats + 1):
        barrier()
        _reset_peak()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{root}/sk_async")
        blocked = time.perf_counter() - t0
        md = fut.result()
        peak = max(peak, _rss("VmHWM") - base_rss)
        share = sum(
            c.nbytes for t in md.tensors.values() for c in t.chunks if f"-{rank:05d}-" in c.file
        )
        if i:  # the first call allocates the reusable staging buffer
            sk["async_block"].append(blocked)
            # one plain memcpy of the same bytes, right after, under the same conditions
            for name, seconds in _memcpy(locals_, share).items():
                memcpy[name].append(seconds)
    out["async_peak_rss_over_base"] = peak
    out["rank_share_bytes"] = share

    # -- save and load, shardkit and torch interleaved so both see the same conditions ------
    for _ in range(repeats):
        sk["save"].append(_timed(lambda: dcp.save(sd, checkpoint_id=f"{root}/sk"), barrier))
        # shardkit deletes the superseded files in the background after save() returns;
        # let that finish (untimed) so it cannot slow the next timed save of either library
        join_cleanups()
        th["save"].append(_timed(lambda: tdcp.save(sd, checkpoint_id=f"{root}/th"), barrier))
    for _ in range(repeats):
        sk["load"].append(_timed(lambda: dcp.load(sd, checkpoint_id=f"{root}/sk"), barrier))
        th["load"].append(_timed(lambda: tdcp.load(sd, checkpoint_id=f"{root}/th"), barrier))
    for i in range(repeats + 1):
        barrier()
        t0 = time.perf_counter()
        fut = tdcp.async_save(sd, checkpoint_id=f"{root}/th_async")
        blocked = time.perf_counter() - t0
        fut.result()
        if i:
            th["async_block"].append(blocked)
    barrier()
    med = statistics.median
    out["shardkit"] = {k: med(v) for k, v in sk.items()}
    out["torch"] = {k: med(v) for k, v in th.items()}
    out["samples"] = {"shardkit": sk, "torch": th}
    out["memcpy_state"] = med(memcpy["state"])
    out["memcpy_share"] = med(memcpy["share"])
    return out


def _save_phase(root: str, total_mib: int, repeats: int) -> dict:
    """Only the interleaved blocking saves of the main phase (every sample kept)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core._save import join_cleanups

    init_device_mesh("cpu", (2,))
    sd = _state(total_mib, dist.get_rank())
    sk, th = [], []
    for _ in range(repeats):
        sk.append(_timed(lambda: dcp.save(sd, checkpoint_id=f"{root}/sk"), dist.barrier))
        join_cleanups()
        th.append(_timed(lambda: tdcp.save(sd, checkpoint_id=f"{root}/th"), dist.barrier))
    return {"shardkit": sk, "torch": th}


def _checks_phase(root: str, total_mib: int, repeats: int) -> dict:
    """Save and load times, and the time of the checks alone on the same checkpoint: what
    ``load`` runs before reading data (parse + validate the metadata, check every file's
    size and header) and what ``save`` adds (sealing the metadata with its checksum)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint._core._format import Metadata
    from shardkit.checkpoint._core._save import join_cleanups
    from shardkit.checkpoint._core._validate import check_files, seal_metadata

    init_device_mesh("cpu", (2,))
    sd = _state(total_mib, dist.get_rank())
    out: dict = {k: [] for k in ("save", "load", "torch_save", "torch_load")}
    out.update({"load_checks": [], "save_checks": [], "save_no_replica_check": []})
    for i in range(repeats):
        # with and without the replica check, in alternating order (same load on both)
        for check in (True, False) if i % 2 else (False, True):
            seconds = _timed(
                lambda c=check: dcp.save(sd, checkpoint_id=f"{root}/sk", verify_replicas=c),
                dist.barrier,
            )
            out["save" if check else "save_no_replica_check"].append(seconds)
            join_cleanups()
        out["torch_save"].append(
            _timed(lambda: tdcp.save(sd, checkpoint_id=f"{root}/th"), dist.barrier)
        )
    for _ in range(repeats):
        out["load"].append(_timed(lambda: dcp.load(sd, checkpoint_id=f"{root}/sk"), dist.barrier))
        out["torch_load"].append(
            _timed(lambda: tdcp.load(sd, checkpoint_id=f"{root}/th"), dist.barrier)
        )
    reader = dcp.FileSystemReader(f"{root}/sk")
    for _ in range(repeats):
        t0 = time.perf_counter()
        md = Metadata.from_json(reader.read_metadata(), "metadata.json")
        check_files(reader, md, set(md.files), {})  # every file: an upper bound per rank
        out["load_checks"].append(time.perf_counter() - t0)
        md.version = 1  # the unsealed body, then the seal alone
        body = md.to_json()
        t0 = time.perf_counter()
        seal_metadata(body)
        out["save_checks"].append(time.perf_counter() - t0)
    out["metadata_bytes"] = len(body)
    return out


def _reshard_save(root: str, total_mib: int, world: int) -> None:
    import torch

    import shardkit.checkpoint as dcp
    import shardkit.spmd as xs

    rows = total_mib * MiB // 4 // 8 // 1024
    if world == 4:
        mesh, spec = xs.Mesh([0, 1, 2, 3], (2, 2), ("x", "y")), ("x", "y")
    else:
        mesh, spec = xs.Mesh([0, 1], (2,), ("x",)), ("x", None)
    sd = {}
    for i in range(8):
        full = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(i))
        sd[f"w{i}"] = xs.mark_sharding(full, mesh, spec)
        del full
    dcp.save(sd, checkpoint_id=f"{root}/re{world}")


def _reshard_load(root: str, total_mib: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import shardkit.checkpoint as dcp
    import shardkit.spmd as xs

    rows = total_mib * MiB // 4 // 8 // 1024
    mesh = xs.Mesh([0, 1], (2,), ("x",))
    sd = {f"w{i}": xs.ShardedTensor.from_local(torch.empty(rows // 2, 1024), mesh, ("x", None),
                                               (rows, 1024)) for i in range(8)}  # fmt: skip
    same, resharded = [], []
    dcp.load(sd, checkpoint_id=f"{root}/re2")  # warm both
    dcp.load(sd, checkpoint_id=f"{root}/re4")
    for _ in range(repeats):
        same.append(_timed(lambda: dcp.load(sd, checkpoint_id=f"{root}/re2"), dist.barrier))
        resharded.append(_timed(lambda: dcp.load(sd, checkpoint_id=f"{root}/re4"), dist.barrier))
    return {"same": statistics.median(same), "resharded": statistics.median(resharded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat")
    parser.add_argument("--mib", type=int, default=1024, help="total state size in MiB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument(
        "--reshard-only", action="store_true", help="only the 4->2 vs same-layout load figure"
    )
    parser.add_argument("--save-only", action="store_true", help="only the save-time figure")
    parser.add_argument(
        "--checks-only", action="store_true", help="only the safety checks' share of save/load"
    )
    args = parser.parse_args()
    mib, repeats = (64, 1) if args.quick else (args.mib, args.repeats)
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    if args.checks_only:
        try:
            res = run_ranks(_checks_phase, 2, root, mib, repeats, timeout=3600)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list)}
        spread = {
            k: [round(min(v), 6), round(max(v), 6)] for k, v in res.items() if isinstance(v, list)
        }
        print(json.dumps({"bench": "checkpoint-checks", "state_mib": mib, "repeats": repeats,
                          "loadavg_1m_at_end": os.getloadavg()[0],
                          "metadata_bytes": res["metadata_bytes"], "median_s": med,
                          "min_max_s": spread,
                          "ratios": {"load_checks_vs_load": med["load_checks"] / med["load"],
                                     "save_checks_vs_save": med["save_checks"] / med["save"],
                                     "replica_check_vs_save": med["save"]
                                     / med["save_no_replica_check"] - 1,
                                     "save": med["save"] / med["torch_save"],
                                     "load": med["load"] / med["torch_load"]},
                          "targets": {"load_checks_vs_load": 0.03,
                                      "save_checks_vs_save": 0.03,
                                      "replica_check_vs_save": 0.03}}))  # fmt: skip
        return
    if args.save_only:
        try:
            res = run_ranks(_save_phase, 2, root, mib, repeats, timeout=3600)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = {lib: statistics.median(v) for lib, v in res.items()}
        print(json.dumps({"bench": "checkpoint-save", "state_mib": mib, "repeats": repeats,
                          "loadavg_1m_at_end": os.getloadavg()[0], "save_s": med,
                          "samples_s_rank0": {k: [round(x, 3) for x in v] for k, v in res.items()},
                          "ratios": {"save": med["shardkit"] / med["torch"]},
                          "targets": {"save": 0.8}}))  # fmt: skip
        return
    try:
        if not args.reshard_only:
            main_res = run_ranks(_main_phase, 2, root, mib, repeats, timeout=3600)
            for name in ("sk", "sk_async", "th", "th_async"):
                shutil.rmtree(f"{root}/{name}", ignore_errors=True)
        run_ranks(_reshard_save, 4, root, mib, 4, timeout=3600)
        run_ranks(_reshard_save, 2, root, mib, 2, timeout=3600)
        re = run_ranks(_reshard_load, 2, root, mib, repeats, timeout=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    re_same = max(r["same"] for r in re)
    re_resharded = max(r["resharded"] for r in re)
    if args.reshard_only:
        ratio = re_resharded / re_same
        print(json.dumps({"bench": "checkpoint-reshard", "state_mib": mib, "repeats": repeats,
                          "loadavg_1m_at_end": os.getloadavg()[0],
                          "reshard_load_s": {"same_layout": re_same, "4_to_2": re_resharded},
                          "ratios": {"reshard_vs_same_load": ratio},
                          "targets": {"reshard_vs_same_load": 1.3}}))  # fmt: skip
        return
    r0 = main_res[0]
    sk, th = r0["shardkit"], r0["torch"]
    worst_rss = max(
        r["async_peak_rss_over_base"] / (r["state_bytes_rank"] + 1.1 * r["rank_share_bytes"])
        for r in main_res
    )
    result = {
        "bench": "checkpoint",
        "ranks": 2,
        "state_mib": mib,
        "repeats": repeats,
        "fsync": True,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "shardkit_s": sk,
        "torch_s": th,
        "samples_s_rank0": {
            lib: {k: [round(x, 3) for x in v] for k, v in d.items()}
            for lib, d in r0["samples"].items()
        },
        "memcpy_s": {
            "rank_state": r0["memcpy_state"],
            "rank_share": r0["memcpy_share"],
        },
        "bytes_rank0": {"state": r0["state_bytes_rank"], "share": r0["rank_share_bytes"]},
        "reshard_load_s": {"same_layout": re_same, "4_to_2": re_resharded},
        "ratios": {
            "save": sk["save"] / th["save"],
            "load": sk["load"] / th["load"],
            "async_block": sk["async_block"] / th["async_block"],
            "async_block_vs_memcpy": sk["async_block"] / r0["memcpy_share"],
            "async_block_vs_memcpy_of_whole_rank_state": sk["async_block"] / r0["memcpy_state"],
            "reshard_vs_same_load": re_resharded / re_same,
            "async_peak_rss_vs_state_plus_1.1_share": worst_rss,
        },
        "targets": {
            "save": 0.8,
            "load": 0.8,
            "async_block": 0.25,
            "async_block_vs_memcpy": 1.5,
            "reshard_vs_same_load": 1.3,
            "async_peak_rss_vs_state_plus_1.1_share": 1.0,
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
