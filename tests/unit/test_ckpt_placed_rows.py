"""Resharded loads place each piece of saved rows into its strided destination (a
cache-sized piece read, hashed in one call, and its part copied into place in one)
whenever the destination is on the CPU in the saved dtype: chunks cut along a later dim,
a rank's column shard, any row length, any strides.

Each case checks the bytes against the saved tensor and whether the placing path was
taken, so a wrong fast path and a regression to the generic copy path both show.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from column_planner import ColumnPlanner

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _format, _read_chunks
from shardkit.checkpoint._core._errors import CorruptCheckpointError
from shardkit.checkpoint._core._planner import ReadItem
from shardkit.spmd.layout import Box


@pytest.fixture
def placed(monkeypatch):
    """Small blocks, rows and pieces; counts the rows placed into strided rows."""
    monkeypatch.setattr(_format, "BLOCK_BYTES", 512)
    monkeypatch.setattr(_read_chunks, "_PLACE_PIECE_BYTES", 7 * 64)
    monkeypatch.setattr(_read_chunks, "_SPLIT_BYTES", 1024)
    rows = []
    real = _read_chunks._place

    def spy(out, src):
        rows.append(out.shape[0])
        return real(out, src)

    monkeypatch.setattr(_read_chunks, "_place", spy)
    return rows


@pytest.mark.parametrize("threads", [1, 3])
def test_column_chunks_are_placed_into_strided_rows(tmp_path, placed, threads):
    full = torch.randn(60, 24, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8, 10]))
    target = {"w": torch.zeros(60, 24, dtype=torch.float64)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=threads))
    assert torch.equal(target["w"], full)
    assert sum(placed) == 3 * 60  # every row of every chunk, placed


def test_padded_destination_rows(tmp_path, placed):
    """The destination is a column window of a wider tensor (row pitch > row width)."""
    full = torch.arange(40 * 12, dtype=torch.float32).reshape(40, 12)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([6]))
    wide = torch.full((40, 20), -1.0)
    dcp.load({"w": wide[:, 3:15]}, checkpoint_id=tmp_path)
    assert torch.equal(wide[:, 3:15], full)
    assert torch.equal(wide[:, :3], torch.full((40, 3), -1.0))
    assert torch.equal(wide[:, 15:], torch.full((40, 5), -1.0))
    assert sum(placed) == 2 * 40


@pytest.mark.parametrize(
    "shape, dtype, widths, column_major",
    [
        ((50, 12), torch.float64, [4, 5], False),  # three uneven chunks: 32, 40, 24 B rows
        ((70, 12), torch.float64, [3], False),  # 3 and 9 columns: different rows per block
        ((96, 48), torch.float32, [16], False),  # 64 and 128 B rows
        ((40, 8), torch.float32, [4], True),  # column-major destination: rows strided too
    ],
)
def test_column_chunks_of_any_widths_into_any_strides(
    tmp_path, placed, shape, dtype, widths, column_major
):
    full = torch.randn(*shape, dtype=dtype)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner(widths))
    num_chunks = len(md.tensors["w"].chunks)
    assert num_chunks == len(widths) + 1
    dest = (
        torch.zeros(shape[::-1], dtype=dtype).t()
        if column_major
        else torch.zeros(shape, dtype=dtype)
    )
    dcp.load({"w": dest}, checkpoint_id=tmp_path)
    assert torch.equal(dest, full)
    assert sum(placed) == num_chunks * shape[0]


def test_a_dtype_change_takes_the_copy_path(tmp_path, placed):
    """float64 saved, float32 wanted: each piece goes through ``copy_``, which casts."""
    full = torch.randn(30, 16, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    dest = torch.zeros(30, 16, dtype=torch.float32)
    dcp.load({"w": dest}, checkpoint_id=tmp_path)
    assert torch.equal(dest, full.float()) and placed == []


def _read_item(path, item: ReadItem, dest: torch.Tensor) -> None:
    """Read one planned item (a box of one chunk) into ``dest`` as a load does."""
    planner = SimpleNamespace(resolve_tensor=lambda _: dest)
    files = _read_chunks.LocalFiles(dcp.FileSystemReader(path))
    try:
        _read_chunks._read_one(planner, item, dest.dtype, files)
    finally:
        files.close()


def test_part_of_a_chunks_columns_is_placed(tmp_path, placed):
    """A destination that takes columns 2..6 of a chunk (a rank's column shard)."""
    full = torch.randn(30, 16, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    dest = torch.zeros(30, 4, dtype=torch.float64)
    _read_item(tmp_path, ReadItem("w", Box((0, 2), (30, 4)), md.tensors["w"].chunks[0]), dest)
    assert torch.equal(dest, full[:, 2:6]) and sum(placed) == 30


def test_short_reads_are_completed(tmp_path, placed, monkeypatch):
    full = torch.randn(50, 16, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    real = os.preadv

    def short(fd, buffers, offset):  # at most 100 bytes per call, as a pipe might
        first = memoryview(buffers[0])
        return real(fd, [first[: min(100, len(first))]], offset)

    monkeypatch.setattr(_read_chunks.os, "preadv", short)
    target = torch.zeros(50, 16, dtype=torch.float64)
    dcp.load({"w": target}, checkpoint_id=tmp_path)
    assert torch.equal(target, full) and placed


def test_corrupt_byte_in_a_placed_chunk_is_named(tmp_path, placed):
    full = torch.randn(40, 16, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    chunk = md.tensors["w"].chunks[1]
    path = tmp_path / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 8 * 64 + 3] ^= 0x40  # row 8 of the second chunk
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        dcp.load({"w": torch.zeros(40, 16, dtype=torch.float64)}, checkpoint_id=tmp_path)
    assert placed


def test_remote_store_places_rows_one_request_per_piece(placed, monkeypatch):
    """A remote store gets one ranged read per piece of rows, never one per row."""
    full = torch.randn(30, 16, dtype=torch.float64)
    url = "memory://shardkit-placed/ckpt"
    dcp.save({"w": full}, checkpoint_id=url, planner=ColumnPlanner([8]))
    reads = []
    real = dcp.FileSystemReader.read_into

    def counted(self, name, offset, out):
        if offset > 0:  # not the file's header
            reads.append(len(out))
        return real(self, name, offset, out)

    monkeypatch.setattr(dcp.FileSystemReader, "read_into", counted)
    target = torch.zeros(30, 16, dtype=torch.float64)
    dcp.load({"w": target}, storage_reader=dcp.FileSystemReader(url, thread_count=2))
    assert torch.equal(target, full) and sum(placed) == 2 * 30
    assert sorted(reads) == sorted(64 * n for n in placed)  # 64 B rows, 7 a piece at most
    assert max(reads) == 7 * 64


def test_a_row_window_starting_inside_a_block_is_placed_and_verified(tmp_path, placed):
    """Rows 5..35 of a column chunk: every row is placed, those of pieces the window cuts
    too, and every checksum block touched is verified in full."""
    full = torch.randn(40, 16, dtype=torch.float64)
    md = dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([8]))
    chunk = md.tensors["w"].chunks[1]  # columns 8..16, 8 rows per checksum block

    def read_window() -> torch.Tensor:
        wide = torch.zeros(30, 16, dtype=torch.float64)
        _read_item(tmp_path, ReadItem("w", Box((5, 8), (30, 8)), chunk), wide[:, 8:])
        return wide

    wide = read_window()
    assert torch.equal(wide[:, 8:], full[5:35, 8:])
    assert torch.equal(wide[:, :8], torch.zeros(30, 8, dtype=torch.float64))
    assert sum(placed) == 30
    path = tmp_path / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 2 * 64] ^= 0x01  # row 2: outside the window, inside its first block
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch.*rows 0\.\.8"):
        read_window()


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
