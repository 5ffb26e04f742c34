"""Chunks that fill destination rows side by side are read in lockstep (one cat per band).

Each case checks the bytes against the saved tensor, and whether the fast band path was
taken, so a regression to the per-chunk strided path, or a wrong fast path, both show.
"""

import pytest
import torch
from column_planner import ColumnPlanner

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _format, _read_chunks


@pytest.fixture
def bands(monkeypatch):
    """Small blocks and pieces, and a record of every band the reader found (or not)."""
    monkeypatch.setattr(_format, "BLOCK_BYTES", 512)
    monkeypatch.setattr(_read_chunks, "_BAND_PIECE_BYTES", 1000)
    found = []
    real = _read_chunks._band

    def spy(items, dests):
        result = real(items, dests)
        found.append(result is not None)
        return result

    monkeypatch.setattr(_read_chunks, "_band", spy)
    return found


def test_three_uneven_column_chunks_use_one_band(tmp_path, bands):
    full = torch.randn(50, 12, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([4, 5]))
    assert [c.box.sizes for c in md.tensors["w"].chunks] == [(50, 4), (50, 5), (50, 3)]
    target = {"w": torch.zeros(50, 12, dtype=torch.float64)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], full)
    assert bands == [True]


def test_misaligned_pieces_fall_back_piece_by_piece(tmp_path, bands):
    # 3 and 9 columns of float64: different rows per checksum block and per piece
    full = torch.randn(70, 12, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([3]))
    target = {"w": torch.zeros(70, 12, dtype=torch.float64)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], full)
    assert bands == [True]


def test_non_contiguous_destination_takes_the_strided_path(tmp_path, bands):
    full = torch.randn(40, 8)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([4]))
    dest = torch.zeros(8, 40).t()  # column-major: no contiguous band exists
    dcp.load({"w": dest}, checkpoint_id=tmp_path)
    assert torch.equal(dest, full)
    assert bands == [False]


def test_remote_store_reads_a_band_in_lockstep(bands):
    full = torch.randn(30, 6)
    url = "memory://shardkit-bands/ckpt"
    dcp.save({"w": full}, checkpoint_id=url, planner=ColumnPlanner([2]))
    target = {"w": torch.zeros(30, 6)}
    dcp.load(target, checkpoint_id=url)
    assert torch.equal(target["w"], full)
    assert bands == [True]  # each chunk of the band reads into its own scratch buffer


def test_corrupt_chunk_in_a_band_is_named(tmp_path, bands):
    full = torch.randn(64, 10, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([5]))
    chunk = md.tensors["w"].chunks[1]
    path = tmp_path / chunk.file
    raw = bytearray(path.read_bytes())
    raw[chunk.offset + chunk.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match=r"'w' chunk offsets=\[0, 5\].*rows"):
        dcp.load({"w": torch.zeros(64, 10, dtype=torch.float64)}, checkpoint_id=tmp_path)
    assert bands == [True]


def test_unequal_column_chunks_fill_a_band(tmp_path, bands):
    full = torch.randn(96, 48)  # float32 column chunks of 16 and 32: 64- and 128-byte rows
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([16]))
    target = {"w": torch.zeros(96, 48)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], full)
    assert bands == [True]


def test_reader_threads_share_one_large_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(_format, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(_read_chunks, "_SPLIT_BYTES", 16 << 10)
    ranges = []
    real = _read_chunks._split
    monkeypatch.setattr(
        _read_chunks, "_split", lambda i, d: ranges.append(real(i, d)) or real(i, d)
    )
    full = torch.randn(1000, 48)  # 192 KB in one chunk, 4 KiB checksum blocks
    md = dcp.save({"w": full}, checkpoint_id=tmp_path)
    reader = dcp.FileSystemReader(tmp_path, thread_count=3)
    target = {"w": torch.zeros(1000, 48)}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], full)
    (parts,) = ranges
    assert len(parts) > 4
    (chunk,) = md.tensors["w"].chunks
    assert all(p.box.offsets[0] % chunk.block_rows == 0 for p in parts)  # whole blocks
    assert sum(p.box.sizes[0] for p in parts) == 1000
    path = tmp_path / chunk.file
    raw = bytearray(path.read_bytes())
    raw[chunk.offset + chunk.nbytes - 5] ^= 0x01  # in the last range's last block
    path.write_bytes(bytes(raw))
    with pytest.raises(dcp.CorruptCheckpointError, match="checksum mismatch"):
        dcp.load({"w": torch.zeros(1000, 48)}, storage_reader=reader)
