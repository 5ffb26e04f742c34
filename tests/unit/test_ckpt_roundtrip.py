"""Single-process checkpoint round trips: dtypes, shapes, containers, values, storage, async."""

import json
import math
import os

import pytest
import torch
from safetensors import safe_open

import shardkit.checkpoint as dcp
from shardkit.checkpoint._core import _format, _save
from shardkit.spmd.layout import Box

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _make(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def _state(seed=0):
    sd = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        sd[name] = {
            "m": _make(dtype, (5, 7), seed + i),
            "scalar": _make(dtype, (), seed + 50 + i),
            "empty": _make(dtype, (0, 3), seed),
        }
    sd["nested"] = {
        "list": [torch.arange(4), {"deep": torch.ones(2, 2, 2)}, 7, "x"],
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "ids": {0: "a", 1: "b"}, "none": None},
        "inf": float("inf"),
    }
    sd["step"] = 12
    return sd


def _zeros_like_state(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: _zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeros_like_state(v) for v in sd]
    return None


def _assert_same(a, b, key=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key
    elif isinstance(a, dict):
        assert set(a) == set(b), key
        for k in a:
            _assert_same(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{key}.{i}")
    else:
        assert a == b and type(a) is type(b), (key, a, b)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_dtype_shape_and_container_round_trips(tmp_path, where):
    path = str(tmp_path / "ck") if where == "local" else "memory://ckpt-roundtrip"
    sd = _state()
    md = dcp.save(sd, checkpoint_id=path)
    assert dcp.is_committed(path)
    target = _zeros_like_state(sd)
    dcp.load(target, checkpoint_id=path)
    _assert_same(sd, target)
    again = dcp.read_metadata(path)
    assert again.save_id == md.save_id and again.keys() == md.keys()
    assert again.tensors["bfloat16.m"].dtype == torch.bfloat16
    assert again.values["nested.cfg"]["betas"] == (0.9, 0.99)


def test_files_are_standard_safetensors_and_metadata_is_json(tmp_path):
    sd = {"w": torch.randn(4, 6), "b": torch.arange(3, dtype=torch.int16), "flag": True}
    md = dcp.save(sd, checkpoint_id=tmp_path)
    doc = json.loads((tmp_path / "metadata.json").read_bytes())
    assert doc["format"] == "shardkit.checkpoint" and doc["version"] == 2
    assert doc["values"] == {"flag": True}
    for key, t in md.tensors.items():
        for chunk in t.chunks:
            with safe_open(str(tmp_path / chunk.file), "pt") as f:
                got = f.get_tensor(chunk.name)
            assert torch.equal(got, sd[key])
            raw = (tmp_path / chunk.file).read_bytes()[chunk.offset : chunk.offset + chunk.nbytes]
            assert raw == sd[key].numpy().tobytes()


def test_load_replaces_json_values_and_calls_stateful(tmp_path):
    class Counter:
        def __init__(self, n):
            self.n, self.t = n, torch.full((3,), float(n))

        def state_dict(self):
            return {"n": self.n, "t": self.t}

        def load_state_dict(self, sd):
            self.n = sd["n"]
            self.t = sd["t"]

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd = {"counter": Counter(4), "model": model, "optim": opt, "hist": [1, 2, 3]}
    assert isinstance(sd["counter"], dcp.Stateful)
    dcp.save(sd, checkpoint_id=tmp_path)

    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    model2(torch.randn(4, 3)).sum().backward()
    opt2.step()  # creates momentum buffers to load into
    target = {"counter": Counter(0), "model": model2, "optim": opt2, "hist": []}
    dcp.load(target, checkpoint_id=tmp_path)
    assert target["counter"].n == 4 and torch.equal(target["counter"].t, torch.full((3,), 4.0))
    assert target["hist"] == [1, 2, 3]
    assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
    assert opt2.param_groups[0]["lr"] == 0.5
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[q]["momentum_buffer"])


def test_partial_reads_touch_only_overlapping_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(_format, "BLOCK_BYTES", 1024)  # 16 rows of 16 floats per block
    full = torch.randn(256, 16)
    dcp.save({"w": full}, checkpoint_id=tmp_path)
    reads = []

    class Counting(dcp.FileSystemReader):
        def read_into(self, name, offset, out):
            reads.append((offset, len(memoryview(out).cast("B"))))
            super().read_into(name, offset, out)

    class SlicePlanner(dcp.DefaultLoadPlanner):
        """Requests rows 40..49, cols 4..11 of the saved (256, 16) tensor, as a shard would."""

        def set_up_planner(self, flat, metadata, *, strict):
            leaf = flat.tensors["w"]
            leaf.shape, leaf.box = (256, 16), Box((40, 4), (10, 8))
            super().set_up_planner(flat, metadata, strict=strict)

    dest = torch.zeros(10, 8)
    sd = {"w": dest}
    dcp.load(sd, storage_reader=Counting(tmp_path), planner=SlicePlanner())
    assert torch.equal(dest, full[40:50, 4:12])
    # rows 40..49 lie in blocks 2 and 3 (rows 32..63): 32 rows of 64 bytes, not 256 rows,
    # plus the file's safetensors header, checked against the metadata
    header = [n for offset, n in reads if offset == 0]
    assert len(header) == 1 and header[0] < 256
    assert sum(n for offset, n in reads if offset) == 32 * 64


def test_global_plan_writes_replicated_bytes_once_and_evenly():
    planner = dcp.DefaultSavePlanner()
    shape, dtype = (4096, 256), torch.float32  # 4 MiB: cut into 1 MiB pieces
    items = [
        dcp.WriteItem("rep", Box.full(shape), shape, dtype),
        dcp.WriteItem("small", Box.full((10,)), (10,), dtype),
    ]
    plans = [dcp.SavePlan(list(items)) for _ in range(4)]
    plans[0].items.append(dcp.WriteItem("shard", Box((0,), (8,)), (16,), dtype))
    plans[3].items.append(dcp.WriteItem("shard", Box((8,), (8,)), (16,), dtype))
    out = planner.create_global_plan(plans)
    per_rank = [sum(i.nbytes for i in p.items) for p in out]
    total = math.prod(shape) * 4 + 40 + 64
    assert sum(per_rank) == total  # every byte written exactly once
    assert max(per_rank) - min(per_rank) <= 64  # only the small items differ
    covered = sorted((i.box.offsets, i.box.sizes) for p in out for i in p.items if i.key == "rep")
    assert sum(math.prod(s) for _, s in covered) == math.prod(shape)
    assert out == planner.create_global_plan(plans)  # deterministic on every rank


def test_global_plan_rejects_inconsistent_ranks():
    planner = dcp.DefaultSavePlanner()
    a = dcp.SavePlan([dcp.WriteItem("w", Box.full((4,)), (4,), torch.float32)])
    b = dcp.SavePlan([dcp.WriteItem("w", Box.full((5,)), (5,), torch.float32)])
    with pytest.raises(ValueError, match=r"'w'.*rank 0.*rank 1"):
        planner.create_global_plan([a, b])
    gap = dcp.SavePlan([dcp.WriteItem("s", Box((0,), (2,)), (4,), torch.float32)])
    with pytest.raises(ValueError, match=r"'s'.*cover 2 elements of 4"):
        planner.create_global_plan([gap])

    # rank 0 shards rows, rank 1 columns (a spec that differs per rank): the overlap and
    # the gap cancel in the element count, and the load called the checkpoint corrupt
    rows = dcp.SavePlan([dcp.WriteItem("m", Box((0, 0), (2, 4)), (4, 4), torch.float32)])
    cols = dcp.SavePlan([dcp.WriteItem("m", Box((0, 2), (4, 2)), (4, 4), torch.float32)])
    with pytest.raises(ValueError, match=r"'m'.*\[0, 0\] and \[0, 2\] overlap.*ranks \[0, 1\]"):
        planner.create_global_plan([rows, cols])


def test_async_save_round_trip_and_buffer_reuse(tmp_path):
    from shardkit.checkpoint._core import _async

    sd = {"a": torch.randn(64, 64), "b": torch.arange(100), "step": 1}
    fut = dcp.async_save(sd, checkpoint_id=tmp_path / "one")
    buf = _async._pool.buf
    expected = sd["a"].clone()
    sd["a"].add_(1.0)  # mutating right after staging must not leak into the checkpoint
    fut2 = dcp.async_save(sd, checkpoint_id=tmp_path / "two")  # waits for the first
    assert fut.done()
    md = fut2.result(timeout=60)
    assert md.values == {"step": 1}
    assert _async._pool.buf is buf  # staging buffer reused, not reallocated
    target = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.int64), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path / "one")
    assert torch.equal(target["a"], expected) and torch.equal(target["b"], sd["b"])
    dcp.load(target, checkpoint_id=tmp_path / "two")
    assert torch.equal(target["a"], sd["a"])


def test_async_save_errors_come_through_the_future(tmp_path):
    fut = dcp.async_save({"bad": object()}, checkpoint_id=tmp_path)
    with pytest.raises(TypeError, match="'bad'"):
        fut.result(timeout=30)
    assert not dcp.is_committed(tmp_path)


def test_save_overwrite_replaces_files_and_old_stays_until_commit(tmp_path):
    dcp.save({"w": torch.ones(8)}, checkpoint_id=tmp_path)
    old_files = set(os.listdir(tmp_path))

    class FailingCommit(dcp.FileSystemWriter):
        def commit(self, metadata):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        dcp.save({"w": torch.zeros(8)}, storage_writer=FailingCommit(tmp_path))
    target = {"w": torch.empty(8)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], torch.ones(8))
    dcp.save({"w": torch.full((8,), 2.0)}, checkpoint_id=tmp_path)
    _save.join_cleanups()  # superseded files are deleted in the background
    new_files = set(os.listdir(tmp_path))
    assert not (new_files & old_files) - {"metadata.json"}  # old and orphaned files removed
    assert len(new_files) == 2
    dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], torch.full((8,), 2.0))


def test_save_waits_for_an_async_save_into_the_same_directory(tmp_path):
    big = {"w": torch.randn(256, 1024)}
    fut = dcp.async_save(big, checkpoint_id=tmp_path)
    dcp.save({"w": torch.zeros(256, 1024)}, checkpoint_id=tmp_path)  # must not delete its files
    assert fut.done() and fut.exception() is None
    assert dcp.is_committed(tmp_path)
    target = {"w": torch.ones(256, 1024)}
    dcp.load(target, checkpoint_id=tmp_path)
    assert target["w"].eq(0).all()
    _save.join_cleanups()  # superseded files are deleted in the background
    assert len(os.listdir(tmp_path)) == 2  # the async save's files were cleaned up after


def test_s3_round_trip_and_overwrite():
    from s3_server import LoopbackS3

    with LoopbackS3() as s3:
        s3.make_bucket("ckpt-core")
        opts = s3.storage_options
        url = "s3://ckpt-core/run/step1"
        sd = {"w": torch.randn(300, 70), "i": torch.arange(5), "meta": {"epoch": 2}}
        for value in (1.0, 2.0):
            sd["w"].fill_(value)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(url, storage_options=opts))
        assert dcp.is_committed(url, storage_options=opts)
        _save.join_cleanups()  # superseded files are deleted in the background
        assert len(s3.filesystem().ls("ckpt-core/run/step1")) == 2  # superseded files removed
        target = {"w": torch.zeros(300, 70), "i": torch.zeros(5, dtype=torch.int64), "meta": None}
        dcp.load(target, storage_reader=dcp.FileSystemReader(url, storage_options=opts))
        assert target["w"].eq(2.0).all() and target["meta"] == {"epoch": 2}
        assert dcp.read_metadata(url, storage_options=opts).values == {"meta": {"epoch": 2}}


class _DictStore:
    """A user-written store: both protocols over a dict of bytes."""

    thread_count = 1

    def __init__(self):
        self.files = {}

    def write_file(self, name, parts):
        self.files[name] = b"".join(bytes(p) for p in parts)

    def commit(self, metadata):
        self.files["metadata.json"] = bytes(metadata)

    def list_files(self):
        return sorted(self.files)

    def remove_files(self, names):
        for n in names:
            self.files.pop(n, None)

    def read_metadata(self):
        if "metadata.json" not in self.files:
            raise FileNotFoundError("metadata.json")
        return self.files["metadata.json"]

    def file_size(self, name):
        if name not in self.files:
            raise FileNotFoundError(name)
        return len(self.files[name])

    def read_into(self, name, offset, out):
        data = self.files[name][offset : offset + len(out)]
        if len(data) != len(out):
            raise EOFError(name)
        memoryview(out).cast("B")[:] = data


def test_user_written_storage_gets_checksums_and_commit():
    store = _DictStore()
    assert isinstance(store, dcp.StorageWriter) and isinstance(store, dcp.StorageReader)
    sd = {"w": torch.randn(33, 5), "k": [1, 2]}
    dcp.save(sd, storage_writer=store)
    dcp.save(sd, storage_writer=store)  # the first save's data file is superseded
    _save.join_cleanups()  # superseded files are deleted in the background
    assert len(store.files) == 2
    target = {"w": torch.zeros(33, 5), "k": None}
    dcp.load(target, storage_reader=store)
    assert torch.equal(target["w"], sd["w"]) and target["k"] == [1, 2]
    name = next(n for n in store.files if n.startswith("data-"))
    raw = bytearray(store.files[name])
    raw[-1] ^= 1
    store.files[name] = bytes(raw)
    with pytest.raises(dcp.CorruptCheckpointError, match=f"checksum mismatch.*'w'.*{name}"):
        dcp.load(target, storage_reader=store)


def test_row_slice_starting_mid_block_mixes_scratch_and_direct_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(_format, "BLOCK_BYTES", 64)  # 4 rows of 4 floats per block
    full = torch.arange(40.0).reshape(10, 4)
    dcp.save({"w": full}, checkpoint_id=tmp_path)

    class RowsPlanner(dcp.DefaultLoadPlanner):
        def set_up_planner(self, flat, metadata, *, strict):
            leaf = flat.tensors["w"]
            leaf.shape, leaf.box = (10, 4), Box((2, 0), (7, 4))  # rows 2..8: mid-block to mid-block
            super().set_up_planner(flat, metadata, strict=strict)

    dest = torch.zeros(7, 4)
    dcp.load({"w": dest}, checkpoint_id=tmp_path, planner=RowsPlanner())
    assert torch.equal(dest, full[2:9])


def test_thread_count_writes_several_files_and_reads_in_parallel(tmp_path):
    sd = {f"t{i}": torch.randn(64, 33) for i in range(7)}
    md = dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=3))
    assert len([f for f in md.files if f.startswith("data-")]) == 3
    target = {k: torch.zeros(64, 33) for k in sd}
    dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path, thread_count=3))
    for k in sd:
        assert torch.equal(target[k], sd[k]), k


def test_format_spec_is_enough_to_read_without_shardkit(tmp_path, monkeypatch):
    """Reassemble tensors from metadata.json and raw bytes as docs/checkpoint-format.md says."""
    import numpy as np
    import xxhash

    monkeypatch.setattr(_format, "BLOCK_BYTES", 256)

    class RowHalves(dcp.DefaultSavePlanner):
        def create_global_plan(self, plans):
            out = super().create_global_plan(plans)
            for plan in out:
                plan.items[:] = [
                    dcp.WriteItem(i.key, b, i.shape, i.dtype)
                    for i in plan.items
                    for b in ([i.box] if not i.box.ndim else _save_halves(i.box))
                ]
            return out

    sd = {"w": torch.randn(9, 7, dtype=torch.float64), "s": torch.tensor(3, dtype=torch.int16)}
    sd["cfg"] = {"betas": (0.9, 0.99), "nan": float("nan")}
    dcp.save(sd, checkpoint_id=tmp_path, planner=RowHalves())

    doc = json.loads((tmp_path / "metadata.json").read_text())
    assert doc["format"] == "shardkit.checkpoint" and doc["version"] == 2
    np_dtypes = {"float64": np.float64, "int16": np.int16}
    for key, t in doc["tensors"].items():
        out = np.zeros(t["shape"], dtype=np_dtypes[t["dtype"]])
        for c in t["chunks"]:
            raw = (tmp_path / c["file"]).read_bytes()
            assert len(raw) == doc["files"][c["file"]]
            data = raw[c["offset"] : c["offset"] + c["nbytes"]]
            rows = c["sizes"][0] if c["sizes"] else 1
            row = c["nbytes"] // rows if rows else 0
            block = max(1, c["block_rows"] * row)
            sums = [
                xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, len(data), block)
            ]
            assert sums == c["xxh3_64"]
            piece = np.frombuffer(data, dtype=out.dtype).reshape(c["sizes"])
            out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))] = piece
        assert torch.equal(torch.from_numpy(out), sd[key]), key
    assert len(doc["tensors"]["w"]["chunks"]) == 2
    assert doc["values"]["cfg"] == {
        "betas": {"__shardkit__": "tuple", "items": [0.9, 0.99]},
        "nan": {"__shardkit__": "float", "repr": "nan"},
    }


def _save_halves(box):
    half = box.sizes[0] // 2
    return [
        Box(box.offsets, (half, *box.sizes[1:])),
        Box((box.offsets[0] + half, *box.offsets[1:]), (box.sizes[0] - half, *box.sizes[1:])),
    ]


@pytest.mark.parametrize("entry", ["tuple", "tensor_saved", "pickled"])
def test_a_refused_entry_leaves_the_state_dict_untouched(tmp_path, entry):
    """Entries that cannot take what was saved are found before any byte is read."""
    saved = {"w": torch.ones(4), "pair": [torch.ones(2), 6], "t": torch.ones(1), "o": {1, 2}}
    dcp.save(saved, checkpoint_id=tmp_path, planner=dcp.DefaultSavePlanner(allow_pickle=True))
    target = {"w": torch.zeros(4), "pair": [torch.zeros(2), 0], "t": torch.zeros(1), "o": None}
    if entry != "pickled":
        del target["o"]  # a checkpoint's extra key is not loaded
    if entry == "tuple":
        target["pair"] = (torch.zeros(2), 0)
        words = r"'pair.1' sits in a tuple"
    elif entry == "tensor_saved":
        target["t"] = 0
        words = r"'t' is a non-tensor value in the state dict but a tensor"
    else:
        words = r"'o' was saved with pickle"
    with pytest.raises((TypeError, dcp.CheckpointError), match=words):
        dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], torch.zeros(4))
    assert torch.equal(target["pair"][0], torch.zeros(2))


def test_keys_that_differ_by_a_wrappers_names_say_so(tmp_path):
    """A checkpoint of a DDP/FSDP model's own state_dict() ('module.' keys) loaded into a
    plain model: the error names the pair and get_model_state_dict, not just the keys."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    wrapped = {f"module.{k}": v for k, v in model.state_dict().items()}
    dcp.save({"model": wrapped}, checkpoint_id=tmp_path / "w")
    with pytest.raises(dcp.StateDictMismatchError) as info:
        dcp.load({"model": model.state_dict()}, checkpoint_id=tmp_path / "w")
    message = str(info.value)
    assert "holds 'model.module.0.bias' where 'model.0.bias' is wanted" in message
    assert "get_model_state_dict" in message
    with pytest.raises(dcp.StateDictMismatchError) as info:  # a truly missing key: no hint
        dcp.load({"model": {"other": torch.zeros(1)}}, checkpoint_id=tmp_path / "w")
    assert "wrapper" not in str(info.value) and "'model.other'" in str(info.value)
