"""Save a sharded training state on N ranks, load it into another layout on M ranks.

torchrun --nproc-per-node 4 examples/checkpoint_reshard.py save /tmp/ckpt
torchrun --nproc-per-node 2 examples/checkpoint_reshard.py load /tmp/ckpt
python examples/checkpoint_reshard.py load /tmp/ckpt   # one process, no process group
"""

from __future__ import annotations

import sys

import torch

import shardkit.checkpoint as dist_cp
import shardkit.runtime as xr
import shardkit.spmd as xs


def _state(mesh: xs.Mesh, spec: tuple, fill: bool) -> dict:
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    emb = full if fill else torch.zeros_like(full)
    model = torch.nn.Linear(8, 4)
    if fill:  # the same on every rank: plain tensors are replicated
        torch.nn.init.constant_(model.weight, 0.5)
        torch.nn.init.constant_(model.bias, 0.25)
    return {
        "emb": xs.mark_sharding(emb, mesh, spec),  # sharded
        "model": model,  # Stateful, plain tensors: replicated
        "step": 100 if fill else 0,  # a JSON value
    }


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "load"):
        raise SystemExit(__doc__)
    action, path = sys.argv[1], sys.argv[2]
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(list(range(n)), (n,), ("data",))
    if action == "save":
        state = _state(mesh, ("data", None), fill=True)  # rows split over the ranks
        future = dist_cp.async_save(state, checkpoint_id=path)
        metadata = future.result()
        if xr.global_ordinal() == 0:
            print(f"saved {metadata.keys()} from {n} rank(s) to {path}")
        return
    state = _state(mesh, (None, "data"), fill=False)  # columns split: another layout
    dist_cp.load(state, checkpoint_id=path)
    expected = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8)
    assert torch.equal(state["emb"].full_tensor(), expected)
    assert state["step"] == 100 and state["model"].weight.eq(0.5).all()
    if xr.global_ordinal() == 0:
        saved = dist_cp.read_metadata(path).world_size
        print(f"loaded a {saved}-rank checkpoint on {n} rank(s) in another layout: OK")


if __name__ == "__main__":
    main()
