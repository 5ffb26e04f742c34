"""Importing a torch DCP checkpoint whose ``.metadata`` holds only allowed classes but wrong
field types or chunks that do not tile their tensors.

Each must be refused with CorruptCheckpointError naming the key and field, before anything
is allocated or read; nothing reaches the output. Before the fix a tensor without chunks was
imported holding the previous tensor's bytes, and wrong types surfaced as AttributeError /
TypeError / KeyError (the CLI's "internal error", exit 4).
"""

import io
import os
import pickle
import warnings
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import shardkit.checkpoint as dcp
from shardkit.checkpoint import format_utils as fu
from shardkit.cli import main


def _torch_dcp(path, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(state, checkpoint_id=str(path), no_dist=True)
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # our own honest file, written just above


def _rewrite(path, md):
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _refused(tmp_path, match):
    with pytest.raises(dcp.CorruptCheckpointError, match=match):
        fu.import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_a_tensor_without_chunks_is_refused_not_filled_with_another_tensors_bytes(tmp_path):
    md = _torch_dcp(tmp_path / "t", {"a": torch.full((4, 4), 7.0), "b": torch.arange(16.0)})
    md.state_dict_metadata["b"].chunks = []
    for index in [i for i in md.storage_data if i.fqn == "b"]:
        del md.storage_data[index]
    _rewrite(tmp_path / "t", md)
    _refused(tmp_path, r"key 'b'.*cover 0 of its 16 elements.*a chunk is missing")
    # nothing was imported, so no load can return 'a''s bytes as 'b'
    out = {"a": torch.zeros(4, 4), "b": torch.zeros(16)}
    with pytest.raises(dcp.CheckpointError, match="no committed checkpoint"):
        dcp.load(out, checkpoint_id=tmp_path / "s")
    assert not torch.equal(out["b"], torch.full((16,), 7.0))


def test_a_chunk_without_a_storage_entry_is_refused(tmp_path):
    md = _torch_dcp(tmp_path / "t", {"a": torch.ones(3), "b": torch.arange(4.0)})
    for index in [i for i in md.storage_data if i.fqn == "b"]:
        del md.storage_data[index]
    _rewrite(tmp_path / "t", md)
    _refused(tmp_path, r"key 'b' chunk offsets=\[0\] sizes=\[4\]: has no entry in storage_data")


def _two_chunk_dcp(path, rows):
    """A hand-made DCP directory whose tensor 'w' (4 x 3) is stored as two chunks of two
    rows each, starting at ``rows``, the way a sharded save writes it."""
    w = torch.arange(12.0).reshape(4, 3)
    path.mkdir(exist_ok=True)
    data, storage, chunks = io.BytesIO(), {}, []
    for row in rows:
        start = data.tell()
        torch.save(w[row : row + 2].clone(), data)
        offsets = torch.Size([row, 0])
        chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([2, 3])))
        storage[MetadataIndex("w", offsets, len(chunks) - 1)] = _StorageInfo(
            "__0_0.distcp", start, data.tell() - start
        )
    (path / "__0_0.distcp").write_bytes(data.getvalue())
    tensor_md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), w.size(), chunks)
    md = Metadata(state_dict_metadata={"w": tensor_md}, storage_data=storage)
    _rewrite(path, md)
    return w, md


def test_chunks_must_tile_the_tensor_without_gaps_or_overlaps(tmp_path):
    w, md = _two_chunk_dcp(tmp_path / "t", rows=(0, 2))
    fu.import_torch_dcp(tmp_path / "t", tmp_path / "ok", progress=False)  # the honest tiling
    out = {"w": torch.zeros(4, 3)}
    dcp.load(out, checkpoint_id=tmp_path / "ok")
    assert torch.equal(out["w"], w)

    chunks = md.state_dict_metadata["w"].chunks
    chunks[1] = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([1, 3]))
    _rewrite(tmp_path / "t", md)  # row 3 is in no chunk
    _refused(tmp_path, r"key 'w'.*cover 9 of its 12 elements.*a chunk is missing")

    chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))
    _rewrite(tmp_path / "t", md)  # row 2 twice
    _refused(tmp_path, r"key 'w'.*cover 15 of its 12 elements.*chunks overlap")

    _two_chunk_dcp(tmp_path / "t", rows=(0, 1))  # 12 elements, but row 1 twice, row 3 never
    _refused(tmp_path, r"key 'w'.*chunks at offsets=\[0, 0\] and offsets=\[1, 0\] overlap")


def _props_int(md):
    md.state_dict_metadata["a"].properties = 5


def _dtype_none(md):
    md.state_dict_metadata["a"].properties.dtype = None


def _size_int(md):
    md.state_dict_metadata["a"].size = 5


def _size_overflows(md):
    md.state_dict_metadata["a"].size = torch.Size([10**30, 0])


def _chunks_none(md):
    md.state_dict_metadata["a"].chunks = None


def _chunk_outside(md):
    c = md.state_dict_metadata["a"].chunks[0]
    md.state_dict_metadata["a"].chunks[0] = ChunkStorageMetadata(torch.Size([1, 0]), c.sizes)


def _chunk_dims(md):
    md.state_dict_metadata["a"].chunks[0] = ChunkStorageMetadata(torch.Size([0]), torch.Size([6]))


def _storage_list(md):
    md.storage_data = list(md.storage_data.items())


def _key_not_a_string(md):
    md.state_dict_metadata[7] = md.state_dict_metadata["a"]


def _value_not_storage_metadata(md):
    md.state_dict_metadata["lr"] = 0.5


HOSTILE = {
    "properties=5": (_props_int, r"key 'a': properties is a int, not torch's TensorProperties"),
    "dtype=None": (_dtype_none, r"key 'a': dtype None is not a torch dtype"),
    "size=5": (_size_int, r"key 'a': size 5 is not a list of non-negative integers"),
    "size overflows": (_size_overflows, r"key 'a': shape \[10+, 0\] is larger than torch allows"),
    "chunks=None": (_chunks_none, r"key 'a': chunks is a NoneType, not a list"),
    "chunk outside": (
        _chunk_outside,
        r"key 'a' chunk offsets=\[1, 0\] sizes=\[2, 3\]: lies outside the tensor's size \[2, 3\]",
    ),
    "chunk dims": (_chunk_dims, r"key 'a' chunk offsets=\[0\] sizes=\[6\]: has 1/1 dims, the"),
    "storage_data list": (_storage_list, r"storage_data is a list, not a dict"),
    "key 7": (_key_not_a_string, r"key 7 is not a string"),
    "value 0.5": (_value_not_storage_metadata, r"key 'lr': a float, not torch's TensorStorage"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_wrong_field_types_are_refused_naming_the_key_and_field(tmp_path, case):
    mutate, match = HOSTILE[case]
    md = _torch_dcp(tmp_path / "t", {"a": torch.arange(6.0).reshape(2, 3), "lr": 0.5})
    mutate(md)
    _rewrite(tmp_path / "t", md)
    _refused(tmp_path, r"\.metadata: " + match)


def test_the_cli_reports_wrong_field_types_as_a_damaged_checkpoint(tmp_path):
    md = _torch_dcp(tmp_path / "t", {"a": torch.arange(6.0).reshape(2, 3)})
    _props_int(md)
    _rewrite(tmp_path / "t", md)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(
            ["ckpt", "convert", str(tmp_path / "t"), str(tmp_path / "s"), "--from", "torch-dcp"]
        )
    assert code == 3, err.getvalue()  # a damaged checkpoint, not exit 4 "internal error"
    assert "key 'a': properties is a int" in err.getvalue()
    assert "internal error" not in err.getvalue() and "Traceback" not in err.getvalue()
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda n: b"PK\x03\x04" + bytes(n - 4), id="a zip without a directory"),
        pytest.param(lambda n: b"\x80\x02}q\x00(X" + b"\xff" * (n - 7), id="a broken pickle"),
    ],
)
def test_a_damaged_value_is_refused_naming_its_key(tmp_path, damage):
    """A non-tensor value is torch.save'd bytes inside a data file; damaged, it raised
    torch's RuntimeError or a pickle error of whatever kind (the CLI's exit 4)."""
    md = _torch_dcp(tmp_path / "t", {"a": torch.arange(6.0), "lr": 0.5})
    info = md.storage_data[MetadataIndex("lr")]
    data = tmp_path / "t" / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + info.length] = damage(info.length)
    data.write_bytes(raw)
    _refused(tmp_path, r"torch DCP value 'lr': not a readable torch.save file")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda raw: bytes(4) + raw[4:], id="no zip signature"),
        pytest.param(lambda raw: raw[:-30] + b"\xff" * 30, id="a damaged directory"),
        pytest.param(lambda raw: raw[:200] + b"\x00" * 60 + raw[260:], id="a damaged record"),
    ],
)
def test_a_damaged_tensor_is_refused_naming_its_key(tmp_path, damage):
    """A tensor is torch.save'd bytes inside a data file, read by torch's own reader;
    damaged, it raised whatever torch.load raised (the CLI's exit 4, or exit 2 for a
    ValueError). Honest metadata, damaged data: a CorruptCheckpointError (exit 3)."""
    md = _torch_dcp(tmp_path / "t", {"a": torch.arange(6.0), "w": torch.ones(64, 64)})
    info = md.storage_data[MetadataIndex("w", (0, 0))]
    data = tmp_path / "t" / info.relative_path
    raw = data.read_bytes()
    end = info.offset + info.length
    data.write_bytes(raw[: info.offset] + damage(raw[info.offset : end]) + raw[end:])
    _refused(tmp_path, r"/t: reading 'w' failed")
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["ckpt", "convert", str(tmp_path / "t"), str(tmp_path / "s")])
    assert code == 3 and "reading 'w' failed" in err.getvalue(), err.getvalue()


def test_importing_a_torch_save_file_points_to_torch_save_to_dcp(tmp_path):
    """It was a CorruptCheckpointError ("cannot open (Not a directory)"): nothing is
    damaged, the file is just the other format (errors audit)."""
    from shardkit.checkpoint.format_utils import import_torch_dcp

    torch.save({"w": torch.ones(2)}, tmp_path / "f.pt")
    with pytest.raises(ValueError, match=r"is a file;.*torch_save_to_dcp\(src, dst\)"):
        import_torch_dcp(tmp_path / "f.pt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
