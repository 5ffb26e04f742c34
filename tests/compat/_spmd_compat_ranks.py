"""The 2-rank bodies of test_spmd_compat.py: shardkit.spmd next to torch DTensor.

``run_all`` runs every case on each rank and returns ``{case: "ok" or what failed}``.
Each case has its own time limit (SIGALRM), so a hang names its case.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import signal
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import shardkit.spmd as xs

CASE_SECONDS = 60


class _CaseTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _CaseTimeout(f"case ran past {CASE_SECONDS}s")


def _dtensor(full, placements):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    return distribute_tensor(full, mesh, placements)


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    dims = [d for d, entry in enumerate(spec) if entry is not None]
    return [Shard(dims[0])] if dims else [Replicate()]


# -- cases ---------------------------------------------------------------------------------
def mesh_attributes():
    ids = np.array([1, 0])
    mesh = xs.Mesh(ids, (2, 1), ("data", "model"))
    assert mesh.device_ids is ids  # kept as given, not reshaped
    assert mesh.device_ids.shape == (2,)
    assert mesh.get_logical_mesh().tolist() == [[1], [0]]
    assert list(mesh.shape().items()) == [("data", 2), ("model", 1)]
    assert mesh.size() == 2 and mesh.get_axis_name_idx("model") == 1
    # rank 1 sits first: it holds the first rows
    st = xs.mark_sharding(torch.arange(4.0), mesh, ("data",))
    rank = torch.distributed.get_rank()
    expected = torch.arange(2.0) + (2 if rank == 0 else 0)
    assert torch.equal(st.local_tensor(), expected), st.local_tensor()
    assert xs.Mesh.from_str(str(mesh)) == mesh


def unnamed_mesh():
    mesh = xs.get_1d_mesh()
    assert mesh.axis_names is None and mesh.shape() == {0: 2}
    st = xs.mark_sharding(torch.arange(6.0).reshape(3, 2), mesh, (0, None))
    assert st.partition_spec == (0, None)
    ref = _dtensor(torch.arange(6.0).reshape(3, 2), _placements((0, None)))
    assert torch.equal(st.local_tensor(), ref.to_local())
    with xs.count_collectives() as counts:
        full = st.full_tensor()
    assert torch.equal(full, torch.arange(6.0).reshape(3, 2))
    assert set(counts.calls) == {("all_gather", (0,))}, dict(counts.calls)


def hybrid_mesh_two_machines():
    # two machines of one rank each: the data axis spans the machines
    old = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        mesh = xs.HybridMesh(
            ici_mesh_shape=(1, 1), dcn_mesh_shape=(2, 1), axis_names=("data", "model")
        )
        assert mesh.mesh_shape == (2, 1) and mesh.get_logical_mesh().tolist() == [[0], [1]]
        try:
            xs.HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(2, 1))
        except AssertionError as exc:
            assert "LOCAL_WORLD_SIZE=1" in str(exc)
        else:
            raise AssertionError("4 ranks on 2 machines of 1 was accepted")
    finally:
        if old is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = old
    one_machine = xs.HybridMesh(ici_mesh_shape=(1, 2), axis_names=("data", "model"))
    assert one_machine.get_logical_mesh().tolist() == [[0, 1]]


_EMPTY_SHAPES = [
    ((1, 4), ("m", None)),  # one row over two ranks
    ((1, 1, 3, 4), (None, "m", None, None)),  # one kv head
    ((3,), ("m",)),  # 2 + 1
    ((0, 3), ("m", None)),  # nothing at all
    ((2, 1), (None, "m")),
]


def empty_shards_like_dtensor():
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    for shape, spec in _EMPTY_SHAPES:
        full = torch.arange(float(np.prod(shape))).reshape(shape)
        st = xs.mark_sharding(full, mesh, spec)
        ref = _dtensor(full, _placements(spec))
        local = st.local_tensor()
        assert local.shape == ref.to_local().shape, (shape, local.shape, ref.to_local().shape)
        assert torch.equal(local, ref.to_local()), shape
        assert torch.equal(st.full_tensor(), ref.full_tensor()), shape
        again = xs.ShardedTensor.from_local(local.clone(), mesh, spec, shape)
        assert torch.equal(again.full_tensor(), full)


def reshard_like_dtensor():
    from torch.distributed.tensor import Replicate, Shard

    mesh = xs.Mesh([0, 1], (2,), ("m",))
    specs = {
        (None, None): [Replicate()],
        ("m", None): [Shard(0)],
        (None, "m"): [Shard(1)],
    }
    for shape in ((1, 3), (3, 1), (5, 3), (1, 1), (2, 0)):
        full = torch.arange(float(np.prod(shape))).reshape(shape)
        for src, src_p in specs.items():
            for dst, dst_p in specs.items():
                moved = xs.mark_sharding(full, mesh, src).redistribute(dst)
                ref = _dtensor(full, src_p).redistribute(placements=dst_p)
                assert torch.equal(moved.local_tensor(), ref.to_local()), (shape, src, dst)


def ops_on_empty_shards():
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    torch.manual_seed(0)
    w, x = torch.randn(1, 4), torch.randn(3, 4)
    sw = xs.mark_sharding(w.clone().requires_grad_(), mesh, ("m", None))
    ref_w = w.clone().requires_grad_()
    checks = [
        (lambda a: F.linear(x, a), None),
        (lambda a: a.sum(0), None),
        (lambda a: a.softmax(0), None),
        (lambda a: a.mean(), None),
        (lambda a: (a.t() @ a).sum(), None),
        (lambda a: F.layer_norm(a, (4,)), None),
        (lambda a: a.reshape(2, 2) * 2, None),
        (lambda a: torch.cat([a, a], 0), None),
    ]
    for i, (fn, _) in enumerate(checks):
        out = fn(sw)
        ref = fn(ref_w)
        got = out.full_tensor() if isinstance(out, xs.ShardedTensor) else out
        assert torch.allclose(got, ref, atol=1e-6), (i, got, ref)
    # DTensor on the same empty shard: sum and mean agree
    dt = _dtensor(w, _placements(("m", None)))
    assert torch.allclose(sw.sum().full_tensor(), dt.sum().full_tensor())
    loss = F.linear(x, sw).square().mean()
    loss.full_tensor().backward()
    F.linear(x, ref_w).square().mean().backward()
    assert torch.allclose(sw.grad.full_tensor(), ref_w.grad, atol=1e-6)
    assert sw.grad.local_tensor().shape == sw.local_tensor().shape


def attention_one_kv_head():
    """Multi-query attention: one kv head over 2 ranks used to kill a rank (SIGFPE)."""
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    head = (None, "m", None, None)
    for gqa_q in (q, k):
        leaves = [t.clone().requires_grad_() for t in (gqa_q, k, v)]
        refs = [t.clone().requires_grad_() for t in (gqa_q, k, v)]
        sts = [xs.mark_sharding(t, mesh, head) for t in leaves]
        out = F.scaled_dot_product_attention(*sts, enable_gqa=True)
        ref = F.scaled_dot_product_attention(*refs, enable_gqa=True)
        assert torch.allclose(out.full_tensor(), ref, atol=1e-6)
        out.sum().full_tensor().backward()
        ref.sum().backward()
        for st, r in zip(sts, refs):
            assert torch.allclose(st.grad.full_tensor(), r.grad, atol=1e-6)


def local_shards_and_global_tensor():
    rank = torch.distributed.get_rank()
    mesh = xs.Mesh([0, 1], (2, 1), ("data", "model"))
    full = torch.arange(15.0).reshape(5, 3)
    st = xs.mark_sharding(full, mesh, ("data", None))
    assert st.mesh_shape == (2, 1)
    assert st.sharding_type is xs.ShardingType.TILED
    assert torch.equal(st.global_tensor, full)
    (shard,) = st.local_shards
    assert shard.data.shape == (3, 3)  # padded to the largest shard, as XLA pads
    rows = slice(0, 3) if rank == 0 else slice(3, 5)
    assert shard.indices == [rows, slice(0, 3)], shard.indices
    ref = _dtensor(full, _placements(("data", None)))
    assert torch.equal(shard.unpadded_data, ref.to_local())
    assert shard.shard_device == f"CPU:{rank}" and shard.replica_id == 0
    st.load_local_shards_([xs.XLAShard(shard.data * 10, shard.indices, "CPU:0", 0)])
    assert torch.equal(st.global_tensor, full * 10)
    replicated = xs.mark_sharding(full, mesh, (None, None))
    assert replicated.sharding_type is xs.ShardingType.REPLICATED
    (rshard,) = replicated.local_shards
    assert rshard.indices is Ellipsis and rshard.replica_id == rank
    partial = xs.mark_sharding(full, xs.Mesh([0, 1], (1, 2), ("data", "model")), ("data", None))
    assert partial.sharding_type is xs.ShardingType.PARTIAL
    assert partial.local_shards[0].replica_id == rank


def mark_sharding_with_gradients():
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    torch.manual_seed(2)
    x = torch.randn(4, 3)
    leaf = x.clone().requires_grad_()
    st = xs.mark_sharding(leaf, mesh, (None, None))
    marked = xs.mark_sharding_with_gradients(st * 2, mesh, ("m", None))
    assert marked.partition_spec == ("m", None)
    grads = {}
    marked.register_hook(lambda g: grads.setdefault("g", g))
    (marked.square()).sum().full_tensor().backward()
    assert grads["g"].partition_spec == ("m", None)
    assert torch.allclose(st.grad.full_tensor(), 8 * x)
    plain = x.clone().requires_grad_()
    out = xs.mark_sharding_with_gradients(plain, mesh, ("m", None))
    out.sum().full_tensor().backward()
    assert type(plain.grad) is torch.Tensor and torch.equal(plain.grad, torch.ones(4, 3))


def _mixed_model(mesh):
    """Plain layers first (upstream of every sharded op), then a column-sharded Linear, a
    plain Linear and a LayerNorm with a replicated ShardedTensor weight."""
    torch.manual_seed(3)
    ref = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 6),
        torch.nn.ReLU(),
        torch.nn.Linear(6, 3),
        torch.nn.LayerNorm(3),
    )
    model = copy.deepcopy(ref)
    model[2].weight = xs.mark_sharding(model[2].weight, mesh, ("m", None))
    model[2].bias = xs.mark_sharding(model[2].bias, mesh, ("m",))
    model[5].weight = xs.mark_sharding(model[5].weight, mesh, (None,))  # replicated ST
    return ref, model


def adamw_mixed_params_no_collectives():
    """Only some parameters sharded: the AdamW step itself communicates nothing."""
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    for foreach in (False, True):
        r, m = _mixed_model(mesh)
        # gradients agree to ~1e-7 (sums in another order); some are ~1e-7 themselves,
        # and Adam's g / (sqrt(v) + eps) amplifies that by lr / eps per step, then training
        # feeds it back: a larger eps and a small lr keep the comparison about the step
        # (measured: <= 5e-6 after 3 steps). Bit-exactness given equal gradients: next case.
        opts = [
            torch.optim.AdamW(p.parameters(), lr=0.01, eps=1e-3, foreach=foreach) for p in (m, r)
        ]
        for _ in range(3):
            m(x).square().mean().full_tensor().backward()
            r(x).square().mean().backward()
            for p in m.parameters():
                kind = xs.ShardedTensor if isinstance(p, xs.ShardedTensor) else torch.Tensor
                assert type(p.grad) is kind, (type(p), type(p.grad))
            with xs.count_collectives() as counts:
                opts[0].step()
            assert counts.total_calls() == 0 and not counts.fallbacks, (
                foreach,
                dict(counts.calls),
                dict(counts.fallbacks),
            )
            opts[1].step()
            for o in opts:
                o.zero_grad()
        for p, q in zip(m.parameters(), r.parameters()):
            got = p.full_tensor() if isinstance(p, xs.ShardedTensor) else p
            assert torch.allclose(got, q, atol=2e-5), float((got - q).abs().max())


def adamw_mixed_params_exact():
    """Given the same gradients, the sharded/replicated/plain step is torch's, bit for bit."""
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    gen = torch.Generator().manual_seed(5)
    for foreach in (False, True):
        r, m = _mixed_model(mesh)
        opts = [
            torch.optim.AdamW(p.parameters(), lr=0.05, weight_decay=0.1, foreach=foreach)
            for p in (m, r)
        ]
        for _ in range(3):
            for p, q in zip(m.parameters(), r.parameters()):
                g = torch.randn(q.shape, generator=gen)
                q.grad = g.clone()
                if isinstance(p, xs.ShardedTensor):
                    p.grad = xs.mark_sharding(g.clone(), mesh, p.partition_spec)
                else:
                    p.grad = g.clone()
            with xs.count_collectives() as counts:
                opts[0].step()
            opts[1].step()
            assert counts.total_calls() == 0 and not counts.fallbacks
        for p, q in zip(m.parameters(), r.parameters()):
            got = p.full_tensor() if isinstance(p, xs.ShardedTensor) else p
            assert torch.equal(got, q), (foreach, (got - q).abs().max())


def empty_matrix():
    """Every case of the dist op matrix with each sharded size shrunk to 1."""
    import test_spmd_rules_cases as matrix

    out = {}
    for mesh_shape in ((2, 1), (1, 2)):
        mesh = xs.Mesh(np.arange(2), mesh_shape, (matrix.D, matrix.M))
        for name, (inputs, fn) in matrix.CASES.items():
            shrunk = _shrink(inputs, mesh_shape)
            if shrunk is None or not _torch_accepts(shrunk, fn):
                continue
            key = f"{name}@{mesh_shape}"
            saved = matrix.CASES[name]
            matrix.CASES[name] = (shrunk, fn)
            try:
                fwd, grad, layout_ok, _ = matrix.run_case(mesh, name)
                out[key] = (
                    "ok" if fwd < 1e-5 and grad < 1e-5 and layout_ok else (fwd, grad, layout_ok)
                )
            except Exception as exc:
                out[key] = f"{type(exc).__name__}: {exc}"
            finally:
                matrix.CASES[name] = saved
    return out


def _shrink(inputs, mesh_shape):
    """Shrink every size that some input shards over an axis of size 2 to 1, consistently
    across inputs (sizes are matched by value), so one rank holds an empty shard."""
    names = ("data", "model")
    big = {names[i] for i, n in enumerate(mesh_shape) if n > 1}
    sizes = set()
    for entry in inputs:
        shape, spec = entry[0], entry[1]
        for n, s in zip(shape, spec):
            axes = s if isinstance(s, tuple) else (s,)
            if any(a in big for a in axes):
                sizes.add(n)
    if not sizes:
        return None
    return [
        (tuple(1 if n in sizes else n for n in entry[0]),) + tuple(entry[1:])
        if len(entry) == 2
        else (tuple(1 if n in sizes else n for n in entry[0]), entry[1], entry[2], 1)
        for entry in inputs
    ]


def _torch_accepts(inputs, fn):
    try:
        made = [
            torch.zeros(e[0], dtype=torch.long) if len(e) > 2 else torch.randn(e[0]) for e in inputs
        ]
        fn(*made)
        return True
    except Exception:
        return False


def plain_state_sharded_grad():
    """A plain (whole) optimizer state updated in place from a sharded gradient, as after
    loading a plain optimizer state dict: one gather for the gradient, no fallback."""
    mesh = xs.Mesh([0, 1], (2,), ("m",))
    torch.manual_seed(6)
    g, buf, sq = torch.randn(3, 4), torch.randn(3, 4), torch.rand(3, 4)
    sg = xs.mark_sharding(g, mesh, ("m", None))
    mine, ref = (buf.clone(), sq.clone()), (buf.clone(), sq.clone())
    with xs.count_collectives() as counts:
        mine[0].lerp_(sg, 0.1)
        mine[1].mul_(0.9).addcmul_(sg, sg, value=0.1)
    ref[0].lerp_(g, 0.1)
    ref[1].mul_(0.9).addcmul_(g, g, value=0.1)
    assert type(mine[0]) is torch.Tensor and type(mine[1]) is torch.Tensor
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])
    assert dict(counts.calls) == {("all_gather", ("m",)): 1}, dict(counts.calls)
    assert not counts.fallbacks, dict(counts.fallbacks)


CASES = [
    mesh_attributes,
    unnamed_mesh,
    hybrid_mesh_two_machines,
    empty_shards_like_dtensor,
    reshard_like_dtensor,
    ops_on_empty_shards,
    attention_one_kv_head,
    local_shards_and_global_tensor,
    mark_sharding_with_gradients,
    adamw_mixed_params_no_collectives,
    adamw_mixed_params_exact,
    plain_state_sharded_grad,
]


def run_all() -> dict:
    results = {}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    # a rank stuck inside a collective never returns to Python for SIGALRM: print every
    # thread's stack to stderr instead, so the hung case is named
    faulthandler.dump_traceback_later(5 * CASE_SECONDS)
    try:
        for case in CASES:
            signal.alarm(CASE_SECONDS)
            try:
                case()
                results[case.__name__] = "ok"
            except Exception:
                results[case.__name__] = traceback.format_exc(limit=4)
            finally:
                signal.alarm(0)
        signal.alarm(3 * CASE_SECONDS)
        try:
            results["empty_matrix"] = empty_matrix()
        except Exception:
            results["empty_matrix"] = traceback.format_exc(limit=4)
        finally:
            signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
    return results
