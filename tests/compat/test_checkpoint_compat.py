"""shardkit.checkpoint against torch.distributed.checkpoint (torch 2.13) as the oracle.

Each case runs the same scenario through torch's DCP and through shardkit, in one process
(torch with ``no_dist=True``) or in the same 2-rank run, and compares values, key sets,
dtypes, devices and exception classes. torch wraps planning errors in its
``CheckpointException`` (a BaseException); the oracle for our class is the exception it
wraps (docs/migrating.md). Every case has a hard time limit, so a hang fails.
"""

import dataclasses
import importlib
import inspect
import warnings

import pytest
import torch
import torch.distributed.checkpoint as tdcp
from column_planner import ColumnPlanner
from harness import run_ranks

import shardkit.checkpoint as dcp

pytestmark = pytest.mark.timeout(120)


def _sd(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
        "optim": {"state": {"w": {"exp_avg": torch.randn(6, 4, generator=g)}}, "lr": 0.5},
        "step": 7,
    }


def _both_saved(tmp_path, sd=None):
    sd = _sd() if sd is None else sd
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "assuming the intent is to save in a single..."
        tdcp.save(sd, checkpoint_id=tmp_path / "torch", no_dist=True)
    dcp.save(sd, checkpoint_id=tmp_path / "sk")
    return tmp_path / "torch", tmp_path / "sk"


def _torch_load(sd, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.load(sd, checkpoint_id=path, no_dist=True, **kw)


def _torch_failure(fn):
    """The exception torch's ``CheckpointException`` wraps (or the one raised directly)."""
    try:
        fn()
    except tdcp.CheckpointException as exc:
        return next(iter(exc.failures.values()))[0]
    except Exception as exc:  # noqa: BLE001 - the oracle's class is what we compare
        return exc
    raise AssertionError("torch raised nothing")


def _fresh():
    return {
        "model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)},
        "optim": {"state": {"w": {"exp_avg": torch.zeros(6, 4)}}, "lr": 0.0},
        "step": 0,
    }


def _equal(a, b):
    assert type(a) is type(b) or (torch.is_tensor(a) and torch.is_tensor(b)), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif torch.is_tensor(a):
        assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
        assert torch.equal(a, b)
    else:
        assert a == b


# -- load semantics ------------------------------------------------------------------


def test_full_round_trip_matches_torch(tmp_path):
    tpath, spath = _both_saved(tmp_path)
    ours, theirs = _fresh(), _fresh()
    _torch_load(theirs, tpath)
    dcp.load(ours, checkpoint_id=spath)
    _equal(ours, theirs)
    _equal(ours, _sd())


def test_loading_only_the_model_of_a_model_and_optimizer_checkpoint(tmp_path):
    tpath, spath = _both_saved(tmp_path)
    ours, theirs = {"model": _fresh()["model"]}, {"model": _fresh()["model"]}
    _torch_load(theirs, tpath)
    dcp.load(ours, checkpoint_id=spath)  # the checkpoint's extra keys are ignored
    _equal(ours, theirs)
    assert ours.keys() == {"model"}


def test_missing_key_raises_what_torch_wraps(tmp_path):
    tpath, spath = _both_saved(tmp_path)
    wanted = {"model": {"w": torch.zeros(6, 4), "extra": torch.zeros(2)}}
    oracle = _torch_failure(lambda: _torch_load(wanted, tpath))
    with pytest.raises(type(oracle), match=r"Missing key.*model\.extra"):
        dcp.load(wanted, checkpoint_id=spath)
    with pytest.raises(ValueError):  # and shardkit's earlier class
        dcp.load(wanted, checkpoint_id=spath)


def test_allow_partial_load_leaves_missing_keys_as_torch(tmp_path):
    tpath, spath = _both_saved(tmp_path)
    ours = {"model": {"w": torch.zeros(6, 4), "extra": torch.full((2,), 3.0)}}
    theirs = {"model": {"w": torch.zeros(6, 4), "extra": torch.full((2,), 3.0)}}
    _torch_load(theirs, tpath, planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    dcp.load(ours, checkpoint_id=spath, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    _equal(ours, theirs)


def test_shape_mismatch_raises_what_torch_wraps(tmp_path):
    tpath, spath = _both_saved(tmp_path)
    oracle = _torch_failure(lambda: _torch_load({"model": {"w": torch.zeros(6, 5)}}, tpath))
    with pytest.raises(type(oracle), match=r"'model\.w'.*\[6, 4\].*\[6, 5\]"):
        dcp.load({"model": {"w": torch.zeros(6, 5)}}, checkpoint_id=spath)
    with pytest.raises(RuntimeError):
        dcp.load({"model": {"w": torch.zeros(6, 5)}}, checkpoint_id=spath)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_is_cast_as_torch(tmp_path, dtype):
    tpath, spath = _both_saved(tmp_path)
    ours = {"model": {"w": torch.zeros(6, 4, dtype=dtype), "b": torch.zeros(4, dtype=dtype)}}
    theirs = {"model": {"w": torch.zeros(6, 4, dtype=dtype), "b": torch.zeros(4, dtype=dtype)}}
    _torch_load(theirs, tpath)
    dcp.load(ours, checkpoint_id=spath)
    _equal(ours, theirs)
    with pytest.raises(TypeError, match="strict_dtype"):  # shardkit's documented opt-in
        dcp.load(ours, checkpoint_id=spath, planner=dcp.DefaultLoadPlanner(strict_dtype=True))


def test_cast_through_the_band_reader_and_reshard(tmp_path):
    full = torch.randn(32, 24, dtype=torch.float64)
    dcp.save({"w": full}, checkpoint_id=tmp_path, planner=ColumnPlanner([5, 7]))
    for dtype in (torch.float32, torch.bfloat16):
        out = {"w": torch.zeros(32, 24, dtype=dtype)}
        dcp.load(out, checkpoint_id=tmp_path)
        assert torch.equal(out["w"], full.to(dtype))
        strided = {"w": torch.zeros(24, 32, dtype=dtype).t()}  # not contiguous
        dcp.load(strided, checkpoint_id=tmp_path)
        assert torch.equal(strided["w"], full.to(dtype))
    # same dtype straight into place still reads exactly
    out = {"w": torch.zeros(32, 24, dtype=torch.float64)}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["w"], full)


def test_cast_in_row_bands_bounds_the_scratch(tmp_path, monkeypatch):
    import shardkit.checkpoint._core._load as load_mod

    monkeypatch.setattr(load_mod, "_CAST_PIECE_BYTES", 3 * 24 * 8)  # 3 saved rows a band
    full = torch.randn(32, 24, dtype=torch.float64)
    tdcp.save({"w": full}, checkpoint_id=tmp_path / "t", no_dist=True)
    dcp.save({"w": full}, checkpoint_id=tmp_path / "s", planner=ColumnPlanner([5, 7]))
    theirs = {"w": torch.zeros(32, 24, dtype=torch.bfloat16)}
    _torch_load(theirs, tmp_path / "t")
    ours = {"w": torch.zeros(32, 24, dtype=torch.bfloat16)}
    dcp.load(ours, checkpoint_id=tmp_path / "s")
    _equal(ours, theirs)


def test_strict_opt_in_refuses_extra_checkpoint_keys(tmp_path):
    _, spath = _both_saved(tmp_path)
    with pytest.raises(dcp.StateDictMismatchError, match=r"unexpected.*optim\.lr"):
        dcp.load({"model": _fresh()["model"]}, checkpoint_id=spath, strict=True)
    with pytest.raises(RuntimeError, match=r"unexpected.*'step'"):
        dcp.load(
            {"model": _fresh()["model"]},
            checkpoint_id=spath,
            planner=dcp.DefaultLoadPlanner(strict=True),
        )


class _Counter:
    def __init__(self, n=0):
        self.n, self.loaded = n, []

    def state_dict(self):
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd):
        self.loaded.append(int(sd["n"]))
        self.n = int(sd["n"])


def test_stateful_objects_load_in_place_as_torch(tmp_path):
    tdcp.save({"c": _Counter(5), "x": 1}, checkpoint_id=tmp_path / "t", no_dist=True)
    dcp.save({"c": _Counter(5), "x": 1}, checkpoint_id=tmp_path / "s")
    theirs, ours = {"c": _Counter(), "x": 0}, {"c": _Counter(), "x": 0}
    _torch_load(theirs, tmp_path / "t")
    dcp.load(ours, checkpoint_id=tmp_path / "s")
    assert ours["c"].loaded == theirs["c"].loaded == [5]
    assert ours["x"] == theirs["x"] == 1


def test_no_dist_and_deprecated_aliases(tmp_path):
    sd = _sd()
    with pytest.warns(FutureWarning):
        tdcp.save_state_dict(sd, tdcp.FileSystemWriter(tmp_path / "t"), no_dist=True)
    with pytest.warns(FutureWarning):
        dcp.save_state_dict(sd, dcp.FileSystemWriter(tmp_path / "s"), no_dist=True)
    theirs, ours = _fresh(), _fresh()
    with pytest.warns(FutureWarning):
        tdcp.load_state_dict(theirs, tdcp.FileSystemReader(tmp_path / "t"), no_dist=True)
    with pytest.warns(FutureWarning):
        dcp.load_state_dict(ours, dcp.FileSystemReader(tmp_path / "s"), no_dist=True)
    _equal(ours, theirs)
    dcp.save(sd, checkpoint_id=tmp_path / "n", no_dist=True)
    again = _fresh()
    dcp.load(again, checkpoint_id=tmp_path / "n", no_dist=True)
    _equal(again, theirs)


def test_torch_dcp_directory_points_to_the_import(tmp_path):
    sd = _sd()
    tdcp.save(sd, checkpoint_id=tmp_path / "t", no_dist=True)
    with pytest.raises(
        dcp.CheckpointError, match=r"torch.distributed.checkpoint.*import_torch_dcp"
    ):
        dcp.load(_fresh(), checkpoint_id=tmp_path / "t")
    from shardkit.checkpoint.format_utils import import_torch_dcp

    import_torch_dcp(tmp_path / "t", tmp_path / "s", progress=False)
    ours, theirs = _fresh(), _fresh()
    dcp.load(ours, checkpoint_id=tmp_path / "s")
    _torch_load(theirs, tmp_path / "t")
    _equal(ours, theirs)


# -- spellings -----------------------------------------------------------------------

_TORCH_ONLY_NAMES = {
    # torch names with no shardkit counterpart, each a documented difference
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorStorageMetadata",
    "CheckpointException", "HuggingFaceStorageReader", "HuggingFaceStorageWriter",
    "QuantizedHuggingFaceStorageReader", "load_sharded_optimizer_state_dict",
    "CheckpointableTensor",  # torch 2.14; refused by name (docs/migrating.md, torch versions)
}  # fmt: skip
_SUBMODULES = {  # torch submodule -> the torch names it must hold in shardkit too
    "stateful": ["Stateful"],
    "default_planner": ["DefaultLoadPlanner", "DefaultSavePlanner"],
    "filesystem": ["FileSystemReader", "FileSystemWriter"],
    "state_dict_saver": ["save", "async_save", "save_state_dict"],
    "state_dict_loader": ["load", "load_state_dict"],
    "planner": ["LoadPlan", "LoadPlanner", "ReadItem", "SavePlan", "SavePlanner", "WriteItem"],
    "storage": ["StorageReader", "StorageWriter"],
    "metadata": ["Metadata"],
    "state_dict": [
        "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
        "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
    ],
    "format_utils": ["dcp_to_torch_save", "torch_save_to_dcp"],
}  # fmt: skip


def test_top_level_names_mirror_torch():
    theirs = {
        n for n in dir(tdcp)
        if not n.startswith("_") and not inspect.ismodule(getattr(tdcp, n)) and n != "logger"
    } - _TORCH_ONLY_NAMES  # fmt: skip
    missing = sorted(n for n in theirs if not hasattr(dcp, n))
    assert missing == []


@pytest.mark.parametrize("name", sorted(_SUBMODULES))
def test_submodules_mirror_torch(name):
    ours = importlib.import_module(f"shardkit.checkpoint.{name}")
    theirs = importlib.import_module(f"torch.distributed.checkpoint.{name}")
    for public in _SUBMODULES[name]:
        assert hasattr(theirs, public), f"torch has no {name}.{public}"
        assert public in ours.__all__, f"shardkit.checkpoint.{name} lacks {public}"
        # one object whichever path imports it
        assert getattr(dcp, public, getattr(ours, public)) is getattr(ours, public)


def _torch_keywords(cls):
    sig = inspect.signature(cls.__init__)
    return {
        p.name: p.default
        for p in list(sig.parameters.values())[1:]
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is not p.empty
    }


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (dcp.DefaultLoadPlanner, tdcp.DefaultLoadPlanner),
        (dcp.DefaultSavePlanner, tdcp.DefaultSavePlanner),
    ],
)
def test_planner_keywords_accepted_with_torch_defaults(ours, theirs):
    kwargs = _torch_keywords(theirs)
    assert kwargs, "torch's planner has keywords"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's defaults never warn
        planner = ours(**kwargs)
    assert isinstance(planner, dcp.LoadPlanner if "Load" in ours.__name__ else dcp.SavePlanner)


def test_planner_keywords_without_meaning_warn_once():
    with pytest.warns(UserWarning, match="enable_plan_caching"):
        dcp.DefaultSavePlanner(enable_plan_caching=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcp.DefaultSavePlanner(enable_plan_caching=True)  # once per process


def test_dedup_save_to_lowest_rank_honoured():
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    item = dcp.WriteItem.from_json(["w", [0], [4 << 20], [4 << 20], "float32"])
    plans = [dcp.SavePlan([item]), dcp.SavePlan([item])]  # 16 MiB replicated on 2 ranks
    out = planner.create_global_plan(plans)
    assert len(out[0].items) > 0 and out[1].items == []
    spread = dcp.DefaultSavePlanner().create_global_plan(plans)
    assert all(p.items for p in spread)  # the default spreads the bytes over both


def test_filesystem_writer_accepts_torch_options(tmp_path):
    kwargs = _torch_keywords(tdcp.FileSystemWriter)
    kwargs = {k: v for k, v in kwargs.items() if k != "serialization_format"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writer = dcp.FileSystemWriter(tmp_path / "a", **kwargs)
    dcp.save({"x": torch.ones(2)}, storage_writer=writer)
    with pytest.warns(UserWarning, match="single_file_per_rank"):
        dcp.FileSystemWriter(tmp_path / "b", single_file_per_rank=False)
    writer = dcp.FileSystemWriter(tmp_path / "c", thread_count=2, sync_files=False)
    dcp.save({"x": torch.ones(2), "y": torch.zeros(3)}, storage_writer=writer)
    out = {"x": torch.zeros(2), "y": torch.ones(3)}
    dcp.load(out, checkpoint_id=tmp_path / "c")
    assert out["x"].eq(1).all() and out["y"].eq(0).all()


def test_overwrite_false_refuses_as_torch(tmp_path):
    tdcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "t", no_dist=True)
    oracle = _torch_failure(
        lambda: tdcp.save(
            {"x": torch.ones(2)},
            storage_writer=tdcp.FileSystemWriter(tmp_path / "t", overwrite=False),
            no_dist=True,
        )
    )
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "s")
    with pytest.raises(type(oracle), match="overwrite=False"):
        dcp.save(
            {"x": torch.zeros(2)},
            storage_writer=dcp.FileSystemWriter(tmp_path / "s", overwrite=False),
        )
    out = {"x": torch.zeros(2)}
    dcp.load(out, checkpoint_id=tmp_path / "s")
    assert out["x"].eq(1).all()  # the refused save changed nothing
    dcp.save({"x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "new",
                                                                        overwrite=False))  # fmt: skip


def test_save_and_load_keywords_cover_torch():
    for ours, theirs in [
        (dcp.save, tdcp.save),
        (dcp.load, tdcp.load),
        (dcp.async_save, tdcp.async_save),
    ]:
        missing = set(inspect.signature(theirs).parameters) - set(
            inspect.signature(ours).parameters
        )
        assert missing == set(), (ours.__name__, missing)


def test_metadata_is_a_dataclass_and_stateful_a_protocol():
    assert dataclasses.is_dataclass(dcp.Metadata)
    assert isinstance(_Counter(), dcp.Stateful)
    assert isinstance(_Counter(), tdcp.stateful.Stateful)


# -- multi-rank ----------------------------------------------------------------------


class _Collective:
    """A Stateful whose state_dict and load_state_dict each run an all_reduce."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        import torch.distributed as dist

        t = torch.tensor([float(self.value)])
        dist.all_reduce(t)
        return {"v": t}

    def load_state_dict(self, sd):
        import torch.distributed as dist

        t = sd["v"].clone()
        dist.all_reduce(t)
        self.value = float(t)


def _stateful_orders(path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp

    import shardkit.checkpoint as dcp

    rank = dist.get_rank()

    def state(a, b):  # the two objects under opposite key orders on the two ranks
        objs = {"a": _Collective(a), "b": _Collective(b)}
        return objs if rank == 0 else dict(reversed(list(objs.items())))

    dcp.save(state(1, 10), checkpoint_id=f"{path}/sk")
    ours = state(0, 0)
    dcp.load(ours, checkpoint_id=f"{path}/sk")
    # torch's save walks in each rank's dict order (its load sorts), so save in one order
    tdcp.save({"a": _Collective(1), "b": _Collective(10)}, checkpoint_id=f"{path}/t")
    theirs = state(0, 0)
    tdcp.load(theirs, checkpoint_id=f"{path}/t")
    return [ours["a"].value, ours["b"].value, theirs["a"].value, theirs["b"].value]


def test_stateful_collectives_under_different_key_orders_do_not_hang(tmp_path):
    results = run_ranks(_stateful_orders, 2, str(tmp_path), timeout=60)
    # state_dict() all-reduces 1 and 10 over 2 ranks (2, 20); load_state_dict doubles again
    assert results == [[4.0, 40.0, 4.0, 40.0]] * 2


def _reshard_cast(path):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardkit.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7
    saved = {"w": distribute_tensor(full, mesh, [Shard(0)]), "n": 3}
    dcp.save(saved, checkpoint_id=f"{path}/sk")
    tdcp.save(saved, checkpoint_id=f"{path}/t")
    out = []
    for dtype in (torch.bfloat16, torch.float64):
        for placement in (Shard(1), Replicate()):
            ours = {"w": distribute_tensor(torch.zeros(8, 6, dtype=dtype), mesh, [placement])}
            theirs = {"w": distribute_tensor(torch.zeros(8, 6, dtype=dtype), mesh, [placement])}
            dcp.load(ours, checkpoint_id=f"{path}/sk")
            tdcp.load(theirs, checkpoint_id=f"{path}/t")
            a, b = ours["w"].to_local(), theirs["w"].to_local()
            out.append((a.dtype == b.dtype == dtype) and torch.equal(a, b))
    missing = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "gone": torch.ones(1)}
    try:
        dcp.load(missing, checkpoint_id=f"{path}/sk")
    except dcp.StateDictMismatchError as exc:
        out.append(f"rank {dist.get_rank()}" in str(exc) and "gone" in str(exc))
    return out


def test_resharded_cast_load_matches_torch_on_two_ranks(tmp_path):
    results = run_ranks(_reshard_cast, 2, str(tmp_path), timeout=90)
    assert results == [[True] * 5] * 2


def test_checkpoint_manager_num_of_threads_is_honoured(tmp_path):
    mgr = dcp.CheckpointManager(tmp_path, 1, num_of_threads=3)
    state = {"a": torch.ones(4), "b": torch.zeros(3), "c": torch.full((2,), 2.0)}
    mgr.save(1, state)
    files = [p for p in (tmp_path).rglob("data-*.safetensors")]
    assert len(files) == 3  # one per thread
    out = {k: torch.empty_like(v) for k, v in state.items()}
    mgr.restore(1, out)
    assert all(torch.equal(out[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="num_of_threads"):
        dcp.CheckpointManager(tmp_path / "x", 1, num_of_threads=0)


def test_async_save_takes_torch_arguments(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = _sd()
    fut = dcp.async_save(
        sd,
        checkpoint_id=tmp_path,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    fut.result()
    out = _fresh()
    dcp.load(out, checkpoint_id=tmp_path)
    _equal(out, sd)
    with pytest.warns(UserWarning, match="async_checkpointer_type"):
        dcp.async_save(
            sd, checkpoint_id=tmp_path / "p", async_checkpointer_type=AsyncCheckpointerType.PROCESS
        ).result()


def test_a_storage_object_and_a_checkpoint_id_go_where_the_id_says_as_torch(tmp_path):
    """torch points the storage object at ``checkpoint_id`` (``reset``), keeping its
    options; shardkit used to ignore the id and write or read the object's own path."""
    sd = _sd()
    torch_writer = tdcp.FileSystemWriter(tmp_path / "torch_writer_path")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save(sd, storage_writer=torch_writer, checkpoint_id=tmp_path / "torch", no_dist=True)
    assert (tmp_path / "torch" / ".metadata").exists()
    assert not (tmp_path / "torch_writer_path").exists()

    writer = dcp.FileSystemWriter(tmp_path / "sk_writer_path", thread_count=2)
    dcp.save(sd, storage_writer=writer, checkpoint_id=tmp_path / "sk")
    assert (tmp_path / "sk" / "metadata.json").exists()
    assert not (tmp_path / "sk_writer_path").exists()
    assert writer.thread_count == 2  # the options stay
    out = _fresh()
    dcp.load(out, checkpoint_id=tmp_path / "sk")
    _equal(out, sd)

    other = {**sd, "step": 8}  # a second checkpoint: the reader must go where the id says
    dcp.save(other, checkpoint_id=tmp_path / "sk_other")
    ours, theirs = _fresh(), _fresh()
    dcp.load(
        ours,
        storage_reader=dcp.FileSystemReader(tmp_path / "sk"),
        checkpoint_id=tmp_path / "sk_other",
    )
    _torch_load(theirs, tmp_path / "torch", storage_reader=tdcp.FileSystemReader(tmp_path / "sk"))
    assert ours["step"] == 8 and theirs["step"] == 7


def test_a_storage_object_without_reset_and_an_id_is_refused(tmp_path):
    class Writer:  # a minimal StorageWriter: it cannot be pointed elsewhere
        thread_count = 1

        def write_file(self, name, parts): ...
        def commit(self, metadata): ...
        def list_files(self):
            return []

        def remove_files(self, names): ...

    with pytest.raises(ValueError, match="no reset.*pass one of them"):
        dcp.save(_sd(), storage_writer=Writer(), checkpoint_id=tmp_path / "x", no_dist=True)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("call", ["save", "load", "async_save"])
def test_no_checkpoint_id_and_no_storage_raises_torch_class(call):
    """torch: RuntimeError ("checkpoint_id must be specified ..."); shardkit's error is a
    ValueError too (a caller's mistake). async_save raises at the call (torch: from the
    Future): docs/migrating.md."""
    if call == "async_save":
        with pytest.raises(RuntimeError):
            tdcp.async_save(_sd(), no_dist=True).result()
    else:
        assert isinstance(
            _torch_failure(lambda: getattr(tdcp, call)(_sd(), no_dist=True)), RuntimeError
        )
    with pytest.raises(RuntimeError, match="pass checkpoint_id") as info:
        getattr(dcp, call)(_sd(), no_dist=True)
    assert isinstance(info.value, ValueError)
