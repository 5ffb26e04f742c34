"""Format conversions on one process: bit-exact round trips through torch.save and
safetensors, import of a torch.distributed.checkpoint checkpoint, and error messages."""

import os
import warnings

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as tdcp
from safetensors import safe_open
from torch import nn

import shardkit.checkpoint as dist_cp
from shardkit.checkpoint import format_utils
from shardkit.checkpoint._convert import _io as _format_utils_io


def _state():
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "0.weight": torch.randn(5, 3, generator=gen),
            "0.bias": torch.randn(5, generator=gen).to(torch.bfloat16),
            "table": torch.randint(-9, 9, (4, 2), generator=gen),
            "half": torch.randn(3, generator=gen).half(),
            "mask": torch.tensor([True, False, True]),
            "bytes": torch.arange(7, dtype=torch.uint8),
            "scalar": torch.tensor(1.25, dtype=torch.float64),
            "empty": torch.empty(0, 4),
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "step": 12,
        "config": {"lr": 0.5, "betas": (0.9, 0.95), "name": "run", "ids": [1, 2]},
    }


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and any(torch.is_tensor(x) for x in v.values()):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _bit_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if torch.is_tensor(a[k]):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(
                a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)
            ), k
        else:
            assert a[k] == b[k], k


class Opaque:
    """A value only pickle can store."""


def _load_flat(checkpoint_id, like):
    target = {k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in like.items()}
    dist_cp.load(target, checkpoint_id=checkpoint_id)
    return target


def test_round_trips_are_bit_exact(tmp_path):
    state = _state()
    flat = _flat(state)
    src = tmp_path / "src"
    dist_cp.save(state, checkpoint_id=src)

    format_utils.dcp_to_torch_save(src, tmp_path / "out.pt", progress=False)
    _bit_equal(torch.load(tmp_path / "out.pt", weights_only=True), flat)
    format_utils.torch_save_to_dcp(tmp_path / "out.pt", tmp_path / "from_pt")
    _bit_equal(_load_flat(tmp_path / "from_pt", flat), flat)

    # streamed one tensor at a time into a file the safetensors library reads
    format_utils.to_safetensors(src, tmp_path / "out.safetensors")
    tensors = safetensors.torch.load_file(tmp_path / "out.safetensors")  # the library reads it
    _bit_equal(tensors, {k: v for k, v in flat.items() if torch.is_tensor(v)})
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    format_utils.from_safetensors(tmp_path / "out.safetensors", tmp_path / "from_st")
    _bit_equal(_load_flat(tmp_path / "from_st", flat), flat)
    assert dist_cp.read_metadata(tmp_path / "from_st").values == {
        "step": 12,
        "config": state["config"],
    }

    # a nested torch.save file (legacy format too) becomes dotted keys
    torch.save(state["model"], tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    format_utils.torch_save_to_dcp(tmp_path / "legacy.pt", tmp_path / "from_legacy")
    _bit_equal(_load_flat(tmp_path / "from_legacy", state["model"]), state["model"])


def test_any_safetensors_file_imports(tmp_path):
    tensors = {"w": torch.randn(3, 3), "odd": torch.arange(3, dtype=torch.int16)}
    safetensors.torch.save_file(tensors, tmp_path / "any.safetensors", metadata={"x": "y"})
    format_utils.from_safetensors(tmp_path / "any.safetensors", tmp_path / "ck")
    _bit_equal(_load_flat(tmp_path / "ck", tensors), tensors)
    assert dist_cp.read_metadata(tmp_path / "ck").values == {}


def test_torch_dcp_checkpoint_imports_and_loads_into_a_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that no process group is initialized
        tdcp.save({"model": model.state_dict(), "epoch": 3}, checkpoint_id=str(tmp_path / "tdcp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        format_utils.import_torch_dcp(tmp_path / "tdcp", tmp_path / "ck", progress=False)
    # torch's "torch.distributed is disabled" warning was passed on, on every rank too
    assert [str(w.message) for w in caught] == []
    fresh = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    state = {"model": fresh.state_dict(), "epoch": 0}
    dist_cp.load(state, checkpoint_id=tmp_path / "ck")
    fresh.load_state_dict(state["model"])
    assert state["epoch"] == 3
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


def test_errors_name_the_missing_paths_and_refuse_pickle(tmp_path):
    missing = tmp_path / "nope"
    for call, args in [
        (format_utils.dcp_to_torch_save, (missing, tmp_path / "x.pt")),
        (format_utils.to_safetensors, (missing, tmp_path / "x.safetensors")),
        (format_utils.torch_save_to_dcp, (missing, tmp_path / "ck")),
        (format_utils.from_safetensors, (missing, tmp_path / "ck")),
        (format_utils.import_torch_dcp, (missing, tmp_path / "ck")),
    ]:
        with pytest.raises(FileNotFoundError, match=str(missing)):
            call(*args)
    assert not os.path.exists(tmp_path / "ck")

    dist_cp.save(
        {"w": torch.ones(2), "obj": Opaque()},
        checkpoint_id=tmp_path / "pickled",
        planner=dist_cp.DefaultSavePlanner(allow_pickle=True),
    )
    with pytest.raises(ValueError, match=r"\['obj'\].*allow_pickle"):
        format_utils.dcp_to_torch_save(tmp_path / "pickled", tmp_path / "p.pt")
    with pytest.raises(ValueError, match=r"\['obj'\]"):
        format_utils.to_safetensors(tmp_path / "pickled", tmp_path / "p.safetensors")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(TypeError, match="list"):
        format_utils.torch_save_to_dcp(tmp_path / "list.pt", tmp_path / "ck")
    with pytest.raises(TypeError, match="progress"):
        format_utils.to_safetensors(tmp_path / "pickled", tmp_path / "q", progress="yes")


def test_streaming_reads_reuse_one_buffer(tmp_path):
    state = {f"t{i}": torch.full((3, i + 1), float(i), dtype=torch.float64) for i in range(4)}
    state["small"] = torch.arange(5, dtype=torch.int8)
    dist_cp.save(state, checkpoint_id=tmp_path / "ck")
    metadata, reader = _format_utils_io.checkpoint_metadata(tmp_path / "ck")
    pointers, seen = set(), {}
    for batch in _format_utils_io.read_full(reader, metadata, list(metadata.tensors), reuse=True):
        ((key, tensor),) = batch.items()
        pointers.add(tensor.untyped_storage().data_ptr())
        seen[key] = tensor.clone()
    assert len(pointers) == 1  # every tensor lived in the same buffer
    _bit_equal(seen, state)


def test_conversions_work_over_fsspec_urls():
    state = {"a": torch.arange(6.0).reshape(2, 3), "v": [1, 2]}
    base = "memory://format-utils-test"
    dist_cp.save(state, checkpoint_id=f"{base}/ck")
    format_utils.to_safetensors(f"{base}/ck", f"{base}/x.safetensors")
    format_utils.from_safetensors(f"{base}/x.safetensors", f"{base}/ck2")
    format_utils.dcp_to_torch_save(f"{base}/ck2", f"{base}/x.pt")
    format_utils.torch_save_to_dcp(f"{base}/x.pt", f"{base}/ck3")
    _bit_equal(_load_flat(f"{base}/ck3", state), state)
    with pytest.raises(ValueError, match="local directories only"):
        format_utils.import_torch_dcp(f"{base}/ck", f"{base}/ck4")
