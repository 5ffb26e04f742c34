"""torch.save files that lie or are damaged, imported by ``torch_save_to_dcp`` and the
command line: each is a ``CorruptCheckpointError`` naming the file, raised before
``torch.load`` allocates anything, never torch's own allocation error or a raw pickle
error (which the command line reported as an internal error, exit 4)."""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from contextlib import redirect_stderr

import fsspec
import pytest
import torch

from shardkit.checkpoint import CorruptCheckpointError
from shardkit.checkpoint._convert._convert import _torch_load
from shardkit.checkpoint.format_utils import torch_save_to_dcp
from shardkit.cli import main

STATE = {"w": torch.arange(10.0), "b": {"x": torch.ones(3, dtype=torch.float64)}}


class _Storage:  # stands for a storage in the pickle: its persistent id says what it is
    pass


def _legacy_declaring(path, numel: int) -> None:
    """A 350-byte legacy torch.save file whose one float storage declares ``numel``
    elements (``torch.load`` would allocate ``4 * numel`` bytes before reading any)."""
    storage = _Storage()

    class _Tensor:
        def __reduce__(self):
            args = (storage, 0, (numel,), (1,), False, collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is storage:
                return ("storage", torch.FloatStorage, "k0", "cpu", numel, None)
            return None

    with open(path, "wb") as f:
        pickle.dump(0x1950A86A20F9469CFC6C, f, protocol=2)  # legacy magic number
        pickle.dump(1001, f, protocol=2)
        sys_info = dict(protocol_version=1001, little_endian=True, type_sizes={})
        pickle.dump(sys_info, f, protocol=2)
        _Pickler(f, protocol=2).dump({"w": _Tensor()})
        pickle.dump(["k0"], f, protocol=2)
        f.write(struct.pack("<q", numel) + bytes(16))


def _to_memory(path, name: str) -> str:
    url = f"memory://torch-file-hostile/{name}"
    with fsspec.open(url, "wb") as f:
        f.write(path.read_bytes())
    return url


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_legacy_file_declaring_400_gb_is_refused_before_torch_loads_it(
    tmp_path, monkeypatch, where
):
    path = tmp_path / "huge.pt"
    _legacy_declaring(path, 10**11)
    source = str(path) if where == "local" else _to_memory(path, "huge.pt")
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a))
    with pytest.raises(CorruptCheckpointError, match=r"huge\.pt: its storages declare 4000"):
        torch_save_to_dcp(source, tmp_path / "out", progress=False)
    assert not calls  # refused before torch.load (and its 400 GB allocation)
    assert not (tmp_path / "out").exists()


def test_the_command_line_says_so_in_one_line(tmp_path):
    path = tmp_path / "huge.pt"
    _legacy_declaring(path, 10**9)
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["ckpt", "convert", str(path), str(tmp_path / "out")])
    assert code == 3, err.getvalue()  # a damaged input, not an internal error (4)
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "huge.pt" in lines[0] and "declare 4000000008 bytes" in lines[0]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_truncated_legacy_file_is_refused_and_a_whole_one_converts(tmp_path, where):
    whole = tmp_path / "whole.pt"
    torch.save(STATE, whole, _use_new_zipfile_serialization=False)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole.read_bytes()[:-40])
    sources = [str(p) if where == "local" else _to_memory(p, p.name) for p in (whole, cut)]
    torch_save_to_dcp(sources[0], tmp_path / "ok", progress=False)
    with pytest.raises(CorruptCheckpointError, match=r"cut\.pt: its storages declare"):
        torch_save_to_dcp(sources[1], tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()


def test_a_truncated_remote_zip_file_is_refused(tmp_path):
    path = tmp_path / "z.pt"
    torch.save(STATE, path)
    url = _to_memory(path, "z.pt")
    torch_save_to_dcp(url, tmp_path / "ok", progress=False)  # whole: converts
    cut = tmp_path / "zcut.pt"
    cut.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CorruptCheckpointError, match=r"zcut\.pt"):
        torch_save_to_dcp(_to_memory(cut, "zcut.pt"), tmp_path / "bad", progress=False)


def _structure(path) -> list[int]:
    """Offsets of every byte of a zip-format file but its tensors' payloads (a damaged
    payload byte is a changed value: torch.save files carry no checksum) and the padding
    inside its local headers' extra fields (which no reader looks at)."""
    from shardkit.checkpoint._convert._torch_file import records

    data = path.read_bytes()
    with open(path, "rb") as f:
        skip = {
            i
            for start, n in records(f, str(path), len(data)).items()
            for i in range(start, start + n)
        }
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            padding = info.header_offset + 30 + name_len
            skip.update(range(padding + 4, padding + extra_len))  # after its id and size
    return [i for i in range(len(data)) if i not in skip]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("kind", ["zip", "legacy"])
def test_every_damaged_byte_is_refused_or_imports(tmp_path, kind):
    """Every damaged byte of the file (for the zip format: but its tensors' payloads)
    either imports (a changed name or value) or is a CorruptCheckpointError; a flipped
    endianness flag says so in a ValueError. Before, a raw KeyError, UnicodeDecodeError,
    UnpicklingError... from torch.load, or a BadZipFile from a damaged record header,
    was what 1 in 5 such files gave."""
    path = tmp_path / "f.pt"
    torch.save(STATE, path, _use_new_zipfile_serialization=kind == "zip")
    data = path.read_bytes()
    span = _structure(path) if kind == "zip" else range(len(data))
    outcomes = collections.Counter()
    for offset in span:
        value = 0xFF if offset % 2 else 0x00  # either value at every other byte
        if data[offset] == value:
            value ^= 0xFF
        bad = bytearray(data)
        bad[offset] = value
        path.write_bytes(bad)
        try:
            _torch_load(path)  # what torch_save_to_dcp reads, then saves
            outcomes["imported"] += 1
        except CorruptCheckpointError:
            outcomes["refused"] += 1
        except ValueError as exc:
            assert "big-endian" in str(exc), (offset, value, exc)
            outcomes["big-endian"] += 1
    assert outcomes["refused"] > 0 and outcomes["imported"] > 0, outcomes
