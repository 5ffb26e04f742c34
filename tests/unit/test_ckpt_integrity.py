"""Corruption, truncation, missing files, versions, the pickle ban and bad input."""

import json
import os
import pickle

import pytest
import torch
from column_planner import ColumnPlanner

import shardkit.checkpoint as dcp


def _saved(tmp_path):
    sd = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3), "n": 1}
    md = dcp.save(sd, checkpoint_id=tmp_path)
    return sd, md


def _target():
    return {"w": torch.zeros(8, 8), "b": torch.zeros(3), "n": 0}


def test_flipped_byte_names_file_key_and_chunk(tmp_path):
    _, md = _saved(tmp_path)
    chunk = md.tensors["w"].chunks[0]
    path = tmp_path / chunk.file
    raw = bytearray(path.read_bytes())
    raw[chunk.offset + 17] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError) as err:
        dcp.load(_target(), checkpoint_id=tmp_path)
    msg = str(err.value)
    assert "checksum mismatch" in msg and chunk.file in msg and "'w'" in msg
    assert "offsets=[0, 0] sizes=[8, 8]" in msg


def test_truncated_and_missing_files(tmp_path):
    _, md = _saved(tmp_path)
    name = md.tensors["w"].chunks[0].file
    path = tmp_path / name
    raw = path.read_bytes()
    path.write_bytes(raw[:-5])
    assert not dcp.is_committed(tmp_path)
    only_w = {"w": _target()["w"]}  # the checkpoint's other keys are ignored, as in torch
    with pytest.raises(dcp.CorruptCheckpointError, match=rf"{name} is \d+ bytes.*truncated.*'w'"):
        dcp.load(only_w, checkpoint_id=tmp_path)
    path.unlink()
    with pytest.raises(dcp.CorruptCheckpointError, match=rf"{name} is missing.*'w'"):
        dcp.load(only_w, checkpoint_id=tmp_path)
    path.write_bytes(raw)
    assert dcp.is_committed(tmp_path)


def test_unknown_version_and_missing_metadata(tmp_path):
    _saved(tmp_path)
    meta = tmp_path / "metadata.json"
    doc = json.loads(meta.read_bytes())
    doc["version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(
        dcp.CorruptCheckpointError, match="metadata.json: unknown format version 99"
    ):
        dcp.load(_target(), checkpoint_id=tmp_path)
    assert not dcp.is_committed(tmp_path)
    meta.unlink()
    assert not dcp.is_committed(tmp_path)
    assert not dcp.is_committed(tmp_path / "nowhere")
    with pytest.raises(dcp.CheckpointError, match="no committed checkpoint"):
        dcp.read_metadata(tmp_path)


class _Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_never_runs(tmp_path):
    _, md = _saved(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    payload = pickle.dumps(_Payload(marker))
    for name in md.files:
        (tmp_path / name).write_bytes(payload)
    with pytest.raises(dcp.CorruptCheckpointError):
        dcp.load(_target(), checkpoint_id=tmp_path)
    (tmp_path / "metadata.json").write_bytes(payload)
    with pytest.raises(dcp.CorruptCheckpointError, match="not valid JSON"):
        dcp.load(_target(), checkpoint_id=tmp_path)
    assert not dcp.is_committed(tmp_path)
    assert not marker.exists()


def test_load_never_calls_pickle(tmp_path, monkeypatch):
    sd, _ = _saved(tmp_path)

    def banned(*args, **kwargs):
        raise AssertionError("pickle was called during load")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, banned)
    monkeypatch.setattr(torch, "load", banned)
    target = _target()
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], sd["w"]) and target["n"] == 1
    assert dcp.is_committed(tmp_path)
    dcp.read_metadata(tmp_path)


def test_values_needing_pickle_need_an_opt_in_both_ways(tmp_path):
    with pytest.raises(TypeError, match=r"key 'extra.when'.*needs pickle.*allow_pickle=True"):
        dcp.save({"w": torch.ones(2), "extra": {"when": {1, 2}}}, checkpoint_id=tmp_path)
    assert not dcp.is_committed(tmp_path)
    dcp.save(
        {"w": torch.ones(2), "extra": {"when": {1, 2}}},
        checkpoint_id=tmp_path,
        planner=dcp.DefaultSavePlanner(allow_pickle=True),
    )
    target = {"w": torch.zeros(2), "extra": {"when": None}}
    with pytest.raises(dcp.CheckpointError, match=r"key 'extra.when' was saved with pickle"):
        dcp.load(target, checkpoint_id=tmp_path)
    dcp.load(target, checkpoint_id=tmp_path, planner=dcp.DefaultLoadPlanner(allow_pickle=True))
    assert target["extra"]["when"] == {1, 2} and torch.equal(target["w"], torch.ones(2))


def test_strict_lists_keys_and_non_strict_skips_with_warning(tmp_path):
    _saved(tmp_path)
    target = {"w": torch.zeros(8, 8), "extra": torch.zeros(2)}
    with pytest.raises(dcp.StateDictMismatchError, match=r"Missing key.*\['extra'\]"):
        dcp.load(target, checkpoint_id=tmp_path)  # torch's default: missing keys raise
    with pytest.raises(
        dcp.CheckpointError, match=r"missing.*\['extra'\].*unexpected.*\['b', 'n'\]"
    ):
        dcp.load(target, checkpoint_id=tmp_path, strict=True)
    with pytest.raises(dcp.StateDictMismatchError, match=r"unexpected.*\['b', 'n'\]"):
        dcp.load({"w": target["w"]}, checkpoint_id=tmp_path,
                 planner=dcp.DefaultLoadPlanner(strict=True))  # fmt: skip
    with pytest.warns(UserWarning, match=r"\['extra'\].*\['b', 'n'\]"):
        dcp.load(target, checkpoint_id=tmp_path, strict=False)
    assert target["w"].sum() == sum(range(64)) and target["extra"].eq(0).all()


def test_shape_and_dtype_mismatch_name_key_and_both_sides(tmp_path):
    _saved(tmp_path)
    bad = _target()
    bad["w"] = torch.zeros(8, 9)
    with pytest.raises(ValueError, match=r"'w'.*checkpoint has \[8, 8\].*state dict has \[8, 9\]"):
        dcp.load(bad, checkpoint_id=tmp_path)
    bad["w"] = torch.zeros(8, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"'w'.*torch.float32.*torch.float64"):
        dcp.load(bad, checkpoint_id=tmp_path, planner=dcp.DefaultLoadPlanner(strict_dtype=True))
    dcp.load(bad, checkpoint_id=tmp_path)  # the default casts, as torch
    assert bad["w"].dtype == torch.float64 and bad["w"].sum() == sum(range(64))
    bad["w"] = 3
    with pytest.raises(TypeError, match="'w' is a non-tensor value"):
        dcp.load(bad, checkpoint_id=tmp_path)


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_id"):
        dcp.save({"a": torch.ones(1)})
    with pytest.raises(ValueError, match="thread_count"):
        dcp.FileSystemWriter(tmp_path, thread_count=0)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        dcp.save([torch.ones(1)], checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match="'c'.*complex"):
        dcp.save({"c": torch.ones(2, dtype=torch.complex64)}, checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match=r"'f'.*view\(torch.uint8\)"):  # no safetensors name
        dcp.save({"f": torch.zeros(2).to(torch.float8_e4m3fnuz)}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match=r"'a\.b'"):
        dcp.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, checkpoint_id=tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("piece_bytes", [1 << 20, 200])
def test_column_chunks_land_in_strided_rows_and_are_verified(tmp_path, monkeypatch, piece_bytes):
    from shardkit.checkpoint._core import _format, _read_chunks

    # small checksum blocks and (in one run) pieces smaller than a block and than a row
    monkeypatch.setattr(_format, "BLOCK_BYTES", 400)
    monkeypatch.setattr(_read_chunks, "_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(_read_chunks, "_SCRATCH_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(_read_chunks, "_PLACE_PIECE_BYTES", piece_bytes)
    full = torch.randn(64, 10, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner())
    assert [c.box.sizes for c in md.tensors["w"].chunks] == [(64, 5), (64, 5)]
    target = {"w": torch.zeros(64, 10, dtype=torch.float64)}
    dcp.load(target, checkpoint_id=tmp_path)  # each chunk lands in strided rows of w
    assert torch.equal(target["w"], full)
    chunk = md.tensors["w"].chunks[1]
    path = tmp_path / chunk.file
    raw = bytearray(path.read_bytes())
    raw[chunk.offset + chunk.nbytes - 1] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w' chunk offsets=\[0, 5\]"):
        dcp.load(target, checkpoint_id=tmp_path)


def test_load_of_a_run_directory_or_a_file_says_what_it_is(tmp_path):
    """It said only "metadata.json is missing" (errors audit); the CLI already named a
    step to load instead."""
    from shardkit.checkpoint import CheckpointError, CheckpointManager

    run = tmp_path / "run"
    with CheckpointManager(str(run), 1, chkpt_on_preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"CheckpointManager run directory \(2 committed"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=run)
    with pytest.raises(CheckpointError, match=r"e\.g\. .*step_00000002"):
        dcp.read_metadata(run)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="it is a file; a checkpoint is a directory"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "afile")
    with pytest.raises(CheckpointError, match="metadata.json is missing"):
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=tmp_path)  # nothing there at all


def test_save_to_a_file_path_says_it_is_a_file(tmp_path):
    """It raised a bare FileExistsError [Errno 17] (errors audit); the file is kept."""
    target = tmp_path / "afile"
    target.write_text("keep me")
    with pytest.raises(ValueError, match="is a file; a checkpoint is a directory"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=target)
    assert target.read_text() == "keep me"
