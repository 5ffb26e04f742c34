"""``no_dist=True`` is a world of one: save, async_save and load never join the world the
environment describes (a torchrun rank saving alone would wait there for the others)."""

from __future__ import annotations

import pytest
import torch

import shardkit.runtime as runtime
from shardkit import checkpoint as dcp


@pytest.fixture
def world_not_to_join(monkeypatch):
    """An environment naming a world of 2, and a ``runtime.init`` that must not run."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)

    def init(*args, **kwargs):
        raise AssertionError("no_dist=True joined the world")

    monkeypatch.setattr(runtime, "init", init)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_no_dist_saves_and_loads_alone(tmp_path, world_not_to_join, how):
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
    path = tmp_path / how
    if how == "save":
        dcp.save(state, checkpoint_id=path, no_dist=True)
    else:
        dcp.async_save(state, checkpoint_id=path, no_dist=True).result(timeout=60)
    back = {"w": torch.zeros(2, 3), "step": 0}
    dcp.load(back, checkpoint_id=path, no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3
