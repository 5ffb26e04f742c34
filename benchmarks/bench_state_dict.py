"""shardkit state-dict helpers and format conversions vs their torch counterparts.

Part 1 (2 gloo ranks, CPU): an FSDP2 (``fully_shard``) MLP with Adam state; time
``get_state_dict`` (sharded and full) and ``set_state_dict`` (full) against
``torch.distributed.checkpoint.state_dict``.
Part 2 (one process): the same state as files; time shardkit's ``dcp_to_torch_save`` /
``torch_save_to_dcp`` against ``torch.distributed.checkpoint.format_utils``, and
``to_safetensors`` against "load everything, then ``safetensors.torch.save_file``", with
the peak resident memory each adds.

Prints one JSON line: ``sk_*`` are shardkit, ``torch_*`` the counterpart, ``*_ratio`` is
shardkit time / torch time (medians), ``*_peak_mib`` the peak resident memory added.

    .venv/bin/python benchmarks/bench_state_dict.py            # 64 MiB MLP, 512 MiB files
    .venv/bin/python benchmarks/bench_state_dict.py --quick    # smoke run
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
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from harness import run_ranks  # noqa: E402

MiB = 1 << 20


def _median_time(fn, repeats: int, barrier=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fsdp_phase(width: int, layers: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as tsd
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardkit.checkpoint.state_dict as ssd

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        optim.step()
        return model, optim

    model, optim = build()
    target, target_optim = build()
    barrier = dist.barrier
    out = {}
    for name, full in (("get_sharded", False), ("get_full", True)):
        ours = ssd.StateDictOptions(full_state_dict=full)
        theirs = tsd.StateDictOptions(full_state_dict=full)
        out[f"sk_{name}_s"] = _median_time(
            lambda o=ours: ssd.get_state_dict(model, optim, options=o), repeats, barrier
        )
        out[f"torch_{name}_s"] = _median_time(
            lambda o=theirs: tsd.get_state_dict(model, optim, options=o), repeats, barrier
        )
    full_sd = ssd.get_state_dict(model, optim, options=ssd.StateDictOptions(full_state_dict=True))
    msd, osd = full_sd
    tmsd, tosd = tsd.get_state_dict(
        model, optim, options=tsd.StateDictOptions(full_state_dict=True)
    )
    out["sk_set_full_s"] = _median_time(
        lambda: ssd.set_state_dict(
            target, target_optim, model_state_dict=msd, optim_state_dict=osd
        ),
        repeats,
        barrier,
    )
    out["torch_set_full_s"] = _median_time(
        lambda: tsd.set_state_dict(
            target,
            target_optim,
            model_state_dict=tmsd,
            optim_state_dict=tosd,
            options=tsd.StateDictOptions(full_state_dict=True),
        ),
        repeats,
        barrier,
    )
    return out


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM")


def _peak_added(fn) -> tuple[float, int]:
    """(seconds, peak resident bytes added) of one call."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    base = _hwm()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, _hwm() - base


def _make_files(total_mib: int, root: str) -> None:
    import torch
    import torch.distributed.checkpoint as tdcp

    import shardkit.checkpoint as dist_cp

    n = 16
    rows = total_mib * MiB // 4 // n // 1024
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(n)}
    state["step"] = 3
    dist_cp.save(state, checkpoint_id=f"{root}/sk")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=f"{root}/tdcp")
    torch.save(state, f"{root}/state.pt")


def _one_case(name: str, ours: bool, root: str) -> tuple[float, int]:
    """Run one conversion in this (fresh) process: (seconds, peak resident bytes added)."""
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint.format_utils as tfu

    import shardkit.checkpoint as dist_cp
    from shardkit.checkpoint import format_utils as fu

    def load_all_then_save_file():
        md = dist_cp.read_metadata(f"{root}/sk")
        sd = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in md.tensors.items()}
        dist_cp.load(sd, checkpoint_id=f"{root}/sk", strict=False)
        safetensors.torch.save_file(sd, f"{root}/b.safetensors")

    out = f"{root}/out-{name}-{'sk' if ours else 'torch'}"
    shutil.rmtree(out, ignore_errors=True)
    calls = {
        ("dcp_to_torch_save", True): lambda: fu.dcp_to_torch_save(
            f"{root}/sk", out, progress=False
        ),
        ("dcp_to_torch_save", False): lambda: tfu.dcp_to_torch_save(f"{root}/tdcp", out),
        ("torch_save_to_dcp", True): lambda: fu.torch_save_to_dcp(f"{root}/state.pt", out),
        ("torch_save_to_dcp", False): lambda: tfu.torch_save_to_dcp(f"{root}/state.pt", out),
        ("to_safetensors", True): lambda: fu.to_safetensors(f"{root}/sk", out, progress=False),
        ("to_safetensors", False): load_all_then_save_file,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _peak_added(calls[(name, ours)])


def _files_phase(total_mib: int, repeats: int, root: str) -> dict:
    run_ranks(_make_files, 1, total_mib, root, timeout=600)
    out = {}
    for name in ("dcp_to_torch_save", "torch_save_to_dcp", "to_safetensors"):
        for ours, tag in ((True, "sk"), (False, "torch")):
            runs = [
                run_ranks(_one_case, 1, name, ours, root, timeout=600)[0] for _ in range(repeats)
            ]
            out[f"{tag}_{name}_s"] = statistics.median(r[0] for r in runs)
            out[f"{tag}_{name}_peak_mib"] = round(max(r[1] for r in runs) / MiB, 1)
    out["files_state_mib"] = total_mib
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    args = parser.parse_args()
    width, layers, total_mib, repeats = (256, 4, 16, 1) if args.quick else (1024, 16, 512, 3)
    result = {"world_size": 2, "mlp_params_mib": round(width * (width + 1) * layers * 4 / MiB, 1)}
    result.update(run_ranks(_fsdp_phase, 2, width, layers, repeats, timeout=600)[0])
    root = tempfile.mkdtemp(prefix="bench-state-dict-")
    try:
        result.update(_files_phase(total_mib, repeats, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key in list(result):
        if key.startswith("sk_") and key.endswith("_s"):
            name = key.removeprefix("sk_").removesuffix("_s")
            result[f"{name}_ratio"] = round(result[key] / result[f"torch_{name}_s"], 3)
    for key, value in result.items():
        if isinstance(value, float) and key.endswith("_s"):
            result[key] = round(value, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
