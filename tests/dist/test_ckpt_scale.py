"""Scale: 2 ranks with 4 GiB of state each (``SHARDKIT_SCALE_MIB`` per rank; marked slow,
run by ``make test-all``): save, load, resharded loads 2->1 and 1->2, async_save, every
value checked exactly, and each load's peak RSS held to destination + 256 MiB.

The state is an int64 tensor whose every element is its global flat index, so it is
checked slice by slice without a second copy in memory.
"""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_ranks

import shardkit.checkpoint as dcp

pytestmark = pytest.mark.slow

MiB = 1 << 20
_COLS = 1024  # 8 KiB rows
_BOUND = 256 * MiB  # the stated load buffer bound
_SLACK = 64 * MiB  # allocator and interpreter noise around the measurement


def _rows_per_rank() -> int:
    mib = int(os.environ.get("SHARDKIT_SCALE_MIB", "4096"))
    return mib * MiB // (8 * _COLS)


def _fill(t: torch.Tensor, row0: int) -> None:
    step = max(1, 64 * MiB // (8 * _COLS))
    for r in range(0, t.shape[0], step):
        n = min(step, t.shape[0] - r)
        lo = (row0 + r) * _COLS
        t[r : r + n].copy_(torch.arange(lo, lo + n * _COLS, dtype=torch.int64).view(n, _COLS))


def _check(t: torch.Tensor, row0: int) -> None:
    step = max(1, 64 * MiB // (8 * _COLS))
    for r in range(0, t.shape[0], step):
        n = min(step, t.shape[0] - r)
        lo = (row0 + r) * _COLS
        want = torch.arange(lo, lo + n * _COLS, dtype=torch.int64).view(n, _COLS)
        assert torch.equal(t[r : r + n], want), f"rows {row0 + r}..{row0 + r + n} differ"


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS


def _measured_load(sd: dict, path: str) -> int:
    """Load and return how far the peak RSS rose above the RSS before the load."""
    before, _ = _rss()
    _reset_peak()
    dcp.load(sd, checkpoint_id=path)
    return _rss()[1] - before


def _sharded(rows: int, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,))
    local = torch.empty(rows, _COLS, dtype=torch.int64)
    _fill(local, rank * rows)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=(2 * rows, _COLS), stride=(_COLS, 1)
    ), local


def _two_ranks(path: str) -> list[dict]:
    import torch.distributed as dist

    rank, rows = dist.get_rank(), _rows_per_rank()
    w, local = _sharded(rows, rank)
    dcp.save({"w": w}, checkpoint_id=f"{path}/two")
    local.zero_()
    growth = {"load": _measured_load({"w": w}, f"{path}/two")}
    _check(local, rank * rows)

    fut = dcp.async_save({"w": w}, checkpoint_id=f"{path}/async")
    local.zero_()  # the caller may change its tensors once async_save returns
    fut.result()
    growth["load_after_async"] = _measured_load({"w": w}, f"{path}/async")
    _check(local, rank * rows)

    if os.path.isdir(f"{path}/one"):  # 1 -> 2: the world-of-one checkpoint, resharded
        local.zero_()
        growth["load_1_to_2"] = _measured_load({"w": w}, f"{path}/one")
        _check(local, rank * rows)
    return {"growth": growth, "state": local.nbytes}


def _one_rank(path: str, save: bool) -> dict:
    rows = 2 * _rows_per_rank()
    full = torch.empty(rows, _COLS, dtype=torch.int64)
    if save:
        _fill(full, 0)
        dcp.save({"w": full}, checkpoint_id=f"{path}/one")
        return {}
    full.zero_()
    growth = _measured_load({"w": full}, f"{path}/two")  # 2 -> 1
    _check(full, 0)
    return {"growth": {"load_2_to_1": growth}, "state": full.nbytes}


def test_two_ranks_at_scale(tmp_path):
    path = str(tmp_path)
    run_ranks(_one_rank, 1, path, True, timeout=1200)
    results = run_ranks(_two_ranks, 2, path, timeout=1200)
    results += run_ranks(_one_rank, 1, path, False, timeout=1200)
    report = []
    for r in results:
        for what, growth in r["growth"].items():
            report.append((what, r["state"], growth))
            assert growth <= _BOUND + _SLACK, (what, growth, r["state"])
    print("peak RSS over destination (what, destination bytes, growth bytes):", report)
    assert {w for w, _, _ in report} == {"load", "load_after_async", "load_1_to_2", "load_2_to_1"}
