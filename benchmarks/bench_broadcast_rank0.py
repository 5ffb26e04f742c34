"""``set_model_state_dict(..., broadcast_from_rank0=True)``: peak memory, shardkit vs torch.

2 gloo ranks (CPU). Rank 0 holds a full state dict of ``--layers`` square Linear weights;
both ranks load it into an FSDP2 (``fully_shard``) model built on the meta device. The
figure is the peak resident memory the load adds on rank 1 (``VmHWM`` growth), which
ideally is its shard plus one tensor in flight. glibc's mmap threshold is pinned at
128 KiB (``MALLOC_MMAP_THRESHOLD_``) so freed tensors go back to the system at once;
with its default dynamic threshold, freed buffers stay in the heap and both libraries
read 20-40 MiB higher, at random.

Prints one JSON line: ``*_peak_mib`` medians over ``--repeats`` fresh worlds (spread as
min/max), ``ratio`` = shardkit / torch, and the ideal ``shard_mib + tensor_mib``.

    .venv/bin/python benchmarks/bench_broadcast_rank0.py            # 8 x 2048^2 fp32
    .venv/bin/python benchmarks/bench_broadcast_rank0.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from harness import run_ranks  # noqa: E402


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _load(which: str, layers: int, dim: int) -> float:
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    if which == "torch":
        import torch.distributed.checkpoint.state_dict as sd
    else:
        import shardkit.checkpoint.state_dict as sd

    def build():
        return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])

    mesh = init_device_mesh("cpu", (2,))
    full = build().state_dict() if dist.get_rank() == 0 else {}
    with torch.device("meta"):
        model = build()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dist.barrier()
    before = _hwm_mib()
    opts = sd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sd.set_model_state_dict(model, full, options=opts)
    assert not any(p.is_meta for p in model.parameters())
    return _hwm_mib() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.dim, args.repeats = 4, 512, 1
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # before the ranks start
    peaks: dict[str, list[float]] = {"sk": [], "torch": []}
    for _ in range(args.repeats):
        for which in ("sk", "torch"):
            peaks[which].append(run_ranks(_load, 2, which, args.layers, args.dim)[1])
    tensor_mib = args.dim * args.dim * 4 / (1 << 20)
    out = {"layers": args.layers, "dim": args.dim, "repeats": args.repeats}
    for which, values in peaks.items():
        out[f"{which}_peak_mib"] = round(statistics.median(values), 1)
        out[f"{which}_peak_spread_mib"] = [round(min(values), 1), round(max(values), 1)]
    out["ratio"] = round(out["sk_peak_mib"] / max(out["torch_peak_mib"], 1e-9), 3)
    out["full_mib"] = round(tensor_mib * args.layers, 1)
    out["ideal_mib"] = round(tensor_mib * args.layers / 2 + tensor_mib, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
