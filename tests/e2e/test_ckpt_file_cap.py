"""Data files capped at ``FileSystemWriter(max_file_bytes=...)``: a rank's share spans
several files, each a valid safetensors file, and save, async_save, load, resharded load
and ``shardkit ckpt verify`` handle them."""

import io
import os
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from column_planner import ColumnPlanner
from safetensors.torch import load_file

import shardkit.checkpoint as dcp
from shardkit.cli import main

CAP = 4096


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(100, 24, generator=g),  # 9600 bytes: cut into row pieces
        "small": torch.arange(10, dtype=torch.int64),
        "wide": torch.randn(1, 2000, generator=g),  # one row larger than the cap
        "bf": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "step": 5,
    }


def _data_files(path):
    return sorted(n for n in os.listdir(path) if n.startswith("data-"))


def _check_files(path, md):
    names = _data_files(path)
    assert names == sorted(n for n in md.files if n.startswith("data-"))
    assert len(names) >= 4
    for name in names:
        tensors = load_file(os.path.join(path, name))  # each file is valid safetensors
        data = sum(t.numel() * t.element_size() for t in tensors.values())
        one_row = len(tensors) == 1 and next(iter(tensors.values())).shape[0] == 1
        assert data <= CAP or one_row, (name, data)


@pytest.mark.parametrize("use_async", [False, True])
def test_capped_files_round_trip(tmp_path, use_async):
    sd = _state()
    writer = dcp.FileSystemWriter(tmp_path, max_file_bytes=CAP, sync_files=False)
    if use_async:
        md = dcp.async_save(sd, storage_writer=writer).result()
    else:
        md = dcp.save(sd, storage_writer=writer)
    _check_files(tmp_path, md)
    assert len(md.tensors["big"].chunks) == 3  # 9600 bytes in pieces of <= 4096
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in sd.items()}
    dcp.load(target, checkpoint_id=tmp_path)
    for key, value in sd.items():
        assert torch.equal(target[key], value) if torch.is_tensor(value) else target[key] == 5
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["ckpt", "verify", "--no-progress", str(tmp_path)]) == 0, err.getvalue()


def test_capped_column_chunks_load_resharded(tmp_path):
    full = torch.randn(64, 40)
    writer = dcp.FileSystemWriter(tmp_path, max_file_bytes=2048, sync_files=False)
    md = dcp.save({"w": full}, storage_writer=writer, planner=ColumnPlanner())
    assert len(_data_files(tmp_path)) >= 4
    assert all(c.box.sizes[1] == 20 for c in md.tensors["w"].chunks)
    target = {"w": torch.zeros(64, 40)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], full)


def test_uncapped_writes_one_file(tmp_path):
    writer = dcp.FileSystemWriter(tmp_path, max_file_bytes=None, sync_files=False)
    dcp.save(_state(), storage_writer=writer)
    assert len(_data_files(tmp_path)) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4096"])
def test_bad_cap_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="max_file_bytes"):
        dcp.FileSystemWriter(tmp_path, max_file_bytes=bad)


def test_incremental_save_with_capped_files(tmp_path):
    sd = _state()
    cap = {"max_file_bytes": CAP, "sync_files": False}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "a", **cap))
    sd["small"] = sd["small"] + 1  # one small chunk changes, the capped pieces do not
    md = dcp.save(
        sd,
        storage_writer=dcp.FileSystemWriter(tmp_path / "b", **cap),
        incremental_base=tmp_path / "a",
    )
    written = [n for n in os.listdir(tmp_path / "b") if n.startswith("data-")]
    assert len(written) < len(_data_files(tmp_path / "a"))  # the unchanged files are reused
    assert len(md.tensors["big"].chunks) == 3
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in sd.items()}
    dcp.load(target, checkpoint_id=tmp_path / "b")
    assert all(torch.equal(target[k], v) for k, v in sd.items() if torch.is_tensor(v))
