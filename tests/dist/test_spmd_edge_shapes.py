"""SPMD reductions on edge shapes and dtypes, at an odd world size (found 2026-11-29):

- fp16/bf16 ``sum``/``mean`` over a sharded dim rounded each rank's partial sum, up to
  ten times torch's error; torch accumulates in fp32 and rounds once;
- ``mean`` of an integer tensor returned float32 where torch refuses;
- ``amax``/``amin``/``max()``/the inf-norm over a dim of global size 0 returned the
  shard-local identity (+-inf) where torch refuses;
- ``mse_loss`` backward on an empty batch divided by zero.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks

import shardkit.spmd as xs

pytestmark = pytest.mark.timeout(180)
WORLD = 3


def _mesh():
    return xs.Mesh(np.arange(WORLD), (WORLD,), ("x",))


def _half_sum_body():
    mesh, out = _mesh(), []
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for _ in range(5):
            t = torch.randn(301, 8).to(dtype)
            st = xs.mark_sharding(t, mesh, ("x", None))
            got_sum, got_mean = st.sum(0).full_tensor(), st.mean(0).full_tensor()
            out.append(got_sum.dtype == dtype and torch.equal(got_sum, t.sum(0)))
            out.append(got_mean.dtype == dtype and torch.equal(got_mean, t.mean(0)))
    return out


def test_half_precision_sums_over_sharded_rows_round_once_as_torch():
    assert run_ranks(_half_sum_body, WORLD) == [[True] * 20] * WORLD


def _refusal(fn, t):
    try:
        fn(t)
    except Exception as exc:  # noqa: BLE001 - the class is the result
        return type(exc).__name__
    return "no error"


def _torch_refusals_body():
    mesh, out = _mesh(), []
    cases = [
        (lambda a: a.mean(0), torch.arange(14).reshape(7, 2)),
        (lambda a: a.mean(), torch.arange(14).reshape(7, 2)),
        (lambda a: a.amax(0), torch.zeros(0, 4)),
        (lambda a: a.amin(0), torch.zeros(0, 4)),
        (lambda a: a.max(), torch.zeros(0, 4)),
        (lambda a: torch.linalg.vector_norm(a, float("inf")), torch.zeros(0, 4)),
    ]
    for fn, t in cases:
        expected = _refusal(fn, t)
        got = _refusal(fn, xs.mark_sharding(t.clone(), mesh, ("x", None)))
        out.append((expected, got))
    return out


def test_reductions_torch_refuses_are_refused_with_its_exception_class():
    results = run_ranks(_torch_refusals_body, WORLD)
    for pairs in results:
        expected = [e for e, _ in pairs]
        assert "no error" not in expected
        assert [g for _, g in pairs] == expected


def _empty_mse_body():
    mesh = _mesh()
    x = xs.mark_sharding(torch.zeros(0, 5), mesh, ("x", None)).requires_grad_()
    F.mse_loss(x, xs.mark_sharding(torch.zeros(0, 5), mesh, ("x", None))).backward()
    return list(x.grad.shape)


def test_mse_loss_backward_on_an_empty_batch_gives_an_empty_gradient():
    assert run_ranks(_empty_mse_body, WORLD) == [[0, 5]] * WORLD
