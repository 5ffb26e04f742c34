"""shardkit.ddp in a world of one: bucketing, argument checks, hooks, PowerSGD state."""

import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.ddp import DistributedDataParallel as DDP
from shardkit.ddp import GradBucket, assign_buckets, count_comm
from shardkit.ddp.comm_hooks import debugging_hooks, default_hooks
from shardkit.ddp.comm_hooks._powersgd import _orthogonalize_
from shardkit.ddp.comm_hooks.powerSGD_hook import (
    PowerSGDState,
    batched_powerSGD_hook,
    powerSGD_hook,
)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )


# -- buckets -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 400), min_size=1, max_size=20),
    halves=st.lists(st.booleans(), min_size=20, max_size=20),
    cap=st.integers(4, 2000),
    first=st.integers(4, 2000),
)
def test_assign_buckets_partitions_in_reverse_order(sizes, halves, cap, first):
    params = [
        torch.empty(n, dtype=torch.float16 if h else torch.float32) for n, h in zip(sizes, halves)
    ]
    buckets = assign_buckets(params, cap_bytes=cap, first_cap_bytes=first)
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(params)))
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1
        assert b == sorted(b, reverse=True)  # last-registered first inside a bucket
        nbytes = [params[i].numel() * params[i].element_size() for i in b]
        assert sum(nbytes[:-1]) < max(cap, first)  # closes as soon as it reaches its cap


def test_small_first_bucket_then_cap():
    params = [torch.empty(1000) for _ in range(10)]  # 4000 bytes each
    assert assign_buckets(params, cap_bytes=12_000, first_cap_bytes=4_000) == [
        [9], [8, 7, 6], [5, 4, 3], [2, 1, 0]
    ]  # fmt: skip
    # 25 MiB cap, but the first bucket closes at 1 MiB so its all-reduce starts early.
    ddp = DDP(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)))
    assert [b.buffer.numel() for b in ddp.reducer.buckets] == [512 * 513, 512 * 513]
    assert len(DDP(nn.Linear(1000, 1000), bucket_cap_mb=1).reducer.buckets) == 1


def test_grad_bucket_methods():
    buf = torch.arange(6.0)
    params = [torch.zeros(2, 2), torch.zeros(2)]
    views = [buf[:4].view(2, 2), buf[4:]]
    b = GradBucket(3, buf, views, params, is_last=True)
    assert b.index() == 3 and b.is_last() and b.buffer() is buf
    assert b.parameters()[0] is params[0] and b.gradients()[1].data_ptr() == buf[4:].data_ptr()
    b.set_buffer(buf.half())
    assert b.buffer().dtype == torch.float16
    with pytest.raises(ValueError, match="6"):
        b.set_buffer(torch.zeros(5))
    with pytest.raises(TypeError, match="tensor"):
        b.set_buffer([1.0])


# -- the wrapper in a world of one -----------------------------------------------------


@pytest.mark.parametrize("as_view", [False, True])
def test_world_of_one_matches_plain_training_and_no_sync(as_view):
    ddp, plain = DDP(_mlp(), bucket_cap_mb=0.0002, gradient_as_bucket_view=as_view), _mlp()
    assert len(ddp.reducer.buckets) >= 3
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with ddp.no_sync():
        F.cross_entropy(ddp(x), y).backward()
    F.cross_entropy(ddp(x), y).backward()
    for _ in range(2):
        F.cross_entropy(plain(x), y).backward()
    for a, b in zip(ddp.module.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert ddp._shardkit_wrapper and all(k.startswith("module.") for k in ddp.state_dict())


def test_find_unused_parameters_leaves_unused_grads_none():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x)

    ddp = DDP(Two(), find_unused_parameters=True)
    ddp(torch.randn(2, 3)).sum().backward()
    assert ddp.module.a.weight.grad is not None and ddp.module.b.weight.grad is None
    strict = DDP(Two())
    with pytest.raises(RuntimeError, match=r"b\.weight.*find_unused_parameters=True"):
        strict(torch.randn(2, 3)).sum().backward()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(module="not a module"), TypeError, "torch.nn.Module, got str"),
        (dict(bucket_cap_mb=-1), ValueError, "bucket_cap_mb must be >= 0, got -1"),
        (dict(bucket_cap_mb="25"), TypeError, "bucket_cap_mb"),
        (dict(find_unused_parameters=1), TypeError, "find_unused_parameters must be True or False"),
        (dict(process_group="world"), TypeError, "process_group"),
        (dict(device_ids=[0, 1]), ValueError, "device_ids"),
        (dict(module=nn.ReLU()), ValueError, "at least one parameter"),
        (dict(module=nn.ReLU()), RuntimeError, "at least one parameter"),  # torch's class
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, error, match):
    module = kwargs.pop("module", _mlp())
    with pytest.raises(error, match=match):
        DDP(module, **kwargs)


def test_empty_device_ids_mean_none_as_torch():
    ddp = DDP(_mlp(), device_ids=[])
    ddp(torch.randn(2, 6)).sum().backward()
    assert all(p.grad is not None for p in ddp.parameters())


def test_register_comm_hook_checks():
    ddp = DDP(_mlp())
    with pytest.raises(TypeError, match="must be callable"):
        ddp.register_comm_hook(None, "allreduce")
    with pytest.raises(TypeError, match="two arguments"):
        ddp.register_comm_hook(None, lambda a, b, c: None)

    def annotated(state, bucket) -> torch.Tensor:
        return bucket.buffer()

    with pytest.raises(TypeError, match="torch.futures.Future"):
        ddp.register_comm_hook(None, annotated)
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    with pytest.raises(ValueError, match="only once"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(TypeError, match="returned Tensor.*torch.futures.Future"):
        ddp(torch.randn(2, 6)).sum().backward()
    # as torch: a hook may come after the first backward; it runs from the next one
    late = DDP(_mlp())
    late(torch.randn(2, 6)).sum().backward()
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    late.register_comm_hook(None, counting)
    late(torch.randn(2, 6)).sum().backward()
    assert calls == [0]


@pytest.mark.parametrize(
    "hook, tol",
    [
        (default_hooks.allreduce_hook, 0),
        (default_hooks.fp16_compress_hook, 1e-3),
        (default_hooks.bf16_compress_hook, 1e-2),
        (default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), 1e-3),
        (default_hooks.bf16_compress_wrapper(powerSGD_hook), 1e-2),
        (debugging_hooks.noop_hook, 0),
    ],
)
def test_hooks_in_world_of_one(hook, tol):
    ddp, plain = DDP(_mlp()), _mlp()
    state = PowerSGDState(None, start_powerSGD_iter=1000) if "powerSGD" in hook.__name__ else None
    ddp.register_comm_hook(state, hook)
    x = torch.randn(4, 6)
    ddp(x).sum().backward()
    plain(x).sum().backward()
    for a, b in zip(ddp.module.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)


def test_hooks_names_and_pickling():
    # torch's DDP refuses a hook named "bf16_compress_hook" off NCCL; ours must not be.
    assert default_hooks.bf16_compress_hook.__name__ != "bf16_compress_hook"
    for hook in (default_hooks.bf16_compress_hook, powerSGD_hook, debugging_hooks.noop_hook):
        assert pickle.loads(pickle.dumps(hook)) is hook
    with pytest.raises(TypeError, match="communication hook"):
        default_hooks.fp16_compress_wrapper(None)
    with count_comm() as counter:  # a world of one communicates nothing
        DDP(_mlp())(torch.randn(1, 6)).sum().backward()
    assert counter.bytes == 0 and counter.calls == 0


# -- PowerSGD --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(matrix_approximation_rank=0), ValueError, "matrix_approximation_rank must be >= 1"),
        (
            dict(matrix_approximation_rank=1.5),
            TypeError,
            "matrix_approximation_rank must be an int",
        ),
        (dict(start_powerSGD_iter=-1), ValueError, "use_error_feedback or warm_start"),
        (dict(min_compression_rate=-0.5), ValueError, "min_compression_rate must be finite"),
        (dict(min_compression_rate=float("inf")), ValueError, "min_compression_rate"),
        (dict(min_compression_rate="2"), TypeError, "min_compression_rate"),
        (dict(use_error_feedback=1), TypeError, "use_error_feedback must be True or False"),
        (dict(warm_start=None), TypeError, "warm_start"),
        (dict(orthogonalization_epsilon=-1e-8), ValueError, "orthogonalization_epsilon"),
        (dict(orthogonalization_epsilon=float("nan")), ValueError, "orthogonalization_epsilon"),
        (dict(random_seed=-3), ValueError, "random_seed"),
        (dict(compression_stats_logging_frequency=0.5), TypeError, "logging_frequency"),
        (dict(batch_tensors_with_same_shape="yes"), TypeError, "batch_tensors_with_same_shape"),
        (dict(start_powerSGD_iter=1), ValueError, "start_powerSGD_iter >= 2"),
        (dict(start_powerSGD_iter=0, warm_start=False), ValueError, "use_error_feedback"),
    ],
)
def test_powersgd_state_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        PowerSGDState(None, **kwargs)


def test_powersgd_state_accepts_start_zero_without_memory_and_checks_group():
    PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    # values torch takes (its own docstring suggests min_compression_rate 0.5)
    state = PowerSGDState(
        None,
        start_powerSGD_iter=-1,
        use_error_feedback=False,
        warm_start=False,
        min_compression_rate=0.5,
        compression_stats_logging_frequency=0,
    )
    assert state.compression_stats_logging_frequency == 1  # clamped, as torch
    with pytest.raises(TypeError, match="ProcessGroup"):
        PowerSGDState("world")
    ddp = DDP(_mlp())
    ddp.register_comm_hook("not a state", powerSGD_hook)
    with pytest.raises(TypeError, match="PowerSGDState"):
        ddp(torch.randn(1, 6)).sum().backward()


def test_orthogonalize_is_orthonormal_and_finite_on_zeros():
    p = torch.randn(3, 20, 4)
    _orthogonalize_(p, 0.0)
    eye = torch.eye(4).expand(3, 4, 4)
    torch.testing.assert_close(p.transpose(1, 2) @ p, eye, atol=1e-5, rtol=0)
    z = torch.zeros(1, 7, 2)
    _orthogonalize_(z, 0.0)
    assert torch.equal(z, torch.zeros(1, 7, 2))


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_powersgd_single_process_stats_zero_grads_and_pickle(hook):
    torch.manual_seed(0)
    model = nn.Linear(24, 32)
    state = PowerSGDState(None, start_powerSGD_iter=2, min_compression_rate=1)
    ddp = DDP(model)
    ddp.register_comm_hook(state, hook)
    u, v = torch.randn(32), torch.randn(24)
    for step in range(5):
        model.zero_grad()
        scale = 0.0 if step == 2 else 1.0  # an all-zero gradient right as compression starts
        (ddp(v.unsqueeze(0)) * u * scale).sum().backward()
        assert torch.isfinite(model.weight.grad).all()
    if hook is powerSGD_hook:
        want = torch.outer(u, v)
        assert (model.weight.grad - want).norm() / want.norm() < 1e-4
    rate, before, after = state.compression_stats()
    assert rate > 1 and before > after > 0
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.iter == 5
    assert torch.equal(clone.q_memory_dict[0], state.q_memory_dict[0])


def test_ddp_imports_only_runtime():
    code = (
        "import sys, shardkit.ddp, shardkit.ddp.comm_hooks.powerSGD_hook; "
        "bad = [m for m in sys.modules if m.split('.')[:2] in "
        "(['shardkit','spmd'], ['shardkit','checkpoint'], ['shardkit','fsdp'])]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "wrap", [default_hooks.fp16_compress_wrapper, default_hooks.bf16_compress_wrapper]
)
def test_compress_wrapper_around_compressing_powersgd(wrap):
    torch.manual_seed(0)
    model = nn.Linear(24, 32)
    ddp = DDP(model)
    state = PowerSGDState(None, start_powerSGD_iter=2, min_compression_rate=1)
    ddp.register_comm_hook(state, wrap(powerSGD_hook))
    u, v = torch.randn(32), torch.randn(24)
    for _ in range(4):
        model.zero_grad()
        (ddp(v.unsqueeze(0)) * u).sum().backward()
    want = torch.outer(u, v)
    assert (model.weight.grad - want).norm() / want.norm() < 1e-2  # 16-bit rounding only
    assert state.compression_stats()[0] > 5


def test_gradient_after_marked_unused_is_an_error_not_silently_dropped():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, which):
            return self.a(x) if which == "a" else self.b(x)

    ddp = DDP(Two(), find_unused_parameters=True)
    x = torch.randn(2, 3)
    first, second = ddp(x, "a"), ddp(x, "b")  # the second forward re-arms DDP
    with pytest.raises(
        RuntimeError, match=r"'a\.\w+' received a gradient after it was marked unused"
    ):
        (first + second).sum().backward()


def test_dropping_ddp_removes_its_parameter_hooks():
    import gc

    model = _mlp()
    ddp = DDP(model)
    assert all(p._post_accumulate_grad_hooks for p in model.parameters())
    del ddp
    gc.collect()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    model(torch.randn(1, 6)).sum().backward()  # a plain backward still works


def test_ddp_refuses_sharded_parameters():
    """DDP(FSDP(m)) was accepted, and its broadcast overwrote rank 1's FSDP shards with
    rank 0's (errors audit); torch's DDP fails on DTensor parameters (NotImplementedError)."""
    import numpy as np

    import shardkit.spmd as xs
    from shardkit.fsdp import FSDP

    with pytest.raises(NotImplementedError, match=r"FullyShardedDataParallel.*FSDP alone"):
        DDP(FSDP(nn.Linear(4, 2)))
    with pytest.raises(NotImplementedError, match=r"module 'inner'"):
        DDP(nn.ModuleDict({"inner": FSDP(nn.Linear(4, 2))}))
    mesh = xs.Mesh(np.arange(1), (1,), ("fsdp",))
    with pytest.raises(NotImplementedError, match="SpmdFullyShardedDataParallel"):
        DDP(xs.SpmdFullyShardedDataParallel(nn.Linear(4, 2), mesh))
    tp = xs.shard_module(nn.Linear(4, 2), mesh, {"weight": ("fsdp", None)})
    with pytest.raises(NotImplementedError, match="parameter 'weight'.*ShardedTensor"):
        DDP(tp)
