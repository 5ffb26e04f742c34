"""torch 2.14's ``CheckpointableTensor`` protocol is refused by name, never misread.

A plain tensor carrying ``global_shape`` / ``global_offsets`` / ``local_offsets`` /
``local_sizes`` tells torch 2.14's DCP which global shard it holds. shardkit does not read
that protocol, and taking such a tensor for a whole tensor of its local shape would save
each rank's shard under one key as if they were replicas.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardkit.checkpoint as dcp


def _self_described() -> torch.Tensor:
    t = torch.arange(8.0).reshape(2, 4)
    t.global_shape = (4, 4)
    t.global_offsets = ((2, 0),)
    t.local_offsets = ((0, 0),)
    t.local_sizes = ((2, 4),)
    return t


def test_save_refuses_it_naming_the_key_and_writes_nothing(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(TypeError, match=r"key 'layer.w': .*CheckpointableTensor.*mark_sharding"):
        dcp.save({"layer": {"w": _self_described()}, "b": torch.ones(2)}, checkpoint_id=path)
    assert not path.exists() or os.listdir(path) == []


def test_load_refuses_it_before_reading(tmp_path):
    dcp.save({"w": torch.zeros(2, 4)}, checkpoint_id=tmp_path / "c")
    target = _self_described()
    with pytest.raises(TypeError, match=r"key 'w': .*CheckpointableTensor"):
        dcp.load({"w": target}, checkpoint_id=tmp_path / "c")
    assert torch.equal(target, torch.arange(8.0).reshape(2, 4))


def test_a_tensor_with_only_some_of_the_names_is_a_plain_tensor(tmp_path):
    t = torch.ones(2, 2)
    t.global_shape = (4, 4)  # an attribute a user set for their own reasons
    dcp.save({"w": t}, checkpoint_id=tmp_path / "c")
    back = {"w": torch.zeros(2, 2)}
    dcp.load(back, checkpoint_id=tmp_path / "c")
    assert torch.equal(back["w"], t)
