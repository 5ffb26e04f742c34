"""Pure logic of the SPMD sharding rules: reshape planning (box arithmetic on uneven
chunks), rule coverage of the common ops, and SpmdFullyShardedDataParallel's checks."""

import numpy as np
import pytest
import torch

import shardkit.spmd as xs
from shardkit.spmd import _dispatch
from shardkit.spmd._rules._views import _groups, _splits, view_plan

aten = torch.ops.aten
MESH_2X2 = (2, 2)


def test_view_groups_pair_dims_by_product():
    assert _groups((4, 3, 5), (12, 5)) == [([0, 1], [0]), ([2], [1])]
    assert _groups((6, 7), (2, 3, 7)) == [([0], [0, 1]), ([1], [2])]
    assert _groups((5, 1, 7), (5, 7)) == [([0], [0]), ([1, 2], [1])]


def test_splits_enumerates_every_ordered_cut():
    assert list(_splits((0, 1), 2)) == [[(), (0, 1)], [(0,), (1,)], [(0, 1), ()]]
    assert list(_splits((), 3)) == [[(), (), ()]]


def test_flatten_keeps_both_axes_when_shards_are_runs():
    # (2, 4) over (data, model): each rank holds 1 x 2, a contiguous run of the 8
    req, out = view_plan((2, 4, 5), ((0,), (1,), ()), (8, 5), MESH_2X2)
    assert req == ((0,), (1,), ())
    assert out == ((0, 1), ())
    # (4, 2): each rank holds 2 x 1, two separate runs: keep only the major axis
    req, out = view_plan((4, 2, 5), ((0,), (1,), ()), (8, 5), MESH_2X2)
    assert req == ((0,), (), ())
    assert out == ((0,), ())


def test_flatten_of_minor_sharded_dim_gathers_it():
    # (5, 3, 2) -> (5, 6): the 2-dim is sharded but minor inside the merged group
    req, out = view_plan((5, 3, 2), ((0,), (), (1,)), (5, 6), MESH_2X2)
    assert req == ((0,), (), ())
    assert out == ((0,), ())


def test_uneven_flatten_is_rejected_by_box_arithmetic():
    # 5 rows over 2 ranks are 3 + 2; 5*4 elements over 2 are 10 + 10: not the same runs
    req, out = view_plan((5, 4), ((0,), ()), (20,), MESH_2X2)
    assert req == ((), ()) and out == ((),)
    # 6 rows: 3 + 3 rows = 12 + 12 elements: the same runs, the sharding survives
    req, out = view_plan((6, 4), ((0,), ()), (24,), MESH_2X2)
    assert req == ((0,), ()) and out == ((0,),)


def test_split_dim_moves_sharding_to_the_major_output_dim():
    req, out = view_plan((6, 7), ((0,), (1,)), (2, 3, 7), MESH_2X2)
    assert req == ((0,), (1,))
    assert out == ((0,), (), (1,))


def test_unflatten_distributes_two_axes_over_two_dims():
    # heads merged with batch: (b*h) split over (data, model) comes back as b on data and
    # h on model
    req, out = view_plan((8, 5), ((0, 1), ()), (2, 4, 5), MESH_2X2)
    assert req == ((0, 1), ())
    assert out in (((0,), (1,), ()), ((0, 1), (), ()))


@pytest.mark.parametrize(
    "op",
    [
        aten.add.Tensor,
        aten.mul_.Tensor,
        aten.gelu.default,
        aten.gelu_backward.default,
        aten.where.self,
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.amax.default,
        aten.max.dim,
        aten.argmax.default,
        aten.linalg_vector_norm.default,
        aten._softmax.default,
        aten._log_softmax_backward_data.default,
        aten.native_layer_norm.default,
        aten.native_layer_norm_backward.default,
        aten.embedding.default,
        aten.embedding_dense_backward.default,
        aten.native_dropout.default,
        aten.bernoulli_.float,
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten.view.default,
        aten.permute.default,
        aten.slice.Tensor,
        aten.cat.default,
        aten.stack.default,
        aten.split.Tensor,
        aten._foreach_add_.List,
        aten._foreach_addcdiv_.ScalarList,
        aten._fused_adam_.default,
        aten._fused_adamw_.default,
    ],
)
def test_common_ops_have_a_rule(op):
    assert _dispatch._rule_for(op) is not None, f"{op} would gather through the fallback"


def test_unique_has_no_rule_so_it_falls_back():
    assert _dispatch._rule_for(aten._unique2.default) is None


def test_spmd_fsdp_rejects_a_mesh_without_its_axis():
    mesh = xs.Mesh(np.arange(1), (1,), ("data",))
    with pytest.raises(ValueError, match="'fsdp'"):
        xs.SpmdFullyShardedDataParallel(torch.nn.Linear(2, 2), mesh)
    with pytest.raises(TypeError, match="nn.Module"):
        xs.SpmdFullyShardedDataParallel(lambda x: x, xs.Mesh(np.arange(1), (1,), ("fsdp",)))


def test_spmd_fsdp_shards_parameters_on_dim_0():
    mesh = xs.Mesh(np.arange(1), (1,), ("fsdp",))
    model = xs.SpmdFullyShardedDataParallel(torch.nn.Linear(3, 2), mesh)
    specs = {n: p.partition_spec for n, p in model.module.named_parameters()}
    assert specs == {"weight": ("fsdp", None), "bias": ("fsdp",)}
    out = model(torch.randn(4, 3))
    assert isinstance(out, xs.ShardedTensor) and out.partition_spec == ("fsdp", None)


@pytest.mark.parametrize("op, args", [("t_", ()), ("resize_", (5, 4)), ("transpose_", (0, 1))])
def test_an_in_place_op_that_changes_the_shape_is_refused_and_changes_nothing(op, args):
    """The fallback wrote such a result back through the old layout: wrong values on 2
    ranks, a confusing size error on 1."""
    import shardkit.spmd as xs

    mesh = xs.Mesh([0], (1,), ("d",))
    st = xs.mark_sharding(torch.arange(20.0).reshape(4, 5), mesh, ("d", None))
    with pytest.raises(NotImplementedError, match=f"{op} changes the shape"):
        getattr(st, op)(*args)
    assert tuple(st.shape) == (4, 5)
    assert torch.equal(st.full_tensor(), torch.arange(20.0).reshape(4, 5))


def test_operands_on_two_meshes_raise_a_mesh_error_naming_both():
    """Before: a bare AssertionError "redistribution across meshes is not supported"."""
    a = xs.mark_sharding(torch.randn(4, 4), xs.Mesh([0], (1,), ("x",)), ("x", None))
    b = xs.mark_sharding(torch.randn(4, 4), xs.Mesh([0], (1,), ("y",)), ("y", None))
    with pytest.raises(xs.MeshError, match="operands must share one mesh") as info:
        a @ b.T
    assert isinstance(info.value, AssertionError)  # torch_xla's class, as the other errors
