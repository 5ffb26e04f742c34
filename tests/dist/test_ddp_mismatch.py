"""Ranks whose DDP setups disagree raise a clear error on every rank at construction
(the diverging-ranks audit): parameters registered in another order (same shapes: the
averages mixed different parameters), a frozen parameter of another shape, and a
``bucket_cap_mb`` that cuts the gradients differently (gloo aborted the process)."""

from harness import run_ranks


def _two(swap=False, frozen_rows=4):
    import torch
    from torch import nn

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            if swap:
                self.b = nn.Linear(4, 4)
                self.a = nn.Linear(4, 4)
            else:
                self.a = nn.Linear(4, 4)
                self.b = nn.Linear(4, 4)
            self.frozen = nn.Parameter(torch.ones(frozen_rows, 2), requires_grad=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    return Two()


def _attempt(build, **kwargs):
    from shardkit.ddp import DistributedDataParallel as DDP
    from shardkit.ddp._errors import ModelMismatchError

    try:
        ddp = DDP(build(), **kwargs)
    except (ModelMismatchError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    import torch

    ddp(torch.randn(3, 4)).sum().backward()  # the buckets' all-reduces match
    return "ok", None


def _cases(_):
    import torch.distributed as dist

    rank = dist.get_rank()
    return {
        "order": _attempt(lambda: _two(swap=rank == 1)),
        "frozen shape": _attempt(lambda: _two(frozen_rows=4 + rank)),
        "bucket cap": _attempt(_two, bucket_cap_mb=25 if rank == 0 else 0.00005),
        # caps that differ but cut these small gradients the same way change nothing
        "same buckets": _attempt(_two, bucket_cap_mb=25 if rank == 0 else 30),
        "same model": _attempt(_two),
        # every parameter frozen on rank 1 alone: refused there, and the other rank must
        # learn of it rather than wait in the check (it hung until the gloo timeout)
        "nothing on one rank": _attempt(lambda: _frozen_on(rank == 1)),
        # buffers broadcast at forward on one rank only paired that broadcast with the
        # other rank's gradient all-reduce (a hang); find_unused's pass likewise
        "broadcast_buffers": _attempt(_two, broadcast_buffers=rank == 0),
        "find_unused": _attempt(_two, find_unused_parameters=rank == 1),
    }


def _frozen_on(this_rank: bool):
    model = _two()
    if this_rank:
        model.requires_grad_(False)
    return model


def test_rank_disagreements_raise_on_every_rank_naming_the_difference():
    for res in run_ranks(_cases, 2, None, timeout=90):
        kind, msg = res["order"]
        assert kind == "ModelMismatchError", res
        assert "differs (rank 0: a.weight (4, 4) float32, rank 1: b.weight (4, 4) float32)" in msg
        kind, msg = res["frozen shape"]
        assert kind == "ModelMismatchError", res
        assert "rank 0: frozen (4, 2) float32 frozen, rank 1: frozen (5, 2) float32 frozen" in msg
        kind, msg = res["bucket cap"]
        assert kind == "ValueError", res
        assert "bucket_cap_mb differs between the ranks (rank 0: 25, rank 1: 5e-05)" in msg
        assert res["same buckets"] == ("ok", None)
        kind, msg = res["broadcast_buffers"]
        assert kind == "ValueError", res
        assert "forward_sync_buffers differs between the ranks (rank 0: True, rank 1: False)" in msg
        kind, msg = res["find_unused"]
        assert kind == "ValueError", res
        assert "find_unused_parameters differs between the ranks (rank 0: False, rank 1: True)" in msg
        kind, msg = res["nothing on one rank"]
        assert kind == "ModelMismatchError" and "a.weight (4, 4) float32 frozen" in msg, res
        assert res["same model"] == ("ok", None)


def _hooks(_):
    import torch
    import torch.distributed as dist

    from shardkit.ddp import DistributedDataParallel as DDP
    from shardkit.ddp._errors import CommHookError
    from shardkit.ddp.comm_hooks import default_hooks as dh
    from shardkit.ddp.comm_hooks import powerSGD_hook as ps

    one = dist.get_rank() == 1

    def attempt(register):
        ddp = DDP(_two())
        register(ddp)
        try:
            ddp(torch.randn(3, 4)).sum().backward()
        except CommHookError as exc:
            return "CommHookError", str(exc)
        return "ok", None

    def powersgd(rank):
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=rank)
        return lambda ddp: ddp.register_comm_hook(state, ps.powerSGD_hook)

    return {
        # fp16 on one rank, bf16 on the other: the sum mixed the formats' bits silently
        "fp16 vs bf16": attempt(
            lambda ddp: ddp.register_comm_hook(
                None, dh.bf16_compress_hook if one else dh.fp16_compress_hook
            )
        ),
        # PowerSGD ranks that differ aborted the process in gloo
        "powersgd rank": attempt(powersgd(2 if one else 1)),
        "hook on one rank": attempt(
            lambda ddp: one and ddp.register_comm_hook(None, dh.fp16_compress_hook)
        ),
        "same hook": attempt(powersgd(1)),
    }


def test_communication_hooks_that_differ_raise_at_the_first_forward():
    for res in run_ranks(_hooks, 2, None, timeout=90):
        kind, msg = res["fp16 vs bf16"]
        assert kind == "CommHookError" and "fp16_compress_hook" in msg, res
        assert "bf16_compress_hook" in msg, msg
        kind, msg = res["powersgd rank"]
        assert kind == "CommHookError" and "'matrix_approximation_rank': 2" in msg, res
        kind, msg = res["hook on one rank"]
        assert kind == "CommHookError" and "{'hook': None}" in msg, res
        assert res["same hook"] == ("ok", None), res


def _rank0_forwards_first(_):
    import copy

    import torch
    import torch.distributed as dist

    from shardkit.ddp import DistributedDataParallel as DDP

    ddp = DDP(_two())
    if dist.get_rank() == 0:  # a sample printed on rank 0 alone, and an evaluation copy
        with torch.no_grad():
            ddp(torch.randn(2, 4))
        copy.deepcopy(ddp)(torch.randn(2, 4))
    dist.barrier()
    ddp(torch.randn(3, 4)).sum().backward()  # the first synced step, on every rank
    return [p.grad.sum().item() for p in ddp.parameters() if p.requires_grad]


def test_a_forward_on_one_rank_alone_before_training_is_fine():
    """The hook comparison runs at the first forward that syncs gradients; it ran at any
    first forward, so a no_grad forward or a copy's forward on rank 0 alone hung there
    (found by a false-positive hunt)."""
    grads = run_ranks(_rank0_forwards_first, 2, None, timeout=90)
    assert grads[0] == grads[1]
