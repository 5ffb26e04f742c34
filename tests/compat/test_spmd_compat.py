"""shardkit.spmd against torch_xla's documented SPMD behaviour and torch DTensor.

Mesh and partition-spec behaviour follows torch_xla's docs and source
(``torch_xla/distributed/spmd/xla_sharding.py``): attribute values, ``shape()`` keys,
``from_str``, and the exception classes its asserts and checks raise. Behaviour that
DTensor also has (uneven and empty shards, resharding, ops on them) is checked against
torch DTensor in the same 2-rank run. Every case has a hard time limit.
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import run_ranks

import shardkit.spmd as xs

# the SPMD op matrix lives with the dist tests; the empty-shard run below reuses it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

_WORLD_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def one(monkeypatch):
    for name in _WORLD_VARS:
        monkeypatch.delenv(name, raising=False)
    return xs.Mesh([0], (1,), ("x",))


# -- Mesh attributes, as torch_xla keeps them -------------------------------------------
@pytest.mark.timeout(30)
def test_mesh_keeps_device_ids_and_axis_names_as_given(one):
    mesh = xs.Mesh([0], (1, 1))
    assert mesh.axis_names is None  # torch_xla: None stays None
    assert isinstance(mesh.device_ids, np.ndarray) and mesh.device_ids.shape == (1,)
    assert mesh.mesh_shape == (1, 1)
    assert mesh.shape() == OrderedDict([(0, 1), (1, 1)])  # keyed by axis index
    assert mesh.size() == 1
    assert mesh.get_logical_mesh().tolist() == [[0]]
    assert mesh.get_axis_name_idx("x") is None
    named = xs.Mesh(np.array([0]), (1, 1), ("data", "model"))
    assert named.shape() == OrderedDict([("data", 1), ("model", 1)])
    assert named.get_axis_name_idx("model") == 1
    assert named.get_axis_name_idx("nope") is None
    assert named.device_ids.tolist() == [0]


@pytest.mark.timeout(30)
def test_unnamed_mesh_takes_axis_indices_in_specs(one):
    mesh = xs.Mesh([0], (1, 1))
    st = xs.mark_sharding(torch.arange(6.0).reshape(2, 3), mesh, (0, 1))
    assert st.partition_spec == (0, 1)
    assert torch.equal(st.full_tensor(), torch.arange(6.0).reshape(2, 3))
    with pytest.raises(ValueError, match="no axis names"):
        xs.mark_sharding(torch.zeros(2), mesh, ("x",))


@pytest.mark.timeout(30)
def test_mesh_str_and_from_str_round_trip(one):
    mesh = xs.Mesh([0], (1, 1), ("a", "b"))
    assert str(mesh) == "{'device_ids': [0], 'mesh_shape': (1, 1), 'axis_names': ('a', 'b')}"
    again = xs.Mesh.from_str(str(mesh))
    assert again == mesh and again.axis_names == ("a", "b")
    unnamed = xs.Mesh.from_str(str(xs.Mesh([0], (1,))))
    assert unnamed.axis_names is None and unnamed.mesh_shape == (1,)
    assert xs.Mesh.from_str("Mesh" + str(mesh)) == mesh
    for garbage in ("", "not a mesh", "{'device_ids': [0]}", "{1: 2"):
        assert xs.Mesh.from_str(garbage) is None


@pytest.mark.timeout(30)
def test_get_1d_mesh_and_global_mesh(one):
    mesh = xs.get_1d_mesh("data")
    assert (mesh.mesh_shape, mesh.axis_names) == ((1,), ("data",))
    assert xs.get_1d_mesh().axis_names is None
    assert xs.get_global_mesh() is None
    try:
        xs.set_global_mesh(mesh)
        assert xs.get_global_mesh() is mesh
    finally:
        xs.set_global_mesh(None)
    with pytest.raises(TypeError):
        xs.set_global_mesh("data")


@pytest.mark.timeout(30)
def test_hybrid_mesh_shape_and_rank_layout(one):
    from shardkit.spmd._mesh import _hybrid_grid

    mesh = xs.HybridMesh(ici_mesh_shape=(1, 1), axis_names=("data", "model"))
    assert mesh.dcn_mesh_shape == (1, 1) and mesh.shape() == OrderedDict(data=1, model=1)
    # torch_xla's docstring example: 2 slices of 4 devices -> data=2, fsdp=4, tensor=1;
    # each slice (machine) holds consecutive ranks
    grid = _hybrid_grid((1, 4, 1), (2, 1, 1))
    assert grid.shape == (2, 4, 1)
    assert grid[:, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _hybrid_grid((2, 1), (1, 2)).tolist() == [[0, 2], [1, 3]]
    with pytest.raises(AssertionError, match="one size per axis"):
        xs.HybridMesh(ici_mesh_shape=(1,), dcn_mesh_shape=(1, 1))


# -- errors: the classes torch_xla raises, named in the message -------------------------
_MESH_ERRORS = [
    ([0], (2,), None, "holds 2 devices"),
    ([0, 0], (2,), None, "the mesh has 2 devices"),
    ([0], (1,), ("a", "b"), "must name each"),
    ([0], (1, 1), ("a", "a"), "unique"),
    ([3], (1,), None, "permutation"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("ids", "shape", "names", "message"), _MESH_ERRORS)
def test_mesh_errors_are_assertion_errors_as_in_torch_xla(one, ids, shape, names, message):
    # torch_xla asserts these; ours is also a ValueError
    for cls in (AssertionError, ValueError, xs.MeshError):
        with pytest.raises(cls, match=message):
            xs.Mesh(ids, shape, names)


# torch_xla: unknown axis names and unsupported entry types raise ValueError
# (_translate_named_partition_spec); a bad index, a reused axis, a nested tuple and a
# spec of the wrong length fail its asserts.
_SPEC_ERRORS = [
    (("z", None), ValueError, "unknown mesh axis 'z'"),
    ((1.5, None), ValueError, "entry 1.5 of type float"),
    ((True, None), ValueError, "entry True of type bool"),
    ((5, None), AssertionError, "mesh axis index 5"),
    ((-1, None), AssertionError, "mesh axis index -1"),
    (("x", "x"), AssertionError, "uses mesh axis 'x' twice"),
    ((("x", ("y",)), None), AssertionError, "nests tuples"),
    (("x",), AssertionError, "has 1 entries but the tensor has 2 dims"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("spec", "torch_xla_cls", "message"), _SPEC_ERRORS)
def test_bad_partition_spec_entries_raise_torch_xla_class(
    monkeypatch, spec, torch_xla_cls, message
):
    for name in _WORLD_VARS:
        monkeypatch.delenv(name, raising=False)
    mesh = xs.Mesh([0], (1, 1), ("x", "y"))
    with pytest.raises(torch_xla_cls, match=message) as info:
        xs.mark_sharding(torch.zeros(2, 2), mesh, spec)
    assert isinstance(info.value, xs.PartitionSpecError)
    assert isinstance(info.value, ValueError)  # shardkit's own class hierarchy


@pytest.mark.timeout(30)
def test_spec_of_wrong_type_is_also_a_type_error(one):
    with pytest.raises(TypeError, match="one entry per dim"):
        xs.mark_sharding(torch.zeros(2), one, "x")
    with pytest.raises(ValueError, match="one entry per dim"):
        xs.mark_sharding(torch.zeros(2), one, "x")


# -- mark_sharding as a statement -------------------------------------------------------
@pytest.mark.timeout(30)
def test_bare_mark_sharding_statement_warns_once_per_line(one):
    t = torch.randn(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            xs.mark_sharding(t, one, ("x", None))  # torch_xla style: result dropped
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert "discarded" in text and "t = xs.mark_sharding" in text
    assert caught[0].filename == __file__


@pytest.mark.timeout(30)
def test_assigned_mark_sharding_does_not_warn(one):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = xs.mark_sharding(torch.randn(4, 2), one, ("x", None))
        pair = [xs.mark_sharding(torch.randn(2), one, (None,))]
    assert isinstance(st, xs.ShardedTensor) and isinstance(pair[0], xs.ShardedTensor)


@pytest.mark.timeout(30)
def test_bare_mark_sharding_of_a_parameter_points_to_the_module_helper(one):
    layer = torch.nn.Linear(2, 4)
    with pytest.warns(UserWarning, match=r"shard them in place with xs.shard_module\(module"):
        xs.mark_sharding(layer.weight, one, ("x", None))
    assert type(layer.weight) is torch.nn.Parameter  # unchanged, and the warning says so


# -- the sharded tensor's torch_xla attributes ------------------------------------------
@pytest.mark.timeout(30)
def test_sharded_tensor_xla_attributes_in_a_world_of_one(one):
    full = torch.arange(6.0).reshape(3, 2)
    st = xs.mark_sharding(full, one, ("x", None))
    assert isinstance(st, xs.XLAShardedTensor)
    assert st.mesh_shape == (1,)
    assert torch.equal(st.global_tensor, full) and not st.global_tensor.requires_grad
    assert st.sharding_type is xs.ShardingType.MAXIMAL
    (shard,) = st.local_shards
    assert shard.indices is Ellipsis and torch.equal(shard.unpadded_data, full)
    assert shard.shard_device == "CPU:0"
    shard.data.mul_(2)  # a snapshot: the tensor does not change
    assert torch.equal(st.global_tensor, full)
    st.load_local_shards_([xs.XLAShard(full * 3, Ellipsis, "CPU:0", 0)])
    assert torch.equal(st.global_tensor, full * 3)
    assert torch.equal(xs.clear_sharding(st), full * 3)


# -- the same behaviour on 2 ranks, DTensor as the oracle --------------------------------
def _two_rank_checks():
    import _spmd_compat_ranks as cases

    return cases.run_all()


@pytest.fixture(scope="module")
def two_ranks():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    results = run_ranks(_two_rank_checks, 2, timeout=240)
    return results


def _check(two_ranks, name):
    for rank, result in enumerate(two_ranks):
        value = result[name]
        assert value == "ok", f"rank {rank}: {name}: {value}"


_TWO_RANK_CASES = [
    "mesh_attributes",
    "unnamed_mesh",
    "hybrid_mesh_two_machines",
    "empty_shards_like_dtensor",
    "reshard_like_dtensor",
    "ops_on_empty_shards",
    "attention_one_kv_head",
    "local_shards_and_global_tensor",
    "mark_sharding_with_gradients",
    "adamw_mixed_params_no_collectives",
    "adamw_mixed_params_exact",
    "plain_state_sharded_grad",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", _TWO_RANK_CASES)
def test_two_ranks(two_ranks, name):
    _check(two_ranks, name)


@pytest.mark.timeout(300)
def test_rule_matrix_with_empty_shards(two_ranks):
    """The dist op matrix with every sharded size shrunk to 1 over 2 ranks: one rank
    holds an empty shard of each sharded tensor. Forward and gradients match torch."""
    matrix = two_ranks[0]["empty_matrix"]
    assert isinstance(matrix, dict), matrix
    assert len(matrix) >= 30, sorted(matrix)
    bad = {k: v for k, v in matrix.items() if v != "ok"}
    assert bad == {}
    assert two_ranks[1]["empty_matrix"] == matrix


def test_torch_xla_names_clear_sharding_t_and_unpadded_data_setter(one):
    """``clear_sharding(t=...)`` (torch_xla's parameter name) and ``XLAShard``'s
    ``unpadded_data`` setter, which writes into the padded ``data``."""
    mesh = xs.Mesh([0], (1,), ("x",))
    st = xs.mark_sharding(torch.arange(6.0).reshape(3, 2), mesh, ("x", None))
    assert torch.equal(xs.clear_sharding(t=st), torch.arange(6.0).reshape(3, 2))
    shard = st.local_shards[0]
    shard.unpadded_data = torch.ones(3, 2)
    assert torch.equal(shard.data[:3], torch.ones(3, 2))
    with pytest.raises(ValueError, match="shape"):
        shard.unpadded_data = torch.ones(2, 2)
