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
