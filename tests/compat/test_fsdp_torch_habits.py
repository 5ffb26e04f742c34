"""FSDP with habits of code moved over from torch FSDP, found side by side with torch's
FSDP2 and DDP (2026-11-29):

- ``no_sync()`` gradients outlived ``zero_grad()`` (a skipped micro-batch was carried
  into the next step), where DDP and FSDP1 drop them;
- a full state dict whose head has another size (another ``num_labels``) loaded silently
  on the rank whose rows happen to have that size, and failed on the other with its
  local shape: the ranks parted ways;
- a ``torch.no_grad()`` forward of the model between a checkpointed forward and its
  backward (targets, a teacher) made the recomputation fail;
- a full optimizer state dict loaded into a fresh optimizer crashed its first step;
- FSDP2's ``set_requires_gradient_sync`` was missing, and a missing torch method raised
  an AttributeError about the user's model class.

References: the same plain model in one process on the whole batch.
"""

import copy

import pytest
import torch
from fsdp_models import Stack, wrap_fsdp
from harness import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(240)
WORLD = 2


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y, rank=None):
    if rank is not None:  # this rank's half of the global batch
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    return (model(x) - y).square().mean()


def _rows_equal(model, reference: dict, what: str) -> bool:
    """Each shard's ``what`` ("grad" or "data") equals its rows of the plain model's."""
    for name, p in model.named_parameters():
        layout, rank, _world = p._shardkit_fsdp_rows
        want = layout.shard_of(reference[name.replace("module.", "")], rank)
        got = getattr(p, what)
        if got is None or not torch.allclose(got, want, atol=1e-6):
            return False
    return True


def _no_sync_body(zero: str, nested: bool):
    import torch.distributed as dist

    from shardkit.fsdp import FSDPUsageError

    rank = dist.get_rank()
    (x1, y1), (x2, y2) = _batches(2)
    plain = Stack()
    _loss(plain, x2, y2).backward()  # the reference: the last batch only
    want = {n: p.grad for n, p in plain.named_parameters()}
    model = wrap_fsdp(Stack(), nested)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.no_sync():
        _loss(model, x1, y1, rank).backward()
    shown = [tuple(p.grad.shape) == tuple(p.shape) for p in model.parameters()]
    if zero == "optimizer":
        opt.zero_grad()
    elif zero == "optimizer, not to None":
        opt.zero_grad(set_to_none=False)
    elif zero == "model":
        model.zero_grad()
    elif zero == "scaled in place":
        for p in model.parameters():
            p.grad.mul_(0.5)
    try:
        _loss(model, x2, y2, rank).backward()
        refused = None
    except FSDPUsageError as exc:
        refused = str(exc)
    if zero == "kept":  # no zero_grad: the sum of both batches, as DDP
        plain.zero_grad()
        (_loss(plain, x1, y1) + _loss(plain, x2, y2)).backward()
        want = {n: p.grad for n, p in plain.named_parameters()}
    return {"shown": all(shown), "refused": refused, "same": _rows_equal(model, want, "grad")}


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("zero", ["optimizer", "optimizer, not to None", "model", "kept"])
def test_zero_grad_after_no_sync_drops_the_accumulated_gradients_as_ddp(zero, nested):
    for r in run_ranks(_no_sync_body, WORLD, zero, nested):
        # inside no_sync each shard's .grad shows its rows of the local sum
        assert r == {"shown": True, "refused": None, "same": True}, r


def test_changing_no_sync_gradients_in_place_is_refused():
    for r in run_ranks(_no_sync_body, WORLD, "scaled in place", True):
        assert "changed in place after a no_sync() backward" in r["refused"], r


def _gradient_sync_switch_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    batches = _batches(2)
    plain = Stack()
    sum(_loss(plain, x, y) for x, y in batches).backward()
    model = wrap_fsdp(Stack(), True)
    model.set_requires_gradient_sync(False)
    _loss(model, *batches[0], rank).backward()
    model.set_requires_gradient_sync(True)
    _loss(model, *batches[1], rank).backward()
    try:
        model.unshard()
        missing = None
    except AttributeError as exc:
        missing = str(exc)
    want = {n: p.grad for n, p in plain.named_parameters()}
    return {"same": _rows_equal(model, want, "grad"), "missing": missing}


def test_set_requires_gradient_sync_accumulates_as_fsdp2_and_missing_methods_say_so():
    for r in run_ranks(_gradient_sync_switch_body, WORLD):
        assert r["same"], r
        assert "shardkit's FSDP has no unshard() (torch FSDP's)" in r["missing"], r


class _TwoLabelStack(Stack):
    """Stack with a 2-row head: its full (2, 6) weight has the shape of rank 0's rows
    of Stack's (3, 6) head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 2)


def _wrong_head_body():
    model = wrap_fsdp(Stack(), False)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        model.load_state_dict(_TwoLabelStack().state_dict())
        error = None
    except RuntimeError as exc:
        error = str(exc)
    rows_kept = torch.equal(model.module.proj.weight, before[-2])
    return {"error": error, "rows_kept": rows_kept}


def test_a_full_state_dict_with_a_head_of_another_size_is_refused_on_every_rank():
    for r in run_ranks(_wrong_head_body, WORLD):
        # as torch: the size mismatch with the parameter's global shape, no missing key
        assert "size mismatch for module.proj.weight: copying a param with shape " in r["error"]
        assert "torch.Size([2, 6]) from checkpoint, the shape in current model is " in r["error"]
        assert "torch.Size([3, 6])" in r["error"], r
        assert "Missing key" not in r["error"], r
        assert r["rows_kept"], r


def _no_grad_between_body():
    import torch.distributed as dist

    from shardkit.fsdp import FSDP, checkpoint_module

    rank = dist.get_rank()
    (x, _), (x2, _) = _batches(2)
    plain = Stack()
    out = plain(x)
    with torch.no_grad():
        target = plain(x2)
    (out - target).square().mean().backward()
    model = wrap_fsdp(
        Stack(), True, auto_wrapper_callable=lambda m, **kw: FSDP(checkpoint_module(m), **kw)
    )
    out = model(x.chunk(WORLD)[rank])
    with torch.no_grad():  # the targets come from the same model
        target = model(x2.chunk(WORLD)[rank])
    (out - target).square().mean().backward()
    return _rows_equal(model, {n: p.grad for n, p in plain.named_parameters()}, "grad")


def test_a_no_grad_forward_between_a_checkpointed_forward_and_its_backward():
    assert run_ranks(_no_grad_between_body, WORLD) == [True] * WORLD


def _fresh_optimizer_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    batches = _batches(2)
    plain = Stack()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _loss(plain, *batches[0]).backward()
    plain_opt.step()
    saved_model = copy.deepcopy(plain.state_dict())
    saved_opt = copy.deepcopy(plain_opt.state_dict())
    model = wrap_fsdp(Stack(seed=5), True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)  # full tensors, before this optimizer ever stepped
    for m, o, r in ((plain, plain_opt, None), (model, opt, rank)):
        o.zero_grad()
        _loss(m, *batches[1], r).backward()
        o.step()
    return _rows_equal(model, {n: p.detach() for n, p in plain.named_parameters()}, "data")


def test_a_full_optimizer_state_dict_loads_into_an_optimizer_that_never_stepped():
    assert run_ranks(_fresh_optimizer_body, WORLD) == [True] * WORLD
