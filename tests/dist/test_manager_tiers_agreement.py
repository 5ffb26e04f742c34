"""The local tier on real ranks where the ranks' views can disagree: machines of
different sizes (one replica ring for all), a rollback into the same directory (two
trainings' copies of one step never combined), a bad tier directory on one machine.

As in test_manager_tiers.py, a "machine" is a tier directory of its own; a "crash" is
leaving the manager through an exception, which keeps the local tier.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from harness import run_ranks


class _Crash(Exception):
    pass


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _full(step, training="A"):
    import torch

    scale = 1.0 if training == "A" else -1.0
    return (torch.arange(24, dtype=torch.float32).reshape(6, 4) + 100 * step) * scale


def _state(step, training="A"):
    import torch

    import shardkit.spmd as xs

    mesh = xs.get_1d_mesh("x")
    return {
        "w": xs.mark_sharding(_full(step, training), mesh, ("x", None)),
        "b": torch.full((2,), float(step)),
    }


def _empty():
    import torch

    import shardkit.spmd as xs

    mesh = xs.get_1d_mesh("x")
    return {"w": xs.mark_sharding(torch.zeros(6, 4), mesh, ("x", None)), "b": torch.zeros(2)}


def _which(state, step):
    """Which training's step ``step`` the whole restored state is: "A", "B" or "mixed"."""
    import torch

    w = state["w"]
    w = w.full_tensor() if hasattr(w, "full_tensor") else w
    for training in ("A", "B"):
        if torch.equal(w, _full(step, training)):
            return training
    return "mixed"


def _mgr(root, node, *, save_interval):
    from shardkit.checkpoint import CheckpointManager, LocalTier

    return CheckpointManager(
        os.path.join(root, "persistent"),
        save_interval=save_interval,
        max_to_keep=2,
        chkpt_on_preemption=False,
        local_tier=LocalTier(interval=1, directory=os.path.join(root, node), max_to_keep=2),
    )


# -- machines of different sizes ----------------------------------------------------------


def _unequal(root):
    """Machine "A" runs ranks 0 and 1 (torchrun's LOCAL_WORLD_SIZE=2 there), machine "B"
    rank 2 (LOCAL_WORLD_SIZE=1): each rank's own (rank + LOCAL_WORLD_SIZE) % 3 gave rank 0
    two senders and rank 1 none, and every save hung in the replica exchange."""
    r = _rank()
    os.environ["LOCAL_WORLD_SIZE"] = "2" if r < 2 else "1"
    node = "A" if r < 2 else "B"
    try:
        with _mgr(root, node, save_interval=100) as mgr:
            for s in range(3):
                assert mgr.save(s, _state(s))
            mgr.join()
            peer, source = mgr._tiers.peer, mgr._tiers.source
            raise _Crash
    except _Crash:
        pass
    held = sorted(os.listdir(os.path.join(root, node, "replica")))
    _barrier()
    if r == 2:  # machine B lost its RAM: rank 2's shard comes from its replica on A
        shutil.rmtree(os.path.join(root, "B"))
    _barrier()
    with _mgr(root, node, save_interval=100) as mgr:
        step = mgr.latest_step()
        state = _empty()
        mgr.restore(step, state)
        return peer, source, held, step, mgr.last_restore.tiers_by_rank, _which(state, step)


@pytest.mark.timeout(100)
def test_machines_of_different_sizes_agree_on_one_replica_ring(tmp_path):
    got = run_ranks(_unequal, 3, str(tmp_path), timeout=80)
    assert [(peer, source) for peer, source, *_ in got] == [(2, 1), (0, 2), (1, 0)]
    # machine A holds the replicas of ranks 1 and 2, machine B the one of rank 0
    assert got[0][2] == got[1][2] == ["rank_00001", "rank_00002"]
    assert got[2][2] == ["rank_00000"]
    for *_, step, tiers, which in got:
        assert (step, tiers, which) == (2, ["local", "local", "peer"], "A")


# -- a rollback into the same directory ---------------------------------------------------


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _rollback(root):
    """A: steps 0..12 (persistent 5, 10), crash. B: restore(5), a new training for
    steps 6..10 (persistent saves skipped: the directory holds 10), crash while rank 1
    writes its RAM copy of step 10. C: resume. Step 10 had B's copy on rank 0 and A's
    persistent step for rank 1, and the restore combined them."""
    r = _rank()
    node = f"node{r}"
    handler = _Messages()
    logging.getLogger("shardkit").addHandler(handler)
    try:
        with _mgr(root, node, save_interval=5) as mgr:
            for s in range(13):
                mgr.save_async(s, _state(s, "A"))
            mgr.join()
            raise _Crash
    except _Crash:
        pass
    try:
        with _mgr(root, node, save_interval=5) as mgr:
            mgr.restore(5, _empty())
            rollback_warned = any("which holds steps up to 10" in m for m in handler.messages)
            saved = [mgr.save(s, _state(s, "B")) for s in range(6, 11)]
            raise _Crash
    except _Crash:
        pass
    tier_only_warned = any("saved to the local tier only" in m for m in handler.messages)
    _barrier()
    if r == 1:  # rank 1 died inside its RAM write of step 10: no copy, no replica sent
        shutil.rmtree(os.path.join(root, "node1", "local", "rank_00001", "step_00000010"))
    else:
        shutil.rmtree(os.path.join(root, "node0", "replica", "rank_00001", "step_00000010"))
    _barrier()
    with _mgr(root, node, save_interval=5) as mgr:
        step = mgr.latest_step()
        state = _empty()
        mgr.restore(step, state)
        tiers = mgr.last_restore.tiers_by_rank
        # every rank's copy of step 9 is B's: a step that one training covers from RAM
        nine = _empty()
        mgr.restore(9, nine)
        nine_from = (mgr.last_restore.tiers_by_rank, _which(nine, 9))
    logging.getLogger("shardkit").removeHandler(handler)
    return saved, rollback_warned, tier_only_warned, step, tiers, _which(state, step), nine_from


@pytest.mark.timeout(100)
def test_a_rollback_never_restores_two_trainings_into_one_step(tmp_path):
    got = run_ranks(_rollback, 2, str(tmp_path), timeout=80, env={"LOCAL_WORLD_SIZE": "1"})
    for saved, rollback_warned, tier_only_warned, step, tiers, which, nine_from in got:
        # step 10: B's copy on rank 0 only, A's persistent step: A's step 10 for all
        assert (step, tiers, which) == (10, ["persistent", "persistent"], "A")
        assert nine_from == (["local", "local"], "B")
        assert saved == [True] * 5  # RAM copies of B's steps, persistent ones skipped ...
        assert rollback_warned and tier_only_warned  # ... and both said so


# -- a bad tier directory on one machine --------------------------------------------------


def _file_as_directory(root):
    from shardkit.checkpoint import CheckpointManager, LocalTier

    node = os.path.join(root, f"node{_rank()}")
    if _rank() == 1:
        with open(node, "w") as f:
            f.write("not a directory")
    try:
        CheckpointManager(
            os.path.join(root, "persistent"), 5, chkpt_on_preemption=False,
            local_tier=LocalTier(directory=node),
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_a_tier_directory_that_is_a_file_raises_on_every_rank(tmp_path):
    got = run_ranks(_file_as_directory, 2, str(tmp_path), timeout=40)
    node1 = str(tmp_path / "node1")
    assert got[1] is not None and f"LocalTier(directory={node1!r}) is not a directory" in got[1]
    assert got[0] is not None and "rank(s) [1]" in got[0] and "is not a directory" in got[0]
