"""Boolean options of the planners and of ``load`` refuse non-bools (migrating.md): a
string such as ``"no"`` is truthy, and turned pickling or a partial load on."""

import inspect

import pytest
import torch

import shardkit.checkpoint as dcp
from shardkit.checkpoint import DefaultLoadPlanner, DefaultSavePlanner


@pytest.mark.parametrize(
    "make, name",
    [(DefaultSavePlanner, n) for n in ("allow_pickle", "dedup_save_to_lowest_rank",
                                        "flatten_state_dict", "enable_plan_caching")]
    + [(DefaultLoadPlanner, n) for n in ("allow_pickle", "allow_partial_load", "strict",
                                          "strict_dtype", "flatten_sharded_tensors")],
)  # fmt: skip
def test_a_planner_flag_that_is_not_a_bool_is_a_type_error(make, name):
    with pytest.raises(TypeError, match=f"{name}=.*must be True or False, got 'no'"):
        make(**{name: "no"})
    make(**{name: inspect.signature(make).parameters[name].default})  # a bool is fine


def test_a_string_never_turns_pickling_or_a_partial_load_on(tmp_path):
    class Obj:
        pass

    with pytest.raises(TypeError, match="allow_pickle"):
        dcp.save({"o": Obj()}, checkpoint_id=tmp_path / "a",
                 planner=DefaultSavePlanner(allow_pickle="no"))  # fmt: skip
    assert not (tmp_path / "a").exists()
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "b")
    with pytest.raises(TypeError, match=r"load\(strict=\.\.\.\) must be True or False, got 'no'"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "b", strict="no")
    assert DefaultSavePlanner(dedup_replicated_tensors=None).allow_pickle is False
