import pytest
from harness import RankFailed, run_ranks


def _rank_sum(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + offset], dtype=torch.float64)
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()


def _hang():
    import time

    time.sleep(60)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collective_on_n_ranks(world_size):
    results = run_ranks(_rank_sum, world_size, 1)
    expected = sum(range(world_size)) + world_size
    assert results == [(r, float(expected)) for r in range(world_size)]


def test_rank_failure_carries_traceback():
    with pytest.raises(RankFailed, match=r"rank 1 failed: RuntimeError: boom on purpose"):
        run_ranks(_fail_on_rank_one, 2, timeout=60)


def test_hang_times_out():
    with pytest.raises(RankFailed, match="timed out"):
        run_ranks(_hang, 2, timeout=3)
