"""CheckpointManager on 2 real ranks: listings, cleanup, resume equivalence, preemption."""

from __future__ import annotations

import os
import signal

import torch
from harness import run_ranks
from s3_server import LoopbackS3

STEPS, INTERRUPT_AT = 12, 7


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 6, generator=g)
    return x, (x.sum(1, keepdim=True) > 0).float()


def _build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _train_step(model, optim, step):
    import torch.distributed as dist

    x, y = _data(step, dist.get_rank())
    optim.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
    for p in model.parameters():  # data parallel by hand: average gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optim.step()


def _run(root, start, stop, mgr_kwargs, restore):
    from shardkit.checkpoint import CheckpointManager, prime_optimizer

    model, optim = _build()
    mgr = CheckpointManager(root, **mgr_kwargs)
    if restore:
        prime_optimizer(optim)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        mgr.restore(mgr.latest_step(), state)
        start = mgr.latest_step() + 1
    for step in range(start, stop):
        _train_step(model, optim, step)
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        mgr.save_async(step, state)
    mgr.close()
    return model, mgr


def _body(tmp, s3_opts):
    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointManager

    rank = dist.get_rank()
    out = {}
    # 1. Resume equivalence: interrupted at INTERRUPT_AT, resumed, equals uninterrupted.
    ref, _ = _run(f"{tmp}/ref", 0, STEPS, {"save_interval": 100}, restore=False)
    kw = {"save_interval": 3, "max_to_keep": 2}
    _run(f"{tmp}/run", 0, INTERRUPT_AT + 1, kw, restore=False)  # saves 0, 3, 6
    # a crashed save of step 7 left an incomplete directory behind
    if rank == 0:
        os.makedirs(f"{tmp}/run/step_00000007")
        open(f"{tmp}/run/step_00000007/data-x.safetensors", "wb").close()
    dist.barrier()
    model, mgr = _run(f"{tmp}/run", None, STEPS, kw, restore=True)
    out["equal"] = all(
        torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values())
    )
    out["incomplete_removed"] = not os.path.exists(f"{tmp}/run/step_00000007")
    mgr2 = CheckpointManager(f"{tmp}/run", save_interval=3, chkpt_on_preemption=False)
    out["steps"] = mgr2.all_steps()
    mgr2.close()

    # 2. Preemption: rank 0 sends a real SIGTERM to rank 1 at step 7 (off-interval).
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    mgr = CheckpointManager(f"{tmp}/pre", save_interval=5, max_to_keep=0)
    state = {"w": torch.zeros(4)}
    saved, reached = [], None
    for step in range(20):
        state["w"].fill_(step)
        if step == 7 and rank == 0:
            os.kill(pids[1], signal.SIGTERM)
        dist.barrier()
        if mgr.save_async(step, state):
            saved.append(step)
        if mgr.reached_preemption(step):
            reached = step
            break
    mgr.join()
    out["pre_saved"], out["pre_reached"] = saved, reached
    out["pre_steps"] = mgr.all_steps()
    restored = {"w": torch.empty(4)}
    mgr.restore(7, restored)
    out["pre_w"] = restored["w"].tolist()
    mgr.close()
    out["handler_restored"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    # 3. Resharding restore through the loopback S3 server: saved sharded on dim 0,
    #    restored sharded on dim 1 and replicated; retention on S3.
    import shardkit.spmd as xs

    mesh = xs.Mesh([0, 1], (2,), ("x",))
    full = torch.arange(24.0).reshape(4, 6)
    mgr = CheckpointManager(
        "s3://ckpt/run", 1, max_to_keep=2, chkpt_on_preemption=False, storage_options=s3_opts
    )
    for step in range(4):
        mgr.save_async(step, {"t": xs.mark_sharding(full + step, mesh, ("x", None))})
    mgr.join()
    out["s3_steps"] = mgr.all_steps()
    target = {"t": xs.mark_sharding(torch.zeros(4, 6), mesh, (None, "x"))}
    mgr.restore(3, target)
    out["s3_sharded_ok"] = torch.equal(target["t"].full_tensor(), full + 3)
    plain = {"t": torch.zeros(4, 6)}
    mgr.restore(2, plain)
    out["s3_plain_ok"] = torch.equal(plain["t"], full + 2)
    mgr.close()

    # 4. A background save that fails on rank 0 only raises on both ranks at the same
    #    next call (an off-interval one), naming the step, and nothing hangs.
    from shardkit.checkpoint import CheckpointError
    from shardkit.checkpoint._manager import _io as _manager_io

    real = _manager_io._writer

    def broken(mgr, step):
        writer = real(mgr, step)
        if step == 2 and rank == 0:  # the coordinator's commit fails
            writer.commit = lambda metadata: (_ for _ in ()).throw(OSError("disk full"))
        return writer

    _manager_io._writer = broken
    try:
        mgr = CheckpointManager(f"{tmp}/fail", 2, chkpt_on_preemption=False)
        mgr.save_async(2, {"w": torch.ones(3)})
        if rank == 1:  # rank 1 has seen the failure; rank 0 may not have yet
            assert mgr._in_flight[0][2].wait(60)
        try:
            mgr.save_async(3, {"w": torch.ones(3)})
            out["fail_msg"] = None
        except CheckpointError as exc:
            out["fail_msg"] = str(exc)
        out["fail_steps"] = mgr.all_steps()
        mgr.save_async(4, {"w": torch.ones(3)})
        mgr.close()
        out["fail_after"] = mgr.all_steps()
    finally:
        _manager_io._writer = real
    return out


def test_manager_on_two_ranks(tmp_path):
    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        res = run_ranks(_body, 2, str(tmp_path), s3.storage_options, timeout=120)
        listed = sorted(p.rsplit("/", 1)[-1] for p in s3.filesystem().ls("ckpt/run"))
    assert listed == ["step_00000002", "step_00000003"]
    for r in res:
        assert r["equal"], "resumed run differs from the uninterrupted run"
        assert r["incomplete_removed"]
        assert r["steps"] == [6, 9]  # max_to_keep=2 over saves 0, 3, 6 | resumed 9
        assert r["pre_saved"] == [0, 5, 7]
        assert r["pre_reached"] == 7
        assert r["pre_steps"] == [0, 5, 7]
        assert r["pre_w"] == [7.0] * 4
        assert r["handler_restored"]
        assert r["s3_steps"] == [2, 3] and r["s3_sharded_ok"] and r["s3_plain_ok"]
        assert r["fail_msg"] and "background save of step 2" in r["fail_msg"], r["fail_msg"]
        assert r["fail_steps"] == [] and r["fail_after"] == [4]
    assert res[0]["steps"] == res[1]["steps"]


def _body3(tmp):
    import torch.distributed as dist

    import shardkit.spmd as xs
    from shardkit.checkpoint import CheckpointManager

    rank = dist.get_rank()
    out = {}
    # the whole world of 3: async saves of a tensor sharded unevenly over 3 ranks
    mesh = xs.Mesh([0, 1, 2], (3,), ("x",))
    full = torch.arange(20.0).reshape(5, 4)
    with CheckpointManager(f"{tmp}/w3", 2, max_to_keep=2, chkpt_on_preemption=False) as mgr:
        for step in range(7):
            mgr.save_async(step, {"t": xs.mark_sharding(full * step, mesh, ("x", None))})
        mgr.join()
        out["w3_steps"] = mgr.all_steps()
        plain = {"t": torch.zeros(5, 4)}
        mgr.restore(6, plain)
        out["w3_ok"] = torch.equal(plain["t"], full * 6)
    # a manager over a subgroup (global ranks 1 and 2): its coordinator is global rank 1
    sub = dist.new_group([1, 2], use_local_synchronization=True) if rank else None
    if rank:
        with CheckpointManager(
            f"{tmp}/sub", 1, process_group=sub, chkpt_on_preemption=False
        ) as mgr:
            for step in range(3):
                mgr.save(step, {"r": torch.full((2,), float(step))})
            out["sub_steps"] = mgr.all_steps()
            got = {"r": torch.zeros(2)}
            mgr.restore(1, got)
            out["sub_ok"] = got["r"].tolist() == [1.0, 1.0]
    dist.barrier()
    return out


def test_manager_on_three_ranks_and_a_subgroup(tmp_path):
    res = run_ranks(_body3, 3, str(tmp_path), timeout=120)
    for r in res:
        assert r["w3_steps"] == [4, 6] and r["w3_ok"]
    for r in res[1:]:
        assert r["sub_steps"] == [0, 1, 2] and r["sub_ok"]


def _one_rank_signalled(root):
    import os
    import signal

    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointManager

    rank = dist.get_rank()
    with CheckpointManager(root, 100, preemption_signal=signal.SIGUSR1) as mgr:
        answers = []
        for step in range(1, 6):
            if step == 3 and rank == 1:  # one rank alone gets the signal
                os.kill(os.getpid(), signal.SIGUSR1)
            due = mgr.should_save(step)
            answers.append(due)
            if due:
                mgr.save(step, {"x": torch.full((4,), float(step))})
            if mgr.reached_preemption(step):
                break
        return answers, mgr.all_steps()


def test_should_save_agrees_on_a_signal_only_one_rank_received(tmp_path):
    for answers, steps in run_ranks(_one_rank_signalled, 2, str(tmp_path / "r"), timeout=90):
        assert answers == [False, False, True] and steps == [3], (answers, steps)


def _memory_url():
    """memory:// is per process: on 2 ranks each rank's files stayed in its own process,
    and the manager reported every save as done while listing no step (walkthrough,
    2026-11-28). Now each entry point refuses it, on every rank, before writing."""
    import torch

    import shardkit.checkpoint as dcp
    from shardkit.checkpoint import CheckpointManager
    from shardkit.checkpoint._core._errors import UsageError

    state = {"w": torch.ones(2)}
    calls = {
        "save": lambda: dcp.save(state, checkpoint_id="memory://two-ranks/a"),
        "async_save": lambda: dcp.async_save(state, checkpoint_id="memory://two-ranks/b").result(),
        "manager": lambda: CheckpointManager("memory://two-ranks/c", 1, chkpt_on_preemption=False),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except UsageError as exc:
            out[name] = (isinstance(exc, ValueError), str(exc))
    # one process alone may use it
    dcp.save(state, checkpoint_id="memory://two-ranks/alone", no_dist=True)
    return out


def test_memory_url_is_refused_on_several_ranks():
    for out in run_ranks(_memory_url, 2, timeout=60):
        for name in ("save", "async_save", "manager"):
            is_value, message = out[name]
            assert is_value and "memory:// is a per-process file system" in message, name
            assert "2 ranks" in message
