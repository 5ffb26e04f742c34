"""DDP.join() on uneven inputs: 3 batches on rank 0, 5 on rank 1, equal weights at the end,
equal to the single-process computation where a joined rank contributes zero gradients."""

import numpy as np
import pytest
import torch
from harness import run_ranks
from torch import nn

BATCHES = (3, 5)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step, rank):
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model, x):
    return model(x).square().mean()


def _body(eval_between):
    import torch.distributed as dist

    from shardkit.ddp import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(BATCHES[rank]):
            if eval_between:  # a forward without backward in between: nothing to shadow
                with torch.no_grad():
                    model(_batch(step, 9))
            opt.zero_grad()
            _loss(model, _batch(step, rank)).backward()
            opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}


def _reference():
    """One process: the average of both ranks' gradients, zero for a rank that has joined."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(BATCHES)):
        grads = []
        for rank in range(2):
            model.zero_grad()
            if step < BATCHES[rank]:
                _loss(model, _batch(step, rank)).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            else:
                grads.append([torch.zeros_like(p) for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return model


@pytest.mark.parametrize("eval_between", [False, True])
def test_join_uneven_batches_end_equal(eval_between):
    r0, r1 = run_ranks(_body, 2, eval_between, timeout=90)
    assert list(r0) == list(r1)
    for k in r0:
        assert np.array_equal(r0[k], r1[k]), k
    ref = _reference().state_dict()
    for name, _ in _model().named_parameters():
        np.testing.assert_allclose(r0[name], ref[name].numpy(), atol=1e-6, rtol=0)
