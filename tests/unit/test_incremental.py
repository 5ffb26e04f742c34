"""Incremental checkpoints in one process: dedup, references, retention, materialize, hostile
references. (Multi-rank: tests/dist/test_incremental_dist.py; SIGKILL: e2e crash tests.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from metadata_edit import reseal_metadata

from shardkit.checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    is_committed,
    load,
    read_metadata,
    save,
)
from shardkit.checkpoint.format_utils import materialize

FROZEN = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "base": {"w": FROZEN, "b": torch.arange(64.0)},
        "lora": {"a": torch.randn(8, 64, generator=g), "b": torch.randn(64, 8, generator=g)},
        "step": step,
    }


def _empty() -> dict:
    return {
        "base": {"w": torch.zeros(512, 64), "b": torch.zeros(64)},
        "lora": {"a": torch.zeros(8, 64), "b": torch.zeros(64, 8)},
        "step": -1,
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a[p][k], b[p][k]) for p in ("base", "lora") for k in a[p])
        and a["step"] == b["step"]
    )


def _own_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def test_unchanged_chunks_are_referenced_not_rewritten(tmp_path):
    full = save(_state(1), checkpoint_id=tmp_path / "a")
    md = save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "a")
    assert full.version == 2 and not full.linked
    assert md.version == 3 and {link.dir for link in md.linked.values()} == {"a"}
    shared = {c.file for k in ("base.w", "base.b") for c in md.tensors[k].chunks}
    assert shared <= set(md.linked)
    assert all(c.file in md.files for k in ("lora.a", "lora.b") for c in md.tensors[k].chunks)
    assert _own_bytes(tmp_path / "b") < 0.2 * _own_bytes(tmp_path / "a")
    assert md.shared_bytes() == FROZEN.nbytes + 64 * 4
    got = _empty()
    load(got, checkpoint_id=tmp_path / "b")
    assert _same(got, _state(2)) and is_committed(tmp_path / "b")
    # a chain: c references b's own file and, through b, a's
    md3 = save(_state(3), checkpoint_id=tmp_path / "c", incremental_base=tmp_path / "b")
    assert {link.dir for link in md3.linked.values()} == {"a"}  # lora changed again
    md4 = save(_state(3), checkpoint_id=tmp_path / "d", incremental_base=tmp_path / "c")
    assert {link.dir for link in md4.linked.values()} == {"a", "c"} and not md4.files
    got = _empty()
    load(got, checkpoint_id=tmp_path / "d")
    assert _same(got, _state(3))


@pytest.mark.parametrize("windows", ["default", "small"])
@pytest.mark.parametrize("position", [100, 100_000, FROZEN.nbytes - 1])
def test_changed_bytes_under_a_matching_hash_are_rewritten(
    tmp_path, monkeypatch, position, windows
):
    """The dedup decision compares bytes, never the XXH3-64 checksums alone: a base file whose
    bytes differ from what its checksums say (as after a collision) is not referenced,
    whether the difference lies in the small first window compared or further on (with
    small windows: in the middle or the last of many)."""
    if windows == "small":
        from shardkit.checkpoint._core import _incremental

        monkeypatch.setattr(_incremental, "_FIRST_WINDOW", 4096)
        monkeypatch.setattr(_incremental, "_COMPARE_BYTES", 16384)
    save(_state(1), checkpoint_id=tmp_path / "a")
    base = read_metadata(tmp_path / "a")
    chunk = base.tensors["base.w"].chunks[0]
    assert chunk.nbytes == FROZEN.nbytes
    with open(tmp_path / "a" / chunk.file, "r+b") as f:  # checksums in metadata unchanged
        f.seek(chunk.offset + position)
        byte = f.read(1)
        f.seek(chunk.offset + position)
        f.write(bytes([byte[0] ^ 0xFF]))
    md = save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "a")
    assert md.tensors["base.w"].chunks[0].file in md.files
    got = _empty()
    load(got, checkpoint_id=tmp_path / "b")
    assert _same(got, _state(2))


def test_dtype_or_box_change_is_written_in_full(tmp_path):
    save({"w": FROZEN}, checkpoint_id=tmp_path / "a")
    md = save({"w": FROZEN.double()}, checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "a")
    assert not md.linked
    md = save({"w": FROZEN[:256]}, checkpoint_id=tmp_path / "c", incremental_base=tmp_path / "a")
    assert not md.linked


def test_base_must_be_a_committed_sibling(tmp_path):
    save(_state(1), checkpoint_id=tmp_path / "a")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="same parent directory"):
        save(_state(2), checkpoint_id=tmp_path / "sub" / "b", incremental_base=tmp_path / "a")
    with pytest.raises(ValueError, match="same parent directory"):
        save(_state(2), checkpoint_id=tmp_path / "a", incremental_base=tmp_path / "a")
    with pytest.raises(TypeError, match="incremental_base"):
        save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=3)
    with pytest.raises(Exception, match="no committed checkpoint"):
        save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "none")
    with pytest.raises(TypeError, match="incremental must be a bool"):
        CheckpointManager(tmp_path / "run", 1, incremental="yes", chkpt_on_preemption=False)


def _incremental_copy(tmp_path) -> tuple[dict, str]:
    save(_state(1), checkpoint_id=tmp_path / "a")
    save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "a")
    path = tmp_path / "b" / "metadata.json"
    raw = path.read_bytes()
    doc = json.loads(raw)
    doc.pop("metadata_xxh3_64")
    return doc, str(path)


def _write(doc: dict, path: str) -> None:
    reseal_metadata(os.path.dirname(path), doc)


@pytest.mark.parametrize(
    "field,value",
    [
        ("dir", ".."),
        ("dir", "../a"),
        ("dir", "/tmp"),
        ("dir", "s3://bucket/a"),
        ("dir", ".hidden"),
        ("name", "../a/x.safetensors"),
        ("name", "/etc/passwd"),
    ],
)
def test_hostile_references_are_refused_before_any_read(tmp_path, field, value):
    doc, path = _incremental_copy(tmp_path)
    name, link = next(iter(doc["linked"].items()))
    if field == "dir":
        link["dir"] = value
    else:
        doc["linked"] = {value: link}
        for t in doc["tensors"].values():
            for c in t["chunks"]:
                c["file"] = value if c["file"] == name else c["file"]
    _write(doc, path)
    with pytest.raises(CorruptCheckpointError, match="plain"):
        load(_empty(), checkpoint_id=tmp_path / "b")
    assert not is_committed(tmp_path / "b")


def test_bad_links_are_refused(tmp_path):
    doc, path = _incremental_copy(tmp_path)
    name = next(iter(doc["linked"]))
    original = json.loads(json.dumps(doc))
    doc["version"] = 2  # references need version 3
    _write(doc, path)
    with pytest.raises(CorruptCheckpointError, match="version 3"):
        load(_empty(), checkpoint_id=tmp_path / "b")
    doc = json.loads(json.dumps(original))
    doc["linked"][name]["header_xxh3_64"] = "0" * 16
    _write(doc, path)
    with pytest.raises(CorruptCheckpointError, match="header"):
        load(_empty(), checkpoint_id=tmp_path / "b")
    doc = json.loads(json.dumps(original))
    for c in doc["tensors"]["base.w"]["chunks"]:
        c["offset"] += 4  # points between the header's entries; range shifts by 4
    _write(doc, path)
    with pytest.raises(CorruptCheckpointError):
        load(_empty(), checkpoint_id=tmp_path / "b")
    # the base's own file swapped for a symlink, and the sibling directory for one
    _write(original, path)
    load(_empty(), checkpoint_id=tmp_path / "b")
    os.rename(tmp_path / "a", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "a")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        load(_empty(), checkpoint_id=tmp_path / "b")
    os.remove(tmp_path / "a")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load(_empty(), checkpoint_id=tmp_path / "b")
    assert not is_committed(tmp_path / "b")


def test_materialize_makes_a_self_contained_copy(tmp_path, capsys):
    from shardkit.cli._main import main

    save(_state(1), checkpoint_id=tmp_path / "a")
    save(_state(2), checkpoint_id=tmp_path / "b", incremental_base=tmp_path / "a")
    md = materialize(tmp_path / "b", tmp_path / "copy")
    assert not md.linked and md.version == 2
    with pytest.raises(FileExistsError):
        materialize(tmp_path / "b", tmp_path / "copy")
    assert main(["ckpt", "materialize", str(tmp_path / "b"), str(tmp_path / "cli")]) == 0
    os.rename(tmp_path / "copy", tmp_path / "moved")
    for path in ("a",):  # the base is gone: the copies still load
        os.rename(tmp_path / path, tmp_path / f"gone-{path}")
    for path in ("moved", "cli"):
        got = _empty()
        load(got, checkpoint_id=tmp_path / path)
        assert _same(got, _state(2))
        assert main(["ckpt", "verify", "--no-progress", str(tmp_path / path)]) == 0
    capsys.readouterr()


def test_manager_incremental_retention_keeps_referenced_files(tmp_path, capsys):
    from shardkit.cli._main import main

    url = str(tmp_path / "run")
    mgr = CheckpointManager(url, 1, max_to_keep=2, incremental=True, chkpt_on_preemption=False)
    for step in range(1, 6):
        (mgr.save if step % 2 else mgr.save_async)(step, _state(step))
    mgr.join()
    assert mgr.all_steps() == [4, 5]
    for step in (4, 5):
        assert _same(mgr.restore(step, _empty()), _state(step))
    # step 1 wrote the frozen bytes: its directory stays, holding only what is referenced
    left = sorted(n for n in os.listdir(url) if n.startswith("step_"))
    assert left == ["step_00000001", "step_00000004", "step_00000005"]
    kept = set(os.listdir(os.path.join(url, "step_00000001")))
    linked = set(read_metadata(f"{url}/step_00000005").linked)
    assert kept and kept <= linked and "metadata.json" not in kept
    assert main(["ckpt", "ls", url]) == 0
    out = capsys.readouterr().out
    assert "SHARED" in out and "%" in out
    assert main(["ckpt", "inspect", f"{url}/step_00000005"]) == 0
    assert "shared bytes" in capsys.readouterr().out
    mgr.close()
    # the frozen part changes: once no kept step references step 1's files, they go
    mgr = CheckpointManager(url, 1, max_to_keep=2, incremental=True, chkpt_on_preemption=False)
    for step in (6, 7, 8):
        state = _state(step)
        state["base"] = {"w": FROZEN + step, "b": torch.arange(64.0) + step}
        mgr.save(step, state)
    mgr.join()
    assert sorted(n for n in os.listdir(url) if n.startswith("step_")) == [
        "step_00000007",
        "step_00000008",
    ]
    got = mgr.restore(8, _empty())
    assert torch.equal(got["base"]["w"], FROZEN + 8)
    mgr.close()


def test_load_after_any_mix_of_full_and_incremental_steps(tmp_path):
    url = str(tmp_path / "run")
    plan = [True, True, False, True, False, False, True, True]
    want = {}
    for step, incremental in enumerate(plan):
        # a new manager per step toggles the mode, as a restarted run could
        with CheckpointManager(
            url, 1, max_to_keep=4, incremental=incremental, chkpt_on_preemption=False
        ) as mgr:
            state = _state(step % 3)  # some steps repeat earlier values exactly
            state["step"] = step
            want[step] = state
            mgr.save(step, state)
    with CheckpointManager(url, 1, max_to_keep=4, chkpt_on_preemption=False) as mgr:
        steps = mgr.all_steps()
        assert steps == [4, 5, 6, 7]
        for step in steps:
            assert _same(mgr.restore(step, _empty()), want[step])
    assert read_metadata(f"{url}/step_00000007").linked  # incremental on step 6


def _exercise_store(url, storage_options=None, last=4) -> None:
    kw = {"storage_options": storage_options, "chkpt_on_preemption": False}
    mgr = CheckpointManager(url, 1, max_to_keep=2, incremental=True, **kw)
    for step in range(1, last + 1):
        (mgr.save if step % 2 else mgr.save_async)(step, _state(step))
    mgr.join()
    assert mgr.all_steps() == [last - 1, last]
    md = read_metadata(f"{url}/step_{last:08d}", storage_options=storage_options)
    assert {link.dir for link in md.linked.values()} == {"step_00000001"}
    for step in (last - 1, last):
        assert _same(mgr.restore(step, _empty()), _state(step))
    mgr.close()


def test_incremental_on_an_fsspec_memory_store():
    import fsspec

    _exercise_store("memory://incremental-test/run")
    fsspec.filesystem("memory").rm("/incremental-test", recursive=True)


def test_incremental_on_a_loopback_s3_store():
    from s3_server import LoopbackS3

    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        _exercise_store("s3://ckpt/run", s3.storage_options, last=3)  # the server is slow
        fs = s3.filesystem()
        fs.invalidate_cache()
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt/run/step_00000001"))
        assert names and all(n.startswith("data-") for n in names)  # only shared data
