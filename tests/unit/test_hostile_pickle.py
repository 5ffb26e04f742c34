"""Reading torch DCP checkpoints never runs code from them (issue 15, point 1).

The payloads below would create a marker file if unpickled with plain ``pickle``; the
restricted unpickler (and ``weights_only=True`` for values) must refuse them first.
"""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp

import shardkit.checkpoint as dcp
from shardkit.checkpoint import format_utils as fu


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _torch_dcp(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_an_honest_torch_dcp_checkpoint_still_imports(tmp_path):
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.ones(2)}, "lr": 0.5}
    _torch_dcp(tmp_path / "t", state)
    fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    out = {"a": torch.zeros(2, 3), "b.c": torch.zeros(2), "lr": 0.0}
    dcp.load(out, checkpoint_id=tmp_path / "s")
    assert torch.equal(out["a"], state["a"]) and out["lr"] == 0.5


def test_a_malicious_metadata_pickle_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    _torch_dcp(tmp_path / "t", {"a": torch.ones(3)})
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"\.metadata.*system.*refused"):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    assert not marker.exists()
    assert not (tmp_path / "s").exists()


def test_a_payload_nested_inside_real_metadata_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    _torch_dcp(tmp_path / "t", {"a": torch.ones(3)})
    with open(tmp_path / "t" / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own honest file, written just above
    md.storage_meta = _Payload(marker)
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(dcp.CorruptCheckpointError, match="refused"):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    assert not marker.exists()


def test_a_malicious_value_in_the_data_files_never_runs(tmp_path):
    """torch's own planner reads non-tensor values with weights_only=False."""
    marker = tmp_path / "pwned"
    _torch_dcp(tmp_path / "t", {"a": torch.ones(3), "evil": _Payload(marker)})
    with pytest.raises(dcp.CorruptCheckpointError, match="'evil'.*weights_only"):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    assert not marker.exists()


def test_data_file_names_and_sizes_in_torch_metadata_are_checked(tmp_path):
    _torch_dcp(tmp_path / "t", {"a": torch.ones(3)})
    with open(tmp_path / "t" / ".metadata", "rb") as f:
        md = pickle.load(f)
    (index, info), *_ = md.storage_data.items()
    info.relative_path = "../outside.distcp"
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(dcp.CorruptCheckpointError, match="not a plain file name"):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    info.relative_path = "__0_0.distcp"
    md.state_dict_metadata["a"].size = torch.Size([10**12])
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(dcp.CorruptCheckpointError, match="'a'.*needs"):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
