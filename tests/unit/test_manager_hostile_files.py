"""Files of a manager's directories planted or tampered with: a FIFO never blocks, JSON
nested too deeply never escapes as RecursionError, and nothing stops the run's saves."""

from __future__ import annotations

import os

import pytest
import torch
from hostile import fail_after

from shardkit.checkpoint import BestN, CheckpointError, CheckpointManager, LocalTier


@pytest.fixture(autouse=True)
def _no_hang():
    with fail_after(20):
        yield


def _state(value: float) -> dict:
    return {"w": torch.full((3,), value)}


@pytest.mark.parametrize("plant", ["fifo", "deep"])
def test_a_planted_tier_json_is_a_torn_copy(tmp_path, plant):
    ram, url = tmp_path / "ram", str(tmp_path / "run")
    with pytest.raises(RuntimeError):
        with CheckpointManager(url, 1, local_tier=LocalTier(directory=ram)) as mgr:
            mgr.save(1, _state(1))
            mgr.save(2, _state(2))
            raise RuntimeError("the run dies")
    manifest = ram / "local" / "rank_00000" / "step_00000002" / "tier.json"
    manifest.unlink()
    if plant == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.write_text("[" * 100_000)
    with CheckpointManager(url, 1, local_tier=LocalTier(directory=ram)) as mgr:
        assert mgr.latest_step() == 2  # the persistent tier has it
        assert torch.equal(mgr.restore(2, _state(0))["w"], _state(2)["w"])
        assert mgr.last_restore.tier == "persistent"


def test_a_fifo_as_the_lease_is_refused_at_once(tmp_path):
    url = tmp_path / "run"
    with CheckpointManager(str(url), 1) as mgr:
        mgr.save(1, _state(1))
    os.mkfifo(url / "manager.lease")
    with CheckpointManager(str(url), 1) as mgr:
        with pytest.raises(CheckpointError, match=r"manager.lease is not a regular file"):
            mgr.save(2, _state(2))
        assert mgr.all_steps() == [1]


@pytest.mark.parametrize("plant", ["fifo", "deep"])
def test_planted_metrics_never_stop_retention(tmp_path, plant):
    """A step whose manager.json cannot be read has no metrics (BestN keeps it); the
    retention of the other steps goes on."""
    url = tmp_path / "run"
    policy = BestN("loss", 1, mode="min")
    with CheckpointManager(str(url), 1, preservation_policy=policy) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 1.0})
    record = url / "step_00000001" / "manager.json"
    record.unlink()
    if plant == "fifo":
        os.mkfifo(record)
    else:
        record.write_text("[" * 100_000)
    with CheckpointManager(str(url), 1, preservation_policy=policy) as mgr:
        for step, loss in ((2, 0.5), (3, 0.7), (4, 0.9)):
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.join()
        assert mgr.all_steps() == [1, 2, 4]  # 3 went: not the best, not the newest
