"""shardkit.runtime's torch_xla ``xr.*`` helpers against torch_xla's documented meaning.

torch_xla (``torch_xla/runtime.py``): ``process_index`` / ``process_count`` are the
process's index and the number of processes, ``local_process_count`` the processes on
this host, ``addressable_device_count`` the devices this process drives,
``global_device_count`` all devices, ``local_ordinal`` the device index on this host,
``host_index`` the host's index. shardkit runs one process per device, so these follow
from the torchrun environment; torch.distributed is the oracle in a real 2-rank run.
"""

from __future__ import annotations

import warnings

import pytest
from harness import run_ranks

import shardkit.runtime as xr

_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS_PER_NODE",
    "MASTER_ADDR",
)


@pytest.fixture
def bare(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.timeout(30)
def test_world_of_one(bare):
    assert (xr.process_index(), xr.process_count()) == (0, 1)
    assert (xr.local_process_count(), xr.local_ordinal(), xr.host_index()) == (1, 0, 0)
    assert xr.addressable_device_count() == xr.addressable_runtime_device_count() == 1
    assert xr.global_device_count() == xr.global_runtime_device_count() == 1
    assert xr.local_device_count() == 1
    assert xr.device_type() in ("CPU", "CUDA")
    assert xr.is_bf16_supported() in (True, False)


@pytest.mark.timeout(30)
def test_host_helpers_follow_torchrun_env(bare):
    bare.setenv("LOCAL_WORLD_SIZE", "4")
    bare.setenv("LOCAL_RANK", "3")
    bare.setenv("GROUP_RANK", "2")
    assert (xr.local_process_count(), xr.local_device_count()) == (4, 4)
    assert (xr.local_ordinal(), xr.host_index()) == (3, 2)
    bare.delenv("GROUP_RANK")
    bare.setenv("SLURM_NODEID", "5")
    assert xr.host_index() == 5
    bare.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four'"):
        xr.local_process_count()


@pytest.mark.timeout(30)
def test_get_master_ip(bare):
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        xr.get_master_ip()
    bare.setenv("MASTER_ADDR", "10.0.0.7")
    assert xr.get_master_ip() == "10.0.0.7"


@pytest.mark.timeout(30)
def test_xla_only_knobs_are_accepted_with_one_warning(bare):
    from shardkit.runtime import _xla_api

    _xla_api._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            xr.set_device_type("TPU")
            xr.initialize_cache("/tmp/xla_cache", readonly=True)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "selects the PJRT device" in messages[0]
    assert "compilation cache" in messages[1]
    with pytest.raises(TypeError):
        xr.set_device_type(3)


def _rank_view():
    import torch.distributed as dist

    import shardkit.runtime as xr

    return {
        "process_index": (xr.process_index(), dist.get_rank()),
        "process_count": (xr.process_count(), dist.get_world_size()),
        "global_device_count": (xr.global_device_count(), dist.get_world_size()),
        "local_ordinal": (xr.local_ordinal(), dist.get_rank()),  # one machine
        "local_process_count": (xr.local_process_count(), dist.get_world_size()),
        "host_index": (xr.host_index(), 0),
        "addressable_device_count": (xr.addressable_device_count(), 1),
    }


@pytest.mark.timeout(120)
def test_two_ranks_match_torch_distributed():
    for view in run_ranks(_rank_view, 2, timeout=90):
        for name, (ours, expected) in view.items():
            assert ours == expected, name


def test_use_spmd_takes_torch_xlas_auto_false_and_refuses_auto_true():
    xr.use_spmd(auto=False)
    assert xr.is_spmd()
    with pytest.raises(NotImplementedError, match="automatic sharding"):
        xr.use_spmd(auto=True)
