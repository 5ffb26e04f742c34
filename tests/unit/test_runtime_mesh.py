"""Runtime and Mesh in a world of one (no process group)."""

import numpy as np
import pytest
import torch

import shardkit.runtime as xr
import shardkit.spmd as xs

_WORLD_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK", "SLURM_LOCALID")


@pytest.fixture
def no_world(monkeypatch):
    for name in _WORLD_VARS:
        monkeypatch.delenv(name, raising=False)


def test_world_of_one_needs_no_setup(no_world):
    xr.init()
    xr.init()  # idempotent
    assert not xr.is_initialized()
    assert (xr.world_size(), xr.global_ordinal(), xr.local_rank()) == (1, 0, 0)
    assert xr.global_runtime_device_count() == 1
    assert xr.device() == torch.device("cpu")
    assert xr.default_backend() == "gloo"
    xr.use_spmd()
    assert xr.is_spmd()


def test_init_reports_missing_rank(no_world, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2 is set but RANK is not"):
        xr.init()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        xr.init()


def test_an_incomplete_slurm_environment_names_slurms_variables(no_world, monkeypatch):
    """Under SLURM the message named WORLD_SIZE and RANK, which nobody had set."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=2 is set but SLURM_PROCID is not"):
        xr.init()
    monkeypatch.setenv("SLURM_PROCID", "5")
    with pytest.raises(ValueError, match=r"SLURM_PROCID=5 is outside the world of 2"):
        xr.init()
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=2 is set but MASTER_ADDR is not"):
        xr.init()


def test_mesh_shape_is_ordered(no_world):
    mesh = xs.Mesh([0], (1, 1), ("data", "model"))
    assert list(mesh.shape().items()) == [("data", 1), ("model", 1)]
    assert mesh.coord() == (0, 0)
    assert mesh.group(("data",)) is None  # no process group in a world of one


@pytest.mark.parametrize(
    ("ids", "shape", "names", "message"),
    [
        ([0, 1], (2,), None, r"the mesh has 2 devices but the world has 1 ranks"),
        ([0], (2,), None, r"holds 2 devices but 1 device_ids were given"),
        ([3], (1,), None, r"device_ids \[3\] must be a permutation of the ranks 0..0"),
        ([0], (1,), ("a", "b"), r"must name each of the 1 mesh axes"),
        ([0], (1, 1), ("a", "a"), r"must be unique strings"),
    ],
)
def test_mesh_errors(no_world, ids, shape, names, message):
    with pytest.raises(ValueError, match=message):
        xs.Mesh(np.array(ids), shape, names)


def test_single_process_sharding_is_exact(no_world):
    mesh = xs.Mesh([0], (1,), ("x",))
    full = torch.randn(3, 4)
    st = xs.mark_sharding(full, mesh, ("x", None))
    assert st.shape == full.shape and torch.equal(st.local_tensor(), full)
    assert torch.equal(xs.clear_sharding(st * 3), full * 3)
    with pytest.raises(ValueError, match="does not match the shape"):
        xs.ShardedTensor.from_local(torch.zeros(2, 4), mesh, ("x", None), (3, 4))
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(st)


@pytest.mark.parametrize("mesh", ["data", None, 2])
def test_a_mesh_argument_that_is_not_a_mesh_is_a_type_error(no_world, mesh):
    """It was an AttributeError ('str' object has no attribute 'axis_labels'; errors audit)."""
    with pytest.raises(TypeError, match=r"mesh must be a shardkit\.spmd\.Mesh.*xs\.Mesh\("):
        xs.mark_sharding(torch.ones(4), mesh, ("data",))


@pytest.mark.parametrize("shape", [(1.0,), (True,), ("1",)])
def test_a_mesh_shape_of_non_ints_is_a_type_error(no_world, shape):
    """A float shape was accepted (errors audit), and int() would make 2.5 a 2."""
    with pytest.raises(TypeError, match="must hold ints"):
        xs.Mesh(np.arange(1), shape, ("data",))
    assert xs.Mesh(np.arange(1), (np.int64(1),), ("data",)).shape() == {"data": 1}
