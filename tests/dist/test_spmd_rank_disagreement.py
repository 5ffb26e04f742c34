"""Ranks that disagree on a mesh or on a sharded tensor's meaning raise on every rank.

Found by an audit of ranks that disagree (2026-11-29): a mesh built with device ids in a
different order on each rank gave a wrong ``full_tensor`` (both ranks owned the same
box), swapped axis names gave a wrong matmul, and a different mesh shape hung in the
first collective. ``full_tensor`` / ``redistribute`` read one rank's bytes as another
dtype, spec or global shape and returned garbage. Now:

- ``Mesh(...)`` compares a checksum of (device ids, mesh shape, axis names) across the
  ranks and raises MeshError on every rank, naming what differs;
- the all-gather's size header and a 16-byte header in front of each all-to-all chunk
  carry the dtype and a checksum of (global shape, source spec): ValueError on every rank.
"""

import pytest
from harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _outcome(fn):
    """(exception class name, message) or ("ok", result) on this rank."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the class is what is compared
        return type(exc).__name__, str(exc)


def _mesh_case(case):
    import numpy as np
    import torch

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    r, n = xr.global_ordinal(), xr.world_size()
    ids, shape, names = np.arange(n), (n,), ("data",)
    if case == "permuted_ids":
        ids = np.arange(n) if r == 0 else np.arange(n)[::-1].copy()
    elif case == "swapped_names":
        shape, names = (n, 1), ("data", "model") if r == 0 else ("model", "data")
    elif case == "shape":
        shape, names = ((n, 1) if r == 0 else (1, n)), ("data", "model")
    elif case == "invalid_on_rank_1":  # rank 1's mesh is refused before the check
        names = ("data",) if r == 0 else ("data", "extra")
    full = torch.arange(32.0).reshape(8, 4)

    def body():
        mesh = xs.Mesh(ids, shape, names)
        return bool(torch.equal(xs.mark_sharding(full, mesh, ("data", None)).full_tensor(), full))

    return _outcome(body)


@pytest.mark.parametrize(
    "case, what",
    [
        ("permuted_ids", "device_ids: rank 0 has [0, 1], rank 1 has [1, 0]"),
        ("swapped_names", "axis_names: rank 0 has ['data', 'model'], rank 1 has ['model', 'data']"),
        ("shape", "mesh_shape: rank 0 has [2, 1], rank 1 has [1, 2]"),
    ],
)
def test_mesh_built_differently_raises_on_every_rank(case, what):
    """Permuted ids gave a wrong full_tensor, swapped names a wrong result, another
    shape a hang (the harness's timeout)."""
    results = run_ranks(_mesh_case, 2, case, timeout=60)
    for name, message in results:
        assert name == "MeshError", results
        assert what in message, message


def test_a_mesh_invalid_on_one_rank_fails_every_rank():
    """Rank 1's own MeshError came at once while rank 0 waited in the check for good."""
    (name0, msg0), (name1, msg1) = run_ranks(_mesh_case, 2, "invalid_on_rank_1", timeout=60)
    assert name1 == "MeshError" and "must name each of the 1 mesh axes" in msg1, msg1
    assert name0 == "MeshError" and "rank(s) [1] could not build the mesh" in msg0, msg0
    assert "must name each of the 1 mesh axes" in msg0, msg0


def test_same_mesh_on_every_rank_still_builds():
    assert run_ranks(_mesh_case, 2, "same", timeout=60) == [("ok", True)] * 2


def _tensor_case(case):
    import numpy as np
    import torch

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    r, n = xr.global_ordinal(), xr.world_size()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    full = torch.arange(32.0).reshape(8, 4)

    def body():
        if case == "dtype":  # the same element size: the bytes fit either way
            t = full.to(torch.float16 if r == 0 else torch.bfloat16)
            return bool(torch.equal(xs.mark_sharding(t, mesh, ("data", None)).full_tensor(), t))
        if case == "spec":
            spec = ("data", None) if r == 0 else (None, "data")
            return bool(torch.equal(xs.mark_sharding(full, mesh, spec).full_tensor(), full))
        if case == "global_shape":  # 16 elements a rank either way
            shape = (2, 16) if r == 0 else (8, 4)
            rows = shape[0] // n
            local = full.reshape(shape)[r * rows : (r + 1) * rows]
            st = xs.ShardedTensor.from_local(local.clone(), mesh, ("data", None), shape)
            return bool(torch.equal(st.full_tensor(), full.reshape(shape)))
        # the all-to-all path: dim 0 sharded -> dim 1 sharded
        st = xs.mark_sharding(full, mesh, ("data", None))
        if case == "a2a_dtype":
            t = full.to(torch.float32 if r == 0 else torch.int32)
            st = xs.mark_sharding(t, mesh, ("data", None))
        elif case == "a2a_global_shape":  # (4, 8) and (8, 4): the same bytes per peer
            shape = (4, 8) if r == 0 else (8, 4)
            rows = shape[0] // n
            local = full.reshape(shape)[r * rows : (r + 1) * rows]
            st = xs.ShardedTensor.from_local(local.clone(), mesh, ("data", None), shape)
        with xs.count_collectives() as counts:
            moved = st.redistribute((None, "data"))
        assert counts.total_calls("all_to_all") == 1, counts.calls
        return bool(torch.equal(moved.full_tensor(), full.to(moved.dtype).reshape(moved.shape)))

    return _outcome(body)


@pytest.mark.parametrize(
    "case, what",
    [
        ("dtype", "dtype: rank 0 has torch.float16, rank 1 has torch.bfloat16"),
        ("spec", "partition spec: rank 0 has ('data', None), rank 1 has (None, 'data')"),
        ("global_shape", "global shape: rank 0 has [2, 16], rank 1 has [8, 4]"),
        ("a2a_dtype", "dtype: rank 0 has torch.float32, rank 1 has torch.int32"),
        ("a2a_global_shape", "global shape: rank 0 has [4, 8], rank 1 has [8, 4]"),
    ],
)
def test_tensor_meaning_differs_raises_on_every_rank(case, what):
    """full_tensor / redistribute read the other rank's bytes as this rank's dtype,
    spec or shape and returned wrong values silently."""
    results = run_ranks(_tensor_case, 2, case, timeout=60)
    for name, message in results:
        assert name == "ValueError", results
        assert what in message, message


def test_consistent_ranks_still_gather_and_move():
    assert run_ranks(_tensor_case, 2, "a2a_same", timeout=60) == [("ok", True)] * 2


def _fsdp_state_dict_on_one_rank():
    import torch
    from torch import nn

    import shardkit.runtime as xr
    from shardkit.fsdp import FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 6))
    if xr.global_ordinal() == 0:  # e.g. for logging: must not wait for the other rank
        return sorted((k, type(v).__name__) for k, v in model.state_dict().items())
    return None


def test_fsdp_state_dict_on_one_rank_does_not_wait_for_the_others():
    """FSDP builds its ("fsdp",) mesh lazily in state_dict(); that mesh skips the
    cross-rank check, which would be a collective only one rank joined."""
    results = run_ranks(_fsdp_state_dict_on_one_rank, 2, timeout=60)
    rows = [("module.bias", "RowShard"), ("module.weight", "RowShard")]  # built the mesh
    assert results == [rows, None]


def _unseeded_case(wrapper, seeded):
    """Build a model with a per-rank (or common) seed, wrap it; which warnings came."""
    import warnings

    import torch
    from torch import nn

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    r, n = xr.global_ordinal(), xr.world_size()
    torch.manual_seed(0 if seeded else 1 + r)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    mesh = xs.Mesh(list(range(n)), (n,), ("fsdp",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapper == "shard_module":
            xs.shard_module(model, mesh, {"0.weight": ("fsdp", None)})
        else:
            xs.SpmdFullyShardedDataParallel(model, mesh)
    return [str(w.message) for w in caught if "initializations" in str(w.message)]


@pytest.mark.parametrize("wrapper", ["shard_module", "SpmdFullyShardedDataParallel"])
def test_parameters_initialised_differently_per_rank_warn(wrapper):
    """Unseeded ranks: each keeps its slice of its own init, a mix nobody asked for
    (torch's distribute_tensor scatters rank 0's); a common seed is quiet."""
    for got in run_ranks(_unseeded_case, 2, wrapper, False, timeout=60):
        assert len(got) == 1 and got[0].startswith(f"{wrapper}: the ranks' parameters"), got
    for got in run_ranks(_unseeded_case, 2, wrapper, True, timeout=60):
        assert got == [], got


def _plan_case(wrapper):
    import torch
    from torch import nn

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    r, n = xr.global_ordinal(), xr.world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    if wrapper == "shard_module":
        mesh = xs.Mesh(list(range(n)), (n,), ("model",))
        col, row = ("model", None), (None, "model")
        plan = {"0.weight": col, "1.weight": row} if r == 0 else {"0.weight": row, "1.weight": col}
        return _outcome(lambda: xs.shard_module(model, mesh, plan, strict=False) and "wrapped")
    mesh = xs.Mesh(list(range(n)), (1, n), ("data", "fsdp"))
    extra = "data" if r == 1 else None
    return _outcome(
        lambda: xs.SpmdFullyShardedDataParallel(model, mesh, extra_data_axis=extra) and "wrapped"
    )


@pytest.mark.parametrize("wrapper", ["shard_module", "SpmdFullyShardedDataParallel"])
def test_a_layout_that_differs_per_rank_raises_on_every_rank(wrapper):
    """A plan with column and row specs swapped on one rank gave every rank a wrong
    output, silently (the second divergence audit); extra_data_axis on one rank only
    ended in gloo resets on some ranks."""
    for name, message in run_ranks(_plan_case, 2, wrapper, timeout=60):
        assert name == "ValueError", message
        assert "the ranks lay the parameters out differently" in message, message
