"""Property tests of the pure shard arithmetic (no processes)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.spmd.layout import (
    Box,
    chunk_bounds,
    mesh_coords,
    normalize_spec,
    replica_axes,
    shard_box,
    spec_to_user,
)


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_bounds_follow_torch_chunk(dim_size, num_chunks):
    pieces = torch.arange(dim_size).chunk(num_chunks) if dim_size else ()
    for index in range(num_chunks):
        offset, size = chunk_bounds(dim_size, num_chunks, index)
        if index < len(pieces):
            assert size == len(pieces[index])
            if size:
                assert offset == int(pieces[index][0])
        else:
            assert size == 0  # torch.chunk drops trailing empty chunks; ours are empty


@st.composite
def layouts(draw):
    num_axes = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.integers(1, 3)) for _ in range(num_axes))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    axes = list(range(num_axes))
    free = draw(st.permutations(axes))
    spec = []
    for _ in range(ndim):
        take = draw(st.integers(0, min(2, len(free))))
        chosen, free = free[:take], free[take:]
        kind = draw(st.sampled_from(["index", "name"]))
        names = [f"a{a}" if kind == "name" else a for a in chosen]
        if not names:
            spec.append(None)
        elif len(names) == 1 and draw(st.booleans()):
            spec.append(names[0])
        else:
            spec.append(tuple(names))
    return mesh_shape, tuple(f"a{i}" for i in range(num_axes)), shape, tuple(spec)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_each_replica_group_tiles_the_tensor_exactly_once(layout):
    mesh_shape, names, shape, spec = layout
    norm = normalize_spec(spec, names, len(shape))
    reps = replica_axes(norm, len(mesh_shape))
    groups: dict[tuple, np.ndarray] = {}
    for coord in mesh_coords(mesh_shape):
        key = tuple(coord[a] for a in reps)
        cover = groups.setdefault(key, np.zeros(shape, dtype=np.int64))
        box = shard_box(shape, norm, mesh_shape, coord)
        assert all(0 <= o and o + s <= d for o, s, d in zip(box.offsets, box.sizes, shape))
        cover[box.slices()] += 1
    for cover in groups.values():
        assert (cover == 1).all(), "shards overlap or leave a gap"
    assert normalize_spec(spec_to_user(norm, names), names, len(shape)) == norm


def test_tuple_axes_first_axis_major():
    names = ("data", "model")
    norm = normalize_spec((("data", "model"),), names, 1)
    boxes = [shard_box((8,), norm, (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert [b.offsets[0] for b in boxes] == [0, 2, 4, 6]
    norm = normalize_spec((("model", "data"),), names, 1)
    boxes = [shard_box((8,), norm, (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert [b.offsets[0] for b in boxes] == [0, 4, 2, 6]


def test_uneven_dims_give_smaller_and_empty_last_shards():
    norm = normalize_spec(("x",), ("x",), 1)
    sizes = [shard_box((5,), norm, (4,), (i,)).sizes[0] for i in range(4)]
    assert sizes == [2, 2, 1, 0]


def test_box_intersection_and_containment():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (4, 4))
    assert a.intersect(b) == Box((2, 3), (2, 1))
    assert a.intersect(Box((4, 0), (1, 1))) is None
    assert a.contains(Box((1, 1), (2, 2))) and not a.contains(b)
    assert Box((2, 3), (2, 1)).relative_to(b) == (slice(0, 2), slice(0, 1))
    assert Box((), ()).numel == 1  # a 0-d tensor is one element


@pytest.mark.parametrize(
    ("spec", "ndim", "message"),
    [
        (("x",), 2, r"has 1 entries but the tensor has 2 dims"),
        (("nope", None), 2, r"unknown mesh axis 'nope'.*the mesh axes are \('x', 'y'\)"),
        ((5, None), 2, r"mesh axis index 5.*use an index in 0..1"),
        (("x", "x"), 2, r"uses mesh axis 'x' twice \(dims 0 and 1\)"),
        ((("x", "y"), "y"), 2, r"uses mesh axis 'y' twice"),
    ],
)
def test_bad_specs_name_the_value_and_the_fix(spec, ndim, message):
    with pytest.raises(ValueError, match=message):
        normalize_spec(spec, ("x", "y"), ndim)


def test_bad_spec_types():
    with pytest.raises(TypeError, match="one entry per dim"):
        normalize_spec("x", ("x",), 1)
    with pytest.raises(TypeError, match="entry 1.5 of type float is not allowed"):
        normalize_spec((1.5,), ("x",), 1)
