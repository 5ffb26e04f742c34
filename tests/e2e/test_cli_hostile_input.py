"""Hostile inputs to the conversions and ``shardkit ckpt convert|diff|inspect``: crafted
safetensors files, shapes torch cannot hold, terminal escapes in key names, and a diff that
must parse each side's metadata once (not once per key).

Each bad file is a CorruptCheckpointError naming the file (and the key where there is
one); the CLI exits 3, a damaged checkpoint (docs/cli.md), never 2 (usage) or 4 (a bug).
Commands run in-process through ``main(argv)``.
"""

import json
import shutil
import struct

import pytest
import torch
from hostile import shardkit
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp
from shardkit.checkpoint import CorruptCheckpointError
from shardkit.checkpoint import format_utils as fu
from shardkit.checkpoint._core import _validate

EXIT_DAMAGED = 3


def _error_line(result):
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardkit: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- A: diff parses each side's metadata once ----------------------------------------------
def test_diff_parses_each_metadata_once(tmp_path, monkeypatch):
    """A diff of N keys used to parse and validate the whole metadata once per key and side
    (load() per key): quadratic in the number of keys."""
    n = 12
    dcp.save({f"t{i}": torch.full((2,), float(i)) for i in range(n)}, checkpoint_id=tmp_path / "a")
    changed = {f"t{i}": torch.full((2,), float(i)) for i in range(n)}
    changed["t3"] += 1
    dcp.save(changed, checkpoint_id=tmp_path / "b")
    parses = []
    real = _validate.parse_metadata
    monkeypatch.setattr(
        _validate, "parse_metadata", lambda raw, source: parses.append(source) or real(raw, source)
    )
    out = shardkit("ckpt", "diff", tmp_path / "a", tmp_path / "b", code=1).stdout
    assert "differ: 1" in out and "t3" in out and f"identical: {n - 1}" in out
    assert sorted(parses) == sorted(
        [f"{tmp_path / 'a'}/metadata.json", f"{tmp_path / 'b'}/metadata.json"]
    ), parses


# -- B: crafted safetensors files ------------------------------------------------------------
_A = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


def _st(header: str, data: bytes = b"\0" * 8) -> bytes:
    raw = header.encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _with_values(values: str) -> bytes:
    """A valid one-tensor file whose __metadata__["shardkit.values"] is ``values``."""
    return _st('{"__metadata__":{"shardkit.values":' + values + "}," + _A + "}")


_HOSTILE_SAFETENSORS = {
    "header nested 100000 deep": (
        _st("{" + _A + ',"x":' + "[" * 100000 + "]" * 100000 + "}"),
        "nested deeper",
    ),
    "header 5000-digit number": (_st("{" + _A + ',"x":' + "9" * 5000 + "}"), "not valid JSON"),
    "empty tensor of shape [1e30, 0]": (
        _st('{"z":{"dtype":"F32","shape":[' + str(10**30) + ',0],"data_offsets":[0,0]}}', b""),
        "key 'z'",
    ),
    "empty tensor whose dims overflow int64": (
        _st('{"z":{"dtype":"F32","shape":[' + str(2**62) + ',4,0],"data_offsets":[0,0]}}', b""),
        "key 'z'",
    ),
    "values not JSON": (_with_values('"{nope"'), "shardkit.values"),
    "values float tag without repr": (
        _with_values(json.dumps(json.dumps({"x": {"__shardkit__": "float"}}))),
        "shardkit.values",
    ),
    "values dict tag with a list key": (
        _with_values(json.dumps(json.dumps({"x": {"__shardkit__": "dict", "items": [[[1], 2]]}}))),
        "shardkit.values",
    ),
    "values a JSON list": (_with_values('"[1,2]"'), "shardkit.values"),
    "values nested 50000 deep": (
        _with_values('"' + "[" * 50000 + "]" * 50000 + '"'),
        "nested deeper",
    ),
    "values not a string": (_with_values("5"), "__metadata__"),
    "a value under a tensor's key": (
        _with_values(json.dumps(json.dumps({"a": 1}))),
        "keys ['a'] are both tensors and",
    ),
}


@pytest.mark.parametrize("case", list(_HOSTILE_SAFETENSORS))
def test_hostile_safetensors_is_a_damaged_file(tmp_path, case):
    raw, why = _HOSTILE_SAFETENSORS[case]
    src = tmp_path / "in.safetensors"
    src.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError) as info:
        fu.from_safetensors(src, tmp_path / "out", progress=False)
    assert str(src) in str(info.value) and why in str(info.value)
    assert not (tmp_path / "out").exists()
    line = _error_line(shardkit("ckpt", "convert", src, tmp_path / "out", code=EXIT_DAMAGED))
    assert str(src) in line and why in line
    assert not (tmp_path / "out").exists()
    line = _error_line(shardkit("ckpt", "diff", src, src, code=EXIT_DAMAGED))
    assert str(src) in line and why in line


def test_diff_of_good_safetensors_files_still_works(tmp_path):
    """diff reads safetensors through the checked reader of convert: values and tensors."""
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "lr": 0.5}, checkpoint_id=tmp_path / "c")
    fu.to_safetensors(tmp_path / "c", tmp_path / "a.safetensors", progress=False)
    dcp.save({"w": torch.arange(6.0).reshape(2, 3) * 2, "lr": 0.5}, checkpoint_id=tmp_path / "d")
    fu.to_safetensors(tmp_path / "d", tmp_path / "b.safetensors", progress=False)
    out = shardkit("ckpt", "diff", tmp_path / "a.safetensors", tmp_path / "c", code=0).stdout
    assert "identical: 2" in out
    out = shardkit(
        "ckpt", "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", code=1
    ).stdout
    assert "max |a-b| = 5" in out and "identical: 1" in out


# -- C: shapes torch cannot hold, in a checkpoint's metadata ---------------------------------
def _with_empty_tensor(path, shape):
    """A resealed version-1 checkpoint holding a zero-element tensor 'z' of ``shape``."""
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=path)
    doc = json.loads((path / "metadata.json").read_bytes())
    doc["tensors"]["z"] = {
        "dtype": "float32",
        "shape": shape,
        "chunks": [
            {
                "offsets": [0] * len(shape),
                "sizes": shape,
                "file": next(iter(doc["files"])),
                "name": "z@0",
                "offset": 0,
                "nbytes": 0,
                "block_rows": 1,
                "xxh3_64": [],
            }
        ],
    }
    doc["version"] = 1  # no safetensors header to rebuild around the empty chunk
    reseal_metadata(path, doc)


@pytest.mark.parametrize(
    "shape", [[10**30, 0], [2**63, 0], [2**62, 4, 0]], ids=["1e30", "2**63", "product"]
)
def test_zero_element_tensor_with_a_huge_shape_is_refused(tmp_path, shape):
    ckpt = tmp_path / "c"
    _with_empty_tensor(ckpt, shape)
    with pytest.raises(CorruptCheckpointError, match=r"metadata\.json: key 'z': shape"):
        dcp.read_metadata(ckpt)
    for cmd in (["convert", ckpt, tmp_path / "x.safetensors"], ["diff", ckpt, ckpt]):
        line = _error_line(shardkit("ckpt", *cmd, code=EXIT_DAMAGED))
        assert "key 'z'" in line and "2**63-1" in line


def test_largest_shapes_torch_holds_still_load(tmp_path):
    """The bound is torch's own: a dim of 2**63-1 next to a 0 is a valid empty tensor."""
    ckpt = tmp_path / "c"
    _with_empty_tensor(ckpt, [2**63 - 1, 0])
    assert dcp.read_metadata(ckpt).tensors["z"].shape == (2**63 - 1, 0)
    assert torch.empty(2**63 - 1, 0).numel() == 0


# -- E: what the CLI prints from a checkpoint is escaped -------------------------------------
def test_inspect_and_diff_escape_terminal_sequences(tmp_path):
    ckpt, clean = tmp_path / "c", tmp_path / "clean"
    dcp.save({"w": torch.ones(2), "b": torch.zeros(3), "n": 7}, checkpoint_id=ckpt)
    shutil.copytree(ckpt, clean)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    doc["values"]["\x1b]0;pwned-title\x07\x1b[2K\rfake: everything OK"] = 1
    doc["values"]["n"] = "\x1b[31mred"
    doc["tensors"]["\x1b[2Jcleared"] = doc["tensors"].pop("b")
    doc["created"] = "\x1b[2J2026"
    reseal_metadata(ckpt, doc)
    results = [
        shardkit("ckpt", "inspect", ckpt, code=0),
        shardkit("ckpt", "diff", ckpt, clean, code=1),
        shardkit("ckpt", "diff", clean, ckpt, code=1),
    ]
    for result in results:
        printed = result.stdout + result.stderr
        assert "\x1b" not in printed and "\x07" not in printed and "\r" not in printed
        assert "\\x1b[2Jcleared" in printed
        assert "\\x1b]0;pwned-title\\x07\\x1b[2K\\rfake: everything OK" in printed
    assert "created        \\x1b[2J2026" in results[0].stdout


# -- F: found by fuzzing the metadata (2026-11-28) -------------------------------------------
def _version_1_with(ckpt, edit) -> None:
    """A saved checkpoint rewritten as format version 1, which the seal does not cover."""
    dcp.save({"w": torch.ones(4), "n": 7}, checkpoint_id=ckpt)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    doc.pop("metadata_xxh3_64", None)
    doc["version"] = 1
    edit(doc)
    (ckpt / "metadata.json").write_text(json.dumps(doc))


def _huge_file(doc) -> None:
    doc["files"]["extra.bin"] = 10**400


def _huge_object(doc) -> None:
    doc["files"]["objects-x.bin"] = 10**400
    doc["objects"]["extra"] = {"file": "objects-x.bin", "offset": 0, "nbytes": 10**400}
    doc["objects"]["extra"]["xxh3_64"] = "0" * 16


@pytest.mark.parametrize("edit", [_huge_file, _huge_object], ids=["file", "object"])
def test_a_file_size_past_int64_is_damage_not_an_overflow(tmp_path, edit):
    """ls, inspect and verify (with its progress bar) overflowed a float on such sizes and
    exited 4 (a bug); the metadata is now refused as damaged, naming the file."""
    ckpt = tmp_path / "run" / "step_00000001"
    _version_1_with(ckpt, edit)
    name = "extra.bin" if edit is _huge_file else "objects-x.bin"
    with pytest.raises(CorruptCheckpointError, match=f"file {name}: size of 401 digits"):
        dcp.read_metadata(ckpt)
    assert not dcp.is_committed(ckpt)
    for cmd in (["inspect", ckpt], ["diff", ckpt, ckpt]):
        line = _error_line(shardkit("ckpt", *cmd, code=EXIT_DAMAGED))
        assert f"file {name}: size of 401 digits is not a file size" in line
    verify = shardkit("ckpt", "verify", ckpt, code=1).stderr  # a verify failure
    assert f"FAILED {ckpt}/metadata.json: file {name}: size of 401 digits" in verify
    listing = shardkit("ckpt", "ls", tmp_path / "run", code=3).stdout
    assert "DAMAGED" in listing


def test_inspect_shows_a_value_with_tuple_keys(tmp_path):
    """The value format can spell a dict with tuple keys; inspect passed it to json.dumps,
    which cannot write such keys, and exited 2 naming neither key nor file."""
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.ones(2), "table": 0}, checkpoint_id=ckpt)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    pair = {"__shardkit__": "tuple", "items": [1, 2]}
    doc["values"]["table"] = {"__shardkit__": "dict", "items": [[pair, 3], ["k", [pair]]]}
    reseal_metadata(ckpt, doc)
    assert dcp.read_metadata(ckpt).values["table"] == {(1, 2): 3, "k": [(1, 2)]}
    out = shardkit("ckpt", "inspect", ckpt, code=0).stdout
    assert 'table = {"(1, 2)": 3, "k": [[1, 2]]}' in out
    as_json = json.loads(shardkit("ckpt", "inspect", ckpt, "--json", code=0).stdout)
    assert as_json["values"]["table"] == {"(1, 2)": 3, "k": [[1, 2]]}


def test_diff_checks_file_sizes_before_allocating_a_declared_shape(tmp_path):
    """A resealed metadata declaring a 4 TiB tensor, consistent in itself, over a 32-byte
    data file: diff allocated the declared shape first (exit 4, or the machine's memory)."""
    ckpt = tmp_path / "c"
    dcp.save({"a": torch.arange(8.0)}, checkpoint_id=ckpt)
    doc = json.loads((ckpt / "metadata.json").read_bytes())
    n = 2**40
    (chunk,) = doc["tensors"]["a"]["chunks"]
    header = _validate.safetensors_header([(chunk["name"], torch.float32, (n,), n * 4)])
    chunk.update(sizes=[n], nbytes=n * 4, offset=len(header), block_rows=n)
    chunk["xxh3_64"] = ["0" * 16]
    doc["tensors"]["a"]["shape"] = [n]
    doc["files"][chunk["file"]] = len(header) + n * 4
    reseal_metadata(ckpt, doc)
    assert dcp.read_metadata(ckpt).tensors["a"].shape == (n,)  # consistent in itself
    line = _error_line(shardkit("ckpt", "diff", ckpt, ckpt, code=EXIT_DAMAGED))
    assert chunk["file"] in line


def test_commands_reading_torch_files_close_them(tmp_path):
    """``diff`` and ``inspect`` of torch.save files, and one that holds no state dict,
    leave no descriptor open in a process that goes on (main() called in-process)."""
    import os

    torch.save({"w": torch.arange(4.0)}, tmp_path / "a.pt")
    torch.save({"w": torch.arange(4.0) + 1}, tmp_path / "b.pt")
    torch.save(torch.arange(3.0), tmp_path / "t.pt")
    before = len(os.listdir("/proc/self/fd"))
    shardkit("ckpt", "diff", tmp_path / "a.pt", tmp_path / "b.pt", code=1)
    shardkit("ckpt", "inspect", tmp_path / "a.pt", code=0)
    shardkit("ckpt", "diff", tmp_path / "t.pt", tmp_path / "a.pt", code=2)
    assert len(os.listdir("/proc/self/fd")) == before


def test_convert_removes_the_temporaries_a_killed_run_left(tmp_path):
    """A SIGKILLed convert or materialize left ``.NAME.partial-XXXX`` beside DST, up to
    its full size, for good (kill audit); the next run writing DST removes those older
    than ten minutes, and keeps a fresh one (another run may be writing it)."""
    import os
    import time

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "c")
    stale_file = tmp_path / ".out.pt.partial-0123456789ab"
    stale_dir = tmp_path / ".out.pt.partial-aaaaaaaaaaaa"
    fresh = tmp_path / ".out.pt.partial-bbbbbbbbbbbb"
    stale_file.write_bytes(b"x" * 100)
    stale_dir.mkdir()
    (stale_dir / "data").write_bytes(b"y")
    fresh.write_bytes(b"z")
    old = time.time() - 3600
    for path in (stale_file, stale_dir / "data", stale_dir):
        os.utime(path, (old, old))
    out = shardkit("ckpt", "convert", tmp_path / "c", tmp_path / "out.pt", "--to", "torch", code=0)
    assert not stale_file.exists() and not stale_dir.exists() and fresh.exists()
    assert "left by an interrupted run" in out.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt")["w"], torch.arange(4.0))
