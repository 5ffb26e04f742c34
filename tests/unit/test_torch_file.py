"""Reading torch.save files without mapping them privately (``TorchFile``)."""

from __future__ import annotations

import pathlib
import re
from collections import OrderedDict

import pytest
import torch

import shardkit
from shardkit.checkpoint._convert._torch_file import TorchFile
from shardkit.checkpoint._core._errors import CorruptCheckpointError


def _state() -> dict:
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "x": x,
        "t": x.t(),  # a strided view of the same storage
        "row": x[2],  # a view at a storage offset
        "nested": OrderedDict(b=torch.arange(5, dtype=torch.bfloat16), e=torch.empty(0, 3)),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "list": [torch.ones(2, dtype=torch.float16), 3],
        "step": 11,
    }


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and b.device.type == "cpu"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("mapped", [False, True])
def test_values_match_torch_load(tmp_path, mapped):
    path = tmp_path / "f.pt"
    torch.save(_state(), path)
    want = torch.load(path, weights_only=True)
    with TorchFile(path) as f:
        assert f.obj["x"].device.type == "meta"  # nothing read until asked
        got = f.materialize(f.obj, mapped=mapped)
    _same(want, got)


def test_read_into_a_row_range_of_a_larger_tensor(tmp_path):
    path = tmp_path / "f.pt"
    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, path)
    full = torch.zeros(5, 4)
    with TorchFile(path) as f:
        f.read_into(f.obj["w"], full.narrow(0, 1, 3))
        with pytest.raises(ValueError, match="shape"):
            f.read_into(f.obj["w"], torch.zeros(4, 3))
    assert torch.equal(full[1:4], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(full[0], torch.zeros(4)) and torch.equal(full[4], torch.zeros(4))


def test_truncated_file_is_corrupt(tmp_path):
    path = tmp_path / "f.pt"
    torch.save({"w": torch.arange(4096.0)}, path)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError):
        TorchFile(cut)


def test_legacy_format_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy"):
        TorchFile(path)


_PRIVATE_MAP = re.compile(r"mmap\s*=\s*True|ACCESS_COPY|MAP_PRIVATE")


def test_no_file_in_the_package_maps_a_file_privately():
    """torch.load(mmap=True) and ACCESS_COPY maps are charged in full against committed
    memory; every read path reads into its destination or maps read-only and shared."""
    root = pathlib.Path(shardkit.__file__).parent
    files = list(root.rglob("*.py"))
    assert len(files) > 20, root
    hits = [
        f"{p.relative_to(root)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if _PRIVATE_MAP.search(line)
    ]
    assert hits == []
    assert _PRIVATE_MAP.search('torch.load(p, map_location="cpu", mmap=True)')


_HOSTILE_VIEWS = {
    # 4 bytes of storage read as 64 MiB (a 1.4 KB file became 64 MiB of output)
    "expand": lambda: {"x": torch.zeros(1).expand(1 << 24)},
    "nested expand": lambda: {"model": {"w": torch.zeros(1, 3).expand(1 << 20, 3)}},
    # 20 bytes of storage read as 32 (overlapping windows)
    "overlap": lambda: {"x": torch.arange(5.0).as_strided((4, 2), (1, 1))},
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_VIEWS))
def test_a_view_holding_more_than_it_covers_is_refused_naming_the_key(tmp_path, case):
    path = tmp_path / "f.pt"
    torch.save(_HOSTILE_VIEWS[case](), path)
    assert path.stat().st_size < 4096
    with pytest.raises(CorruptCheckpointError) as info:
        TorchFile(path)
    msg = str(info.value)
    key = "'model.w'" if case == "nested expand" else "'x'"
    assert str(path) in msg and f"key {key}" in msg and "expanded or overlapping" in msg, msg


def test_many_keys_viewing_one_storage_are_bounded(tmp_path):
    """Tied weights import, but 64 keys viewing one 64 KiB storage (4 MiB from a 70 KB
    file) exceed 8 x the file's size + 1 MiB."""
    s = torch.zeros(1 << 14)
    path = tmp_path / "f.pt"
    torch.save({f"k{i}": s for i in range(64)}, path)
    with pytest.raises(CorruptCheckpointError, match=r"f\.pt: its tensors hold 4194304 bytes"):
        TorchFile(path)


def test_tied_weights_and_strided_views_still_import(tmp_path):
    from shardkit.checkpoint import load
    from shardkit.checkpoint.format_utils import torch_save_to_dcp

    w = torch.arange(4096.0).reshape(64, 64)
    x = torch.arange(24.0).reshape(4, 6)
    state = {
        "emb": w,
        "head": w,  # tied: both keys view one storage
        "t": x.t(),
        "cols": x[:, ::2],
        "row": x[2],
        "pos": torch.arange(8).expand(1, -1),  # expanding a size-1 dim repeats nothing
    }
    path = tmp_path / "f.pt"
    torch.save(state, path)
    with TorchFile(path) as f:
        _same(state, f.materialize(f.obj))
    torch_save_to_dcp(path, tmp_path / "ckpt", progress=False)
    out = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}
    load(out, checkpoint_id=tmp_path / "ckpt")
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_legacy_file_with_an_expanded_view_is_refused_by_torch_save_to_dcp(tmp_path):
    from shardkit.checkpoint.format_utils import torch_save_to_dcp

    path = tmp_path / "old.pt"
    torch.save({"x": torch.zeros(1).expand(1 << 20)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptCheckpointError, match=r"old\.pt: key 'x' .*expanded"):
        torch_save_to_dcp(path, tmp_path / "ckpt", progress=False)
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
