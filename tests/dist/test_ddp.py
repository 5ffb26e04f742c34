"""shardkit DDP against torch DDP, one process on the global batch, and torch's hooks."""

import pytest
from harness import run_ranks

ATOL = 1e-6


def _model(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 64), nn.LayerNorm(64),
        nn.Linear(64, 24), nn.Tanh(), nn.Linear(24, 5),
    )  # fmt: skip


class _Branchy:
    """Built lazily so the module only exists inside the rank processes."""

    @staticmethod
    def make(seed=0):
        import torch
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.trunk = nn.Linear(8, 8)
                self.sometimes = nn.Linear(8, 8)
                self.never = nn.Linear(8, 3)
                self.head = nn.Linear(8, 3)

            def forward(self, x, use_branch):
                h = torch.tanh(self.trunk(x))
                if use_branch:
                    h = h + self.sometimes(h)
                return self.head(h)

        torch.manual_seed(seed)
        return Branchy()


def _data(world, step, per_rank=6):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * per_rank, 16, generator=g)
    y = torch.randint(0, 5, (world * per_rank,), generator=g)
    return x, y


def _grads(m):
    return [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]


def _close(a, b, atol, what):
    import torch

    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}: grad {i} None mismatch"
        if x is not None:
            torch.testing.assert_close(
                x, y, atol=atol, rtol=atol, msg=lambda m, i=i: f"{what}[{i}] {m}"
            )


def _step_grads(ddp_model, x, y):
    import torch.nn.functional as F

    ddp_model.zero_grad(set_to_none=True)
    F.cross_entropy(ddp_model(x), y).backward()
    return _grads(ddp_model.module)


def _body_parity(world):
    import torch
    import torch.distributed as dist
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as th
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from shardkit.ddp import DistributedDataParallel as DDP
    from shardkit.ddp.comm_hooks import debugging_hooks
    from shardkit.ddp.comm_hooks import default_hooks as sh

    rank = dist.get_rank()
    sl = slice(rank * 6, (rank + 1) * 6)
    report = {}

    # 1. no hook: torch DDP, one process on the global batch, several optimizer steps.
    ours, theirs, single = DDP(_model(), bucket_cap_mb=0.005), TorchDDP(_model()), _model()
    sizes = [b.buffer.numel() for b in ours.reducer.buckets]
    report["bucket_sizes"] = sizes
    assert len(sizes) >= 3 and len(set(sizes)) == len(sizes), sizes
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs, single)]
    for step in range(3):
        x, y = _data(world, step)
        g_ours = _step_grads(ours, x[sl], y[sl])
        g_torch = _step_grads(theirs, x[sl], y[sl])
        single.zero_grad()
        F.cross_entropy(single(x), y).backward()
        _close(g_ours, g_torch, ATOL, f"no hook vs torch DDP step {step}")
        _close(g_ours, _grads(single), ATOL, f"no hook vs single process step {step}")
        for o in opts:
            o.step()
    _close(list(ours.parameters()), list(single.parameters()), 1e-5, "params after steps")

    # 2. every default hook, in shardkit DDP and torch DDP, against torch's own hook.
    x, y = _data(world, 7)
    cases = [
        ("allreduce", sh.allreduce_hook, th.allreduce_hook, ATOL),
        ("fp16", sh.fp16_compress_hook, th.fp16_compress_hook, 1e-3),
        ("bf16", sh.bf16_compress_hook, th.bf16_compress_hook, 1e-3),
        ("fp16_wrapper", sh.fp16_compress_wrapper(sh.allreduce_hook), th.fp16_compress_hook, 1e-3),
        ("bf16_wrapper", sh.bf16_compress_wrapper(sh.allreduce_hook), th.bf16_compress_hook, 1e-3),
    ]
    for name, hook, torch_hook, tol in cases:
        ref = TorchDDP(_model())
        try:
            ref.register_comm_hook(None, torch_hook)
            g_ref = _step_grads(ref, x[sl], y[sl])
            report[f"torch_{name}_on_gloo"] = "ran"
        except TypeError as exc:  # torch's DDP refuses its own bf16 hook on gloo:
            report[f"torch_{name}_on_gloo"] = f"refused: {exc}"  # run it in ours instead
            ref = DDP(_model())
            ref.register_comm_hook(None, torch_hook)
            g_ref = _step_grads(ref, x[sl], y[sl])
        for wrapper in (DDP, TorchDDP):
            model = wrapper(_model())
            model.register_comm_hook(None, hook)
            _close(_step_grads(model, x[sl], y[sl]), g_ref, tol, f"{name} in {wrapper.__name__}")
    for wrapper in (DDP, TorchDDP):
        model = wrapper(_model())
        model.register_comm_hook(None, debugging_hooks.noop_hook)
        local = _model()
        F.cross_entropy(local(x[sl]), y[sl]).backward()
        _close(_step_grads(model, x[sl], y[sl]), _grads(local), ATOL, "noop hook")

    # 3. no_sync: local accumulation, then one synced backward averages the sum.
    for as_view in (False, True):
        model, local = DDP(_model(), bucket_cap_mb=0.005, gradient_as_bucket_view=as_view), _model()
        single = _model()
        batches = [_data(world, 20 + k) for k in range(3)]
        with model.no_sync():
            for bx, by in batches[:2]:
                F.cross_entropy(model(bx[sl]), by[sl]).backward()
                F.cross_entropy(local(bx[sl]), by[sl]).backward()
        _close(_grads(model.module), _grads(local), ATOL, "inside no_sync")
        bx, by = batches[2]
        F.cross_entropy(model(bx[sl]), by[sl]).backward()
        for bx, by in batches:
            F.cross_entropy(single(bx), by).backward()
        _close(_grads(model.module), _grads(single), ATOL, f"after no_sync (view={as_view})")

    # 4. gradient_as_bucket_view: same grads as torch, and .grad lives in the bucket.
    ours = DDP(_model(), bucket_cap_mb=0.005, gradient_as_bucket_view=True)
    theirs = TorchDDP(_model(), gradient_as_bucket_view=True)
    for step in range(2):
        x, y = _data(world, 30 + step)
        _close(_step_grads(ours, x[sl], y[sl]), _step_grads(theirs, x[sl], y[sl]), ATOL, "view")
    bucket_ptrs = {v.data_ptr() for b in ours.reducer.buckets for v in b.views}
    assert all(p.grad.data_ptr() in bucket_ptrs for p in ours.parameters())

    # 5. unused parameters: used on rank 0 only, and used nowhere.
    for step in range(2):
        ours = DDP(_Branchy.make(), find_unused_parameters=True)
        theirs = TorchDDP(_Branchy.make(), find_unused_parameters=True)
        xb = torch.randn(4, 8, generator=torch.Generator().manual_seed(50 + rank))
        use = rank == 0 if step == 0 else False
        results = []
        for m in (ours, theirs):
            m.zero_grad(set_to_none=True)
            m(xb, use).sum().backward()
            results.append(_grads(m.module))
        _close(results[0], results[1], ATOL, f"unused params (step {step})")
        names = [n for n, _ in ours.module.named_parameters()]
        never = [g for n, g in zip(names, results[0]) if n.startswith("never")]
        assert all(g is None for g in never)
        assert (results[0][names.index("sometimes.weight")] is None) == (step == 1)

    # 6. parameters broadcast at construction, buffers at each forward.
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 3)
    model.register_buffer("stat", torch.full((2,), float(rank)))
    ddp = DDP(model)
    ref = _model()  # not used; keeps the RNG independent of rank from here on
    del ref
    gathered = [torch.empty(12) for _ in range(world)]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    model.stat.fill_(10.0 + rank)
    ddp(torch.randn(1, 3))
    assert model.stat.tolist() == [10.0, 10.0]
    no_bcast = DDP(model, broadcast_buffers=False)
    model.stat.fill_(20.0 + rank)
    no_bcast(torch.randn(1, 3))
    assert model.stat.tolist() == [20.0 + rank] * 2

    # 7. wrapper protocol and torch-compatible state_dict keys.
    assert DDP._shardkit_wrapper is True and ddp.module is model
    keys = sorted(ddp.state_dict())
    assert keys == sorted("module." + k for k in model.state_dict())
    assert keys == sorted(TorchDDP(model).state_dict())

    # 8. register_comm_hook misuse, and a missing gradient without find_unused_parameters.
    errors = {}
    model = DDP(_model())
    for bad in (42, lambda bucket: bucket):
        try:
            model.register_comm_hook(None, bad)
        except TypeError as exc:
            errors[repr(type(bad))] = str(exc)
    model.register_comm_hook(None, sh.allreduce_hook)
    try:
        model.register_comm_hook(None, sh.allreduce_hook)
    except ValueError as exc:
        errors["twice"] = str(exc)
    late = DDP(_model())  # as torch: a hook may be registered after the first backward
    before = _step_grads(late, x[sl], y[sl])
    late.register_comm_hook(None, sh.allreduce_hook)  # no step: the same averaged grads
    after = _step_grads(late, x[sl], y[sl])
    report["late_hook_same"] = all(torch.allclose(a, b, atol=1e-7) for a, b in zip(before, after))
    returns_tensor = DDP(_model())
    returns_tensor.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    try:
        _step_grads(returns_tensor, x[sl], y[sl])
    except TypeError as exc:
        errors["not_future"] = str(exc)
    strict = DDP(_Branchy.make())
    try:
        strict(torch.randn(2, 8), False).sum().backward()
    except RuntimeError as exc:
        errors["unused"] = str(exc)
    report["errors"] = errors
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_parity_hooks_no_sync_unused(world):
    reports = run_ranks(_body_parity, world, world, timeout=120)
    errors = reports[0]["errors"]
    assert "must be callable" in errors["<class 'int'>"]
    assert "two arguments" in errors["<class 'function'>"]
    assert "only once" in errors["twice"]
    assert all(r["late_hook_same"] for r in reports)
    assert "torch.futures.Future" in errors["not_future"]
    assert "find_unused_parameters=True" in errors["unused"]
    assert "sometimes" in errors["unused"] and "never" in errors["unused"]
    print(reports[0])
