"""shardkit's private gloo groups: made again after the world is re-initialised, and a
dropped CheckpointManager's groups are destroyed (torch keeps a group until then: 5
descriptors and 3 threads per rank each, at world size 2)."""

import pytest
from harness import free_port, run_ranks


def _reinit(root, port):
    import os

    import torch
    import torch.distributed as dist

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint import CheckpointManager

    state = {"w": torch.arange(4.0)}
    dcp.async_save(state, checkpoint_id=f"{root}/a").result()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo")
    dcp.async_save(state, checkpoint_id=f"{root}/b").result()  # used the dead group
    mgr = CheckpointManager(f"{root}/mgr", 1, chkpt_on_preemption=False)
    mgr.save_async(0, state)
    mgr.close()
    back = {"w": torch.zeros(4)}
    dcp.load(back, checkpoint_id=f"{root}/b")
    return torch.equal(back["w"], state["w"])


def test_async_saves_work_after_the_world_is_initialised_again(tmp_path):
    assert run_ranks(_reinit, 2, str(tmp_path), free_port(), timeout=120) == [True, True]


def _many_managers(root, tier):
    import gc
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from shardkit.checkpoint import CheckpointManager, LocalTier

    counts = []
    for i in range(8):
        opts = {}
        if tier:
            node = os.path.join(root, f"node{dist.get_rank()}")
            opts["local_tier"] = LocalTier(interval=1, directory=node)
        mgr = CheckpointManager(f"{root}/run{i}", 1, chkpt_on_preemption=False, **opts)
        mgr.save_async(0, {"w": torch.ones(4)})
        mgr.close()
        del mgr
        gc.collect()
        counts.append((len(c10d._world.pg_map), len(os.listdir("/proc/self/fd"))))
    return counts


@pytest.mark.parametrize("tier", [False, True], ids=["plain", "ram_tier"])
def test_dropped_managers_give_their_groups_back(tmp_path, tier):
    env = {"LOCAL_WORLD_SIZE": "1"} if tier else {}
    for counts in run_ranks(_many_managers, 2, str(tmp_path), tier, timeout=180, env=env):
        groups = [g for g, _ in counts]
        fds = [f for _, f in counts]
        # from the second manager on, the dead one's groups are destroyed by the next
        assert groups[1:] == [groups[1]] * 7, counts
        assert fds[-1] <= fds[1], counts  # it used to grow by 5 (10 with a tier) a manager
