"""Which RAM copies a manager may use or delete, in one process: copies of a run
directory that was removed and started again, copies a failed restore could not use,
and the tier's directory argument."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from shardkit.checkpoint import CheckpointError, CheckpointManager, LocalTier


class _Crash(Exception):
    pass


def _mgr(run, ram, **kwargs):
    return CheckpointManager(
        str(run), 5, chkpt_on_preemption=False, local_tier=LocalTier(directory=str(ram)), **kwargs
    )


def _crash_after(run, ram, steps, value=1.0):
    """Save ``steps`` (RAM every step, persistent every 5th), then die: copies stay."""
    with pytest.raises(_Crash):
        with _mgr(run, ram) as mgr:
            for step in steps:
                mgr.save(step, {"w": torch.full((4,), value + step)})
            raise _Crash


def _copies(ram):
    own = ram / "local" / "rank_00000"
    return sorted(os.listdir(own)) if own.exists() else []


def test_copies_of_a_removed_run_directory_are_not_resumed(tmp_path):
    run, ram = tmp_path / "run", tmp_path / "ram"
    _crash_after(run, ram, range(8))  # persistent 0, 5; RAM 6, 7
    assert _copies(ram) == ["step_00000006", "step_00000007"]
    shutil.rmtree(run)  # start over under the same path
    with _mgr(run, ram) as mgr:
        assert mgr.all_steps() == []
        assert mgr.latest_step() is None  # was 7: the removed run's weights came back
        with pytest.raises(CheckpointError, match="cannot be restored"):
            mgr.restore(7, {"w": torch.zeros(4)})
        mgr.save(0, {"w": torch.full((4,), -1.0)})  # the new run's first copy
        mgr.join()
        assert _copies(ram) == ["step_00000000"]  # the old run's copies went with it
        assert mgr.latest_step() == 0
    assert not ram.exists()


def test_copies_of_the_same_run_directory_still_resume(tmp_path):
    run, ram = tmp_path / "run", tmp_path / "ram"
    _crash_after(run, ram, range(8))
    assert (run / "manager.run").is_file()
    with _mgr(run, ram) as mgr:
        assert mgr.latest_step() == 7
        target = {"w": torch.zeros(4)}
        mgr.restore(7, target)
        assert mgr.last_restore.tier == "local" and torch.equal(target["w"], torch.full((4,), 8.0))


def test_a_failed_restore_then_a_clean_close_keeps_the_copies(tmp_path):
    run, ram = tmp_path / "run", tmp_path / "ram"
    _crash_after(run, ram, range(8))
    with _mgr(run, ram) as mgr:  # the wrong program: a model of another shape
        with pytest.raises(CheckpointError, match="restorable"):
            mgr.restore(mgr.latest_step(), {"w": torch.zeros(5)})
    assert _copies(ram) == ["step_00000006", "step_00000007"]  # close() deleted them
    with _mgr(run, ram) as mgr:  # the right program resumes from RAM, not from step 5
        target = {"w": torch.zeros(4)}
        assert mgr.latest_step() == 7
        mgr.restore(7, target)
        assert mgr.last_restore.tier == "local"
    assert not ram.exists()  # it restored: its clean exit removes them


def test_a_manager_that_only_listed_keeps_the_copies(tmp_path):
    run, ram = tmp_path / "run", tmp_path / "ram"
    _crash_after(run, ram, range(8))
    with _mgr(run, ram) as mgr:
        assert mgr.latest_step() == 7
    assert _copies(ram) == ["step_00000006", "step_00000007"]


def test_a_tier_directory_that_is_a_file_names_the_argument(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"LocalTier\(directory=.*not_a_dir'\) is not a directory"):
        _mgr(tmp_path / "run", path)
    below = path / "ram"  # a file in the way further up
    with pytest.raises(ValueError, match=r"LocalTier\(directory=.*not_a_dir/ram'\) cannot be used"):
        _mgr(tmp_path / "run", below)


def _inv(copies, persistent=()):
    """A rank's inventory; a copy is ``(src, step, kind, history, persisted)``."""
    return {
        "fp": "L",
        "copies": [
            [src, step, kind, "L", history, persisted]
            for src, step, kind, history, persisted in copies
        ],
        "persistent": list(persistent),
    }


def test_a_step_is_restored_from_one_history():
    """Copies of two trainings (a rollback into the same directory) are never combined
    for one step, nor a copy with a persistent step that its save call did not write."""
    from shardkit.checkpoint._manager._tiers import choose_latest, plan_sources

    persistent = ("persistent", None, None)
    # B's copy of step 10 on rank 0 only; the persistent step 10 is A's: A's for all
    invs = [_inv([(0, 10, "local", "B", False)], [10]), _inv([])]
    assert choose_latest(invs) == 10 and plan_sources(invs, 10) == [persistent, persistent]
    # the same call saved both: rank 1 completes the step from the persistent tier
    invs = [_inv([(0, 10, "local", "A", True)], [10]), _inv([])]
    assert plan_sources(invs, 10) == [("local", 0, "local"), persistent]
    # B's copies cover every rank: B's step 10 from RAM
    invs = [_inv([(0, 10, "local", "B", False)], [10]), _inv([(1, 10, "local", "B", False)])]
    assert plan_sources(invs, 10) == [("local", 0, "local"), ("local", 1, "local")]
    # one copy of each training and no persistent step: not restorable
    invs = [_inv([(0, 7, "local", "A", True)]), _inv([(1, 7, "local", "B", True)])]
    assert choose_latest(invs) is None and None in plan_sources(invs, 7)
    # a replica of the right training is preferred to a copy of the other one
    invs = [
        _inv([(0, 7, "local", "A", False), (1, 7, "replica", "B", False)]),
        _inv([(1, 7, "local", "B", False), (0, 7, "replica", "B", False)]),
    ]
    assert choose_latest(invs) == 7
    assert plan_sources(invs, 7) == [("peer", 1, "replica"), ("local", 1, "local")]
