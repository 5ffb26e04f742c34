"""Consolidating per-rank FSDP files reads each shard straight into the full tensor: the
peak RSS is the full model plus a small margin, never the full model plus a rank file
(which is what mapping each rank file, as ``torch.load(mmap=...)`` does, costs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

MiB = 1 << 20
_ROWS, _COLS = 4096, 4096  # 64 MiB of float32 per rank

_RUN = textwrap.dedent(
    """
    import sys
    import torch
    from shardkit.fsdp import consolidate_sharded_model_checkpoints

    torch.zeros(1).add_(1)  # warm torch's allocator and kernels before measuring
    with open("/proc/self/status") as f:
        before = int(dict(l.split(":", 1) for l in f)["VmRSS"].split()[0]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the peak covers the consolidation only
    full, _ = consolidate_sharded_model_checkpoints(sys.argv[1], "_rank-*.pth", save_model=False)
    with open("/proc/self/status") as f:
        peak = int(dict(l.split(":", 1) for l in f)["VmHWM"].split()[0]) * 1024
    rows, cols = full["w"].shape
    want = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    assert torch.equal(full["w"], want), "values differ"
    assert torch.equal(full["b"], torch.arange(3.0)), "buffer differs"
    print("GROWTH", peak - before, full["w"].nbytes)
    """
)


def _write_ranks(prefix: str) -> None:
    full = torch.arange(2 * _ROWS * _COLS, dtype=torch.float32).view(2 * _ROWS, _COLS)
    for rank in range(2):
        meta = {
            "rank": rank,
            "world_size": 2,
            "params": {
                "_w": {
                    "shape": [2 * _ROWS, _COLS],
                    "rows": _ROWS,
                    "start": rank * _ROWS,
                    "replicated": False,
                    "slot": 0,
                    "fqn": "w",
                }
            },
            "buffers": {"_b": "b"},
        }
        model = {"_w": full[rank * _ROWS : (rank + 1) * _ROWS].clone(), "_b": torch.arange(3.0)}
        torch.save(
            {"model": model, "shard_metadata": meta},
            f"{prefix}_rank-{rank:08d}-of-00000002.pth",
        )


def test_consolidation_peak_is_the_full_model_plus_a_small_margin(tmp_path):
    prefix = str(tmp_path / "final")
    _write_ranks(prefix)
    out = subprocess.run(
        [sys.executable, "-c", _RUN, prefix], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    growth, full_bytes = map(int, out.stdout.split("GROWTH")[1].split())
    # a mapped rank file would add 64 MiB of file pages to the peak
    assert growth <= full_bytes + 24 * MiB, (growth, full_bytes)
