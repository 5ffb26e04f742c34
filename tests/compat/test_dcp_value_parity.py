"""Plain values and meta tensors load as torch's ``dcp.load`` loads them.

Found side by side with torch DCP (2026-11-28):
- a plain dict in the state dict was replaced whole by the saved one, so an entry only
  the caller's dict had vanished without an error (torch flattens such a dict into one
  key per entry and reports the entry missing);
- a meta tensor was left on the meta device, silently (torch puts the loaded tensor
  in its place);
- a ``torch.Size`` came back a tuple, and a named tuple or an enum member a plain tuple
  or int (torch pickles them; shardkit refuses what JSON cannot bring back).

torch's DCP runs on the same state dicts as the reference.
"""

from __future__ import annotations

import collections
import enum

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as tdcp

import shardkit.checkpoint as dcp
from shardkit.checkpoint import StateDictMismatchError

SAVED = {"cfg": {"a": 1, "old": 2, "sub": {"x": 1}}, "t": torch.ones(2)}


def _given() -> dict:
    return {"cfg": {"a": 0, "new": 5, "sub": {"x": 0}}, "t": torch.zeros(2)}


@pytest.fixture
def both(tmp_path):
    """The same state saved by shardkit and by torch DCP."""
    dcp.save(SAVED, checkpoint_id=tmp_path / "sk")
    tdcp.save(SAVED, checkpoint_id=tmp_path / "torch", no_dist=True)
    return tmp_path / "sk", tmp_path / "torch"


def test_a_dict_entry_missing_from_the_checkpoint_raises_as_in_torch(both):
    sk, ref = both
    with pytest.raises(StateDictMismatchError, match=r"cfg\.new"):
        dcp.load(_given(), checkpoint_id=sk)
    with pytest.raises(BaseException, match=r"cfg\.new"):  # torch's CheckpointException
        tdcp.load(_given(), checkpoint_id=ref, no_dist=True)


def test_a_partial_load_keeps_the_entry_and_ignores_saved_only_entries(both):
    sk, ref = both
    got, want = _given(), _given()
    dcp.load(got, checkpoint_id=sk, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    tdcp.load(
        want,
        checkpoint_id=ref,
        planner=tdcp.DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert got["cfg"] == want["cfg"] == {"a": 1, "new": 5, "sub": {"x": 1}}
    assert torch.equal(got["t"], want["t"])


def test_a_dict_is_filled_in_place_and_keeps_its_type(tmp_path):
    """MultiStepLR's milestones are a Counter: it stays one (it came back a dict)."""
    dcp.save({"ms": collections.Counter({30: 1, 80: 1}), "e": {"k": 1}}, checkpoint_id=tmp_path)
    milestones = collections.Counter({30: 5, 80: 5})
    given = {"ms": milestones, "e": {}}
    dcp.load(given, checkpoint_id=tmp_path)
    assert given["ms"] is milestones and milestones == {30: 1, 80: 1}
    assert given["e"] == {"k": 1}  # an empty dict takes every saved entry (documented)


def test_meta_tensors_are_replaced_by_the_loaded_ones(both):
    """torch's load does the same on a process group (without one it fails to choose a
    device; the 2-rank audit compared them)."""
    sk, _ = both
    state = {"t": torch.empty(2, device="meta"), "cfg": {"a": 0, "sub": {"x": 0}}}
    dcp.load(state, checkpoint_id=sk, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert state["t"].device.type == "cpu" and torch.equal(state["t"], torch.ones(2))


def test_a_failed_load_leaves_meta_tensors_as_they_were(both):
    sk, _ = both
    state = {"t": torch.empty(2, device="meta"), "missing": torch.empty(1, device="meta")}
    with pytest.raises(StateDictMismatchError, match="missing"):
        dcp.load(state, checkpoint_id=sk)
    assert state["t"].is_meta and state["missing"].is_meta


def test_torch_size_round_trips(tmp_path):
    dcp.save({"size": torch.Size([2, 3]), "sizes": [torch.Size([1])]}, checkpoint_id=tmp_path)
    got = {"size": None, "sizes": None}
    dcp.load(got, checkpoint_id=tmp_path)
    assert type(got["size"]) is torch.Size and got["size"] == (2, 3)
    assert type(got["sizes"][0]) is torch.Size


class Color(enum.IntEnum):
    BLUE = 2


Pair = collections.namedtuple("Pair", "a b")


@pytest.mark.parametrize("value", [Pair(1, 2), Color.BLUE], ids=["namedtuple", "enum"])
def test_values_json_cannot_bring_back_are_refused_at_save(tmp_path, value):
    """They came back a plain tuple / int: code reading ``.a`` or ``.name`` broke later."""
    with pytest.raises(TypeError, match=rf"key 'v': a {type(value).__name__} .*needs pickle"):
        dcp.save({"v": value}, checkpoint_id=tmp_path)
    planner = dcp.DefaultSavePlanner(allow_pickle=True)  # the documented opt-in
    dcp.save({"v": value}, checkpoint_id=tmp_path, planner=planner)
    got = {"v": None}
    dcp.load(got, checkpoint_id=tmp_path, planner=dcp.DefaultLoadPlanner(allow_pickle=True))
    assert type(got["v"]) is type(value) and got["v"] == value


def test_a_float_subclass_comes_back_a_float(tmp_path):
    """numpy.float64 subclasses float: it comes back an equal float (documented)."""
    dcp.save({"best": np.float64(0.25)}, checkpoint_id=tmp_path)
    got = {"best": 0.0}
    dcp.load(got, checkpoint_id=tmp_path)
    assert type(got["best"]) is float and got["best"] == 0.25
