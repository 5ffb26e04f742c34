"""ShardedTensor ops found wrong by a side-by-side audit against plain torch (2026-11-28).

- floor / trunc division of a pending sum rounded each rank's part (silently wrong);
- ``copy_`` from a source that broadcasts cut the source with the destination's spec
  (silently wrong);
- a gather of a 0/1-element shard whose view is not laid out contiguously (``x[:, 2]``
  with one row on a rank) died on that rank and hung the others;
- ``amax`` of a bool tensor with an empty shard died on that rank and hung the others;
- ``vector @ matrix``, ``F.linear`` of a 1-D input: torch's matmul ends in ``squeeze_``,
  which was refused;
- the backward of ``F.linear`` with a weight split unevenly over its columns (3 over 2
  ranks) aborted with a collective mismatch: a transposed view's strides were read off
  each rank's shard, where a one-column shard loses their order, so autograd took
  another path on that rank.

The reference is the same op on the full plain tensors.
"""

import pytest
from harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _cases():
    import numpy as np
    import torch
    import torch.nn.functional as F

    import shardkit.runtime as xr
    import shardkit.spmd as xs

    n = xr.world_size()
    mesh = xs.Mesh(np.arange(n), (n,), ("x",))

    def shard(t, spec):
        return xs.mark_sharding(t.clone(), mesh, spec)

    x = torch.tensor([[1.0, 1.0], [1.0, 2.0]])
    xi = x.long()
    w3 = torch.arange(9.0).reshape(3, 3)
    v, m = torch.arange(3.0), torch.arange(6.0).reshape(3, 2)
    results = {}

    def check(name, got, want):
        got = got.full_tensor() if isinstance(got, xs.ShardedTensor) else got
        results[name] = bool(torch.equal(got, want))

    for mode in ("floor", "trunc"):
        check(f"div_{mode}", torch.div(shard(x, ("x", None)).sum(0), 2, rounding_mode=mode),
              torch.div(x.sum(0), 2, rounding_mode=mode))  # fmt: skip
        check(f"div_{mode}_int", torch.div(shard(xi, ("x", None)).sum(0), 2, rounding_mode=mode),
              torch.div(xi.sum(0), 2, rounding_mode=mode))  # fmt: skip
    src = torch.tensor([10.0, 20.0])
    for name, source in (("plain", src), ("sharded", shard(src, (None,)))):
        dst = shard(torch.zeros(2, 2), ("x", None))
        dst.copy_(source)
        check(f"copy_broadcast_{name}", dst, torch.zeros(2, 2).copy_(src))
    check("narrow_view_gather", shard(w3, ("x", None))[:, 2], w3[:, 2])
    mask = torch.tensor([[True, False, True]])  # one row: an empty shard
    check("bool_amax_empty_shard", shard(mask, ("x", None)).amax(0), mask.amax(0))
    check("bool_amin_empty_shard", shard(mask, ("x", None)).amin(0), mask.amin(0))
    for spec in ((None,), ("x",)):
        check(f"vec_at_mat_{spec}", shard(v, spec) @ m, v @ m)
    check("mat_sharded_vec_in", torch.matmul(v, shard(m, (None, "x"))), v @ m)
    check("linear_1d", F.linear(shard(v, (None,)), shard(m.t(), ("x", None))), F.linear(v, m.t()))
    g = torch.Generator().manual_seed(0)
    xs_, ws_, bs_ = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g), torch.randn(4)
    leaves = [shard(xs_, ("x", None)), shard(ws_, (None, "x")), shard(bs_, (None,))]
    leaves = [t.requires_grad_() for t in leaves]
    plain = [t.clone().requires_grad_() for t in (xs_, ws_, bs_)]
    weight = torch.randn(5, 4, generator=g)
    (F.linear(*leaves).full_tensor() * weight).sum().backward()
    (F.linear(*plain) * weight).sum().backward()
    for name, got, want in zip(("x", "w", "b"), leaves, plain):
        results[f"linear_uneven_grad_{name}"] = bool(
            torch.allclose(got.grad.full_tensor(), want.grad, atol=1e-5)
        )
    table, logits = torch.randn(7, 4), torch.randn(5, 3)

    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the class is what is compared
            return type(exc).__name__
        return None

    for name, fn, ref in (
        ("embedding_oor", lambda: F.embedding(torch.tensor([1, 7]), shard(table, ("x", None))),
         lambda: F.embedding(torch.tensor([1, 7]), table)),
        ("embedding_negative", lambda: F.embedding(torch.tensor([-1]), shard(table, ("x", None))),
         lambda: F.embedding(torch.tensor([-1]), table)),
        ("target_oor", lambda: F.cross_entropy(shard(logits, (None, "x")), torch.tensor([0, 3, 1, 1, 1])),
         lambda: F.cross_entropy(logits, torch.tensor([0, 3, 1, 1, 1]))),
        ("view_bad_size", lambda: shard(torch.arange(15.0), ("x",)).view(4, 4),
         lambda: torch.arange(15.0).view(4, 4)),
        ("reshape_bad_size", lambda: shard(torch.arange(15.0), ("x",)).reshape(7, -1),
         lambda: torch.arange(15.0).reshape(7, -1)),
    ):  # fmt: skip
        got, want = raised(fn), raised(ref)
        results[name] = got == want and want is not None
    sq = shard(torch.ones(1, 4), (None, "x"))
    sq.squeeze_(0)
    results["squeeze_"] = tuple(sq.shape) == (4,) and sq.partition_spec == ("x",)
    return results


def test_audit_cases_match_plain_torch():
    for res in run_ranks(_cases, 2):
        assert res and all(res.values()), {k: v for k, v in res.items() if not v}


def _bmm_2d():
    import numpy as np
    import torch

    import shardkit.spmd as xs

    mesh = xs.Mesh(np.arange(4), (2, 2), ("a", "b"))
    x = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(0))
    w = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(1))
    sx = xs.mark_sharding(x.clone().requires_grad_(), mesh, ("a", "b", None))
    (torch.bmm(sx, sx.transpose(1, 2)).full_tensor() * w).sum().backward()
    px = x.clone().requires_grad_()
    (torch.bmm(px, px.transpose(1, 2)) * w).sum().backward()
    return bool(torch.allclose(sx.grad.full_tensor(), px.grad, atol=1e-5))


def test_uneven_2d_mesh_backward_runs_one_collective_on_every_rank():
    """x (3,5,2) over a 2x2 mesh: the ranks' gradients came out in different local
    layouts, so autograd kept the gradient on some ranks (reduce-scatter) and copied it
    on others (all-reduce), and gloo aborted with a collective mismatch."""
    assert run_ranks(_bmm_2d, 4) == [True] * 4
