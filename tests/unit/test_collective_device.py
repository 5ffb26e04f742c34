"""The device a group's collectives use: one rule, mixed backends included."""

import pytest
import torch
import torch.distributed as dist

from shardkit.checkpoint._state_dict._broadcast import broadcast_items

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def backend(monkeypatch):
    """Make every group report the backend configuration it is called with."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def use(spec):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: spec)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: spec)

    return use


@pytest.mark.parametrize(
    ("spec", "control", "bulk"),
    [
        ("nccl", CUDA0, CUDA0),
        ("cuda:nccl", CUDA0, CUDA0),
        ("gloo", CPU, CPU),
        ("cpu:gloo,cuda:gloo", CPU, CPU),
        ("cpu:gloo", CPU, CPU),
        ("cpu:gloo,cuda:nccl", CPU, CUDA0),  # gloo serves the CPU part: bytes go there
        ("cuda:nccl,cpu:gloo", CPU, CUDA0),
        ("mpi", CPU, CPU),
    ],
)
def test_collective_device(backend, spec, control, bulk):
    from shardkit.runtime._collective import collective_device

    backend(spec)
    assert collective_device() == control
    assert collective_device(None, bulk=True) == bulk


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_broadcast_header_of_mixed_group_goes_on_the_cpu(world_of_one, backend):
    """broadcast_from_rank0's JSON header used to go on CUDA for "cpu:gloo,cuda:nccl"
    (while the other control exchanges took the CPU); it takes gloo's CPU now."""
    backend("cpu:gloo,cuda:nccl")
    out = broadcast_items(lambda: [("step", 3), ("names", ["a", "b"])], lambda k, t: t)
    assert out == {"step": 3, "names": ["a", "b"]}
