"""Hostile and damaged checkpoints: confinement, integrity, bounds (issue 15, points 2-4).

Each case must raise a CorruptCheckpointError naming the file, key or entry, read nothing
outside the checkpoint directory and never hang. Edits to metadata.json are re-sealed with
a valid checksum (``_edit``), as an attacker would, so the structural checks themselves
are what is tested; ``test_metadata_checksum_*`` covers unsealed edits.
"""

import json
import os

import pytest
import torch
from column_planner import ColumnPlanner
from hostile import fail_after
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core._validate import MAX_NESTING


@pytest.fixture(autouse=True)
def _no_hang():
    with fail_after(20):
        yield


def _state():
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(6, 8),
        "b": torch.arange(3, dtype=torch.int64),
        "n": 7,
    }


def _target():
    return {"w": torch.zeros(6, 8), "b": torch.zeros(3, dtype=torch.int64), "n": 0}


def _saved(path):
    dcp.save(_state(), checkpoint_id=path)
    return json.loads((path / "metadata.json").read_bytes())


def _load_fails(path, *fragments):
    with pytest.raises(dcp.CorruptCheckpointError) as err:
        dcp.load(_target(), checkpoint_id=path)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


# -- confinement ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "s3://b/x", "a/b", ".."])
def test_file_names_must_be_plain_names_in_the_directory(tmp_path, name):
    doc = _saved(tmp_path)
    old = doc["tensors"]["w"]["chunks"][0]["file"]
    doc["tensors"]["w"]["chunks"][0]["file"] = name
    doc["files"][name] = doc["files"].pop(old)
    reseal_metadata(tmp_path, doc)
    msg = _load_fails(tmp_path, "not a plain file name")
    assert repr(name)[:20] in msg
    with pytest.raises(dcp.CorruptCheckpointError):
        dcp.read_metadata(tmp_path)


def test_a_symlink_pointing_outside_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    doc = _saved(ckpt)
    name = doc["tensors"]["w"]["chunks"][0]["file"]
    outside = tmp_path / "secret.bin"
    outside.write_bytes((ckpt / name).read_bytes())  # same size: only the link can betray it
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)
    _load_fails(ckpt, name, "symbolic link")
    assert not dcp.is_committed(ckpt)


def test_dev_zero_and_a_fifo_are_refused_without_hanging(tmp_path):
    doc = _saved(tmp_path)
    name = doc["tensors"]["w"]["chunks"][0]["file"]
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to("/dev/zero")
    _load_fails(tmp_path, name)
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    _load_fails(tmp_path, name, "not a regular file")
    # the metadata file itself as a FIFO: refused at once too
    os.replace(tmp_path / "metadata.json", tmp_path / "saved.json")
    os.mkfifo(tmp_path / "metadata.json")
    _load_fails(tmp_path, "metadata.json", "not a regular file")


def test_fsspec_stores_refuse_foreign_names_too(tmp_path):
    url = f"memory://{tmp_path.name}/ckpt"
    dcp.save(_state(), checkpoint_id=url)
    reader = dcp.FileSystemReader(url)
    for name in ("../x", "memory://other/x", "/abs"):
        with pytest.raises(dcp.CorruptCheckpointError, match="not a plain file name"):
            reader.file_size(name)
        with pytest.raises(dcp.CorruptCheckpointError, match="not a plain file name"):
            reader.read_into(name, 0, memoryview(bytearray(4)))


# -- integrity ------------------------------------------------------------------------------
def test_chunks_must_tile_their_tensor(tmp_path):
    dcp.save({"w": _state()["w"]}, checkpoint_id=tmp_path, planner=ColumnPlanner())
    doc = json.loads((tmp_path / "metadata.json").read_bytes())
    chunks = doc["tensors"]["w"]["chunks"]
    assert len(chunks) == 2
    base = json.loads(json.dumps(doc))

    doc["tensors"]["w"]["chunks"] = chunks[:1]  # a missing chunk
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, "'w'", "cover 24 of its 48 elements")

    doc = json.loads(json.dumps(base))
    doc["tensors"]["w"]["chunks"][1] = dict(doc["tensors"]["w"]["chunks"][0])  # duplicated
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, "'w'", "overlap")

    doc = json.loads(json.dumps(base))
    doc["tensors"]["w"]["chunks"][1]["offsets"] = [0, 5]  # sticks out of the 8 columns
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, "'w'", "outside the tensor's shape")


def test_metadata_checksum_catches_an_unsealed_edit(tmp_path):
    _saved(tmp_path)
    meta = tmp_path / "metadata.json"
    raw = meta.read_bytes()
    meta.write_bytes(raw.replace(b'"n":7', b'"n":8'))
    _load_fails(tmp_path, "metadata.json", "checksum mismatch")
    # dropping the checksum of a version 2 file is damage too
    doc = json.loads(raw)
    doc.pop("metadata_xxh3_64")
    meta.write_text(json.dumps(doc))
    _load_fails(tmp_path, "checksum", "missing")


def test_version_1_checkpoints_without_a_checksum_still_load(tmp_path):
    doc = _saved(tmp_path)
    doc.pop("metadata_xxh3_64")
    doc["version"] = 1
    (tmp_path / "metadata.json").write_text(json.dumps(doc))
    out = _target()
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], _state()["w"]) and out["n"] == 7


def test_a_damaged_safetensors_header_is_caught(tmp_path):
    doc = _saved(tmp_path)
    name = doc["tensors"]["w"]["chunks"][0]["file"]
    path = tmp_path / name
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"shape"') + 10  # a digit of a shape in the header
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    _load_fails(tmp_path, name, "safetensors header differs")
    assert not dcp.is_committed(tmp_path)


def test_header_length_is_bounded_when_reading_any_safetensors_file(tmp_path):
    from shardkit.checkpoint import format_utils as fu

    bad = tmp_path / "huge.safetensors"
    bad.write_bytes((2**63 - 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(dcp.CorruptCheckpointError, match="header length"):
        fu.from_safetensors(bad, tmp_path / "out", progress=False)


# -- bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("offset", -8, "negative offset"),
        ("block_rows", 0, "block_rows 0 must be >= 1"),
        ("nbytes", 10**9, "nbytes"),
        ("offset", 10**9, "run past the end of file"),
    ],
)
def test_bad_chunk_fields_name_the_key(tmp_path, field, value, fragment):
    doc = _saved(tmp_path)
    doc["tensors"]["b"]["chunks"][0][field] = value
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, "key 'b'", fragment)


def test_negative_box_offsets_name_the_key(tmp_path):
    doc = _saved(tmp_path)
    doc["tensors"]["b"]["chunks"][0]["offsets"] = [-1]
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, "key 'b'", ">= 0")


def test_a_huge_shape_is_refused_before_any_allocation(tmp_path):
    """Shape 10**12: no 4 TB allocation, in load or convert; the output is not written."""
    from shardkit.checkpoint import format_utils as fu

    doc = _saved(tmp_path / "c")
    t = doc["tensors"]["b"]
    t["shape"] = [10**12]
    t["chunks"][0]["sizes"] = [10**12]
    t["chunks"][0]["nbytes"] = 8 * 10**12
    reseal_metadata(tmp_path / "c", doc)
    with pytest.raises(dcp.CorruptCheckpointError, match="key 'b'.*run past the end"):
        fu.to_safetensors(tmp_path / "c", tmp_path / "out.safetensors", progress=False)
    assert not (tmp_path / "out.safetensors").exists()


def test_deep_nesting_is_a_clear_error_not_a_recursion_traceback(tmp_path):
    doc = _saved(tmp_path)
    deep = 0
    for _ in range(MAX_NESTING + 5):
        deep = [deep]
    doc["values"]["n"] = deep
    reseal_metadata(tmp_path, doc)
    _load_fails(tmp_path, f"nested deeper than {MAX_NESTING}")
    raw = b'{"a":' * 100_000 + b"1" + b"}" * 100_000  # deeper than the JSON parser goes
    (tmp_path / "metadata.json").write_bytes(raw)
    _load_fails(tmp_path, f"nested deeper than {MAX_NESTING}")


def test_an_oversized_metadata_file_is_refused_unread(tmp_path):
    from shardkit.checkpoint._core._validate import MAX_METADATA_BYTES

    _saved(tmp_path)
    with open(tmp_path / "metadata.json", "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: costs no disk
    _load_fails(tmp_path, "metadata.json", "more than the")


def test_convert_reports_the_checksum_error_not_an_incomplete_file(tmp_path):
    from shardkit.checkpoint import format_utils as fu

    doc = _saved(tmp_path / "c")
    chunk = doc["tensors"]["w"]["chunks"][0]
    path = tmp_path / "c" / chunk["file"]
    raw = bytearray(path.read_bytes())
    raw[chunk["offset"] + 3] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match="checksum mismatch.*'w'"):
        fu.to_safetensors(tmp_path / "c", tmp_path / "out.safetensors", progress=False)


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "overlap"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "bad shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "bad shape"),
        ({"a": [1, 2]}, "not an object"),
        ({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [10**12], "data_offsets": [0, 4 * 10**12]}},
         "inconsistent"),
    ],
)  # fmt: skip
def test_a_hostile_safetensors_input_is_refused_by_from_safetensors(tmp_path, header, fragment):
    """Shared or out-of-file byte ranges would let a conversion write more than it read."""
    from shardkit.checkpoint import format_utils as fu

    bad = tmp_path / "in.safetensors"
    bad.write_bytes(_safetensors(header, bytes(8)))
    with pytest.raises(dcp.CorruptCheckpointError, match=fragment):
        fu.from_safetensors(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
