"""CheckpointManager's in-memory tiers on real ranks: every restore path.

Each rank gets its own tier directory (``node<rank>``), so ranks behave like machines:
a rank can only read its own directory, and a shard whose copies are gone from its
rank's directory must come from a peer over the group. A "restart" is a new manager on
the same directories after the previous one left through an exception (which keeps the
local tier, as a crash would).
"""

from __future__ import annotations

import os
import shutil

import pytest
from harness import run_ranks

SAVE_INTERVAL = 4


class _Crash(Exception):
    pass


def _full(step):
    import torch

    return torch.arange(24, dtype=torch.float32).reshape(6, 4) * (step + 1) + 0.25


def _state(step, *, sharded=True):
    import torch

    import shardkit.spmd as xs

    mesh = xs.get_1d_mesh("x")
    w = _full(step)
    return {
        "w": xs.mark_sharding(w, mesh, ("x", None)) if sharded else w,
        "b": torch.full((3,), float(step)),
        "meta": {"step": step},
    }


def _empty(*, sharded=True):
    import torch

    import shardkit.spmd as xs

    mesh = xs.get_1d_mesh("x")
    w = torch.zeros(6, 4)
    return {
        "w": xs.mark_sharding(w, mesh, ("x", None)) if sharded else w,
        "b": torch.zeros(3),
        "meta": {"step": -1},
    }


def _exact(state, step):
    import torch

    w = state["w"]
    w = w.full_tensor() if hasattr(w, "full_tensor") else w
    return (
        torch.equal(w, _full(step))
        and torch.equal(state["b"], torch.full((3,), float(step)))
        and state["meta"] == {"step": step}
    )


def _mgr(root, **tier):
    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointManager, LocalTier

    node = os.path.join(root, f"node{dist.get_rank()}")
    opts = {"interval": 1, "directory": node, "max_to_keep": 2, **tier}
    return CheckpointManager(
        os.path.join(root, "persistent"),
        save_interval=SAVE_INTERVAL,
        max_to_keep=2,
        chkpt_on_preemption=False,
        local_tier=LocalTier(**opts),
    )


def _run(root, steps):
    """Save ``steps`` every step, then leave through an exception (keeps the local tier)."""
    try:
        with _mgr(root) as mgr:
            for s in steps:
                assert mgr.should_save(s)
                assert mgr.save_async(s, _state(s))
            mgr.join()
            raise _Crash
    except _Crash:
        pass


def _restart(root, expect_step=None, *, target=None, keep=True):
    """A new manager: latest step, restore it; returns (step, tiers, exact)."""
    try:
        with _mgr(root) as mgr:
            step = mgr.latest_step()
            assert expect_step is None or step == expect_step, (step, expect_step)
            state = target if target is not None else _empty()
            mgr.restore(step, state)
            info = mgr.last_restore
            assert info.step == step and info.tier == info.tiers_by_rank[_rank()]
            out = (step, info.tiers_by_rank, _exact(state, step))
            if keep:
                raise _Crash
            return out
    except _Crash:
        return out


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _node(root, rank=None):
    return os.path.join(root, f"node{_rank() if rank is None else rank}")


def _copy(root, kind, src, step, rank=None):
    sub = "local" if kind == "local" else "replica"
    return os.path.join(_node(root, rank), sub, f"rank_{src:05d}", f"step_{step:08d}")


def _data_file(path):
    return os.path.join(path, next(n for n in sorted(os.listdir(path)) if n.startswith("data-")))


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _paths(root):
    """Local, peer (lost node), torn copies, persistent fallback, disagreeing step."""
    r = _rank()
    out = {}
    _run(root, range(6))  # persistent 0, 4; local and replicas 4, 5
    assert sorted(os.listdir(os.path.join(_node(root), "local", f"rank_{r:05d}"))) == [
        "step_00000004",
        "step_00000005",
    ]
    out["local"] = _restart(root, 5)

    # rank 1's machine lost its RAM tier: its shard comes from rank 0's replica
    _barrier()
    if r == 1:
        shutil.rmtree(_node(root))
    _barrier()
    out["peer"] = _restart(root, 5)
    # the received copy became rank 1's local copy again
    out["peer_again"] = _restart(root, 5)

    # more steps, so both machines hold replicas again: local 7, 8; persistent 4, 8
    _run(root, range(6, 9))
    # torn copies: rank 0's data file truncated, rank 1's bytes flipped (same size)
    _barrier()
    if r == 0:
        with open(_data_file(_copy(root, "local", 0, 8)), "r+b") as f:
            f.truncate(os.path.getsize(f.name) - 3)
    else:
        path = _data_file(_copy(root, "local", 1, 8))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 4)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    _barrier()
    out["torn"] = _restart(root, 8)

    # a missing commit marker: rank 0's metadata.json removed; the replica on rank 1 serves
    _barrier()
    if r == 0:
        os.remove(os.path.join(_copy(root, "local", 0, 8), "metadata.json"))
    _barrier()
    out["no_commit"] = _restart(root, 8)

    # every RAM copy of rank 1's shard gone (both machines): step 8 comes from the
    # persistent tier for rank 1, while rank 0 still reads its own local copy
    _barrier()
    if r == 1:
        shutil.rmtree(os.path.join(_node(root), "local"))
    else:
        shutil.rmtree(os.path.join(_node(root), "replica"))
    _barrier()
    out["fallback"] = _restart(root, 8)

    # a layout the local copies were not saved with (w replicated): persistent for all
    out["layout"] = _restart(root, 8, target=_empty(sharded=False))
    return out


@pytest.mark.timeout(120)
def test_restore_paths(tmp_path):
    got = run_ranks(_paths, 2, str(tmp_path), timeout=110)
    for rank, out in enumerate(got):
        assert out["local"] == (5, ["local", "local"], True), (rank, out)
        assert out["peer"] == (5, ["local", "peer"], True), (rank, out)
        assert out["peer_again"] == (5, ["local", "local"], True), (rank, out)
        assert out["torn"] == (8, ["peer", "peer"], True), (rank, out)
        assert out["no_commit"] == (8, ["peer", "local"], True), (rank, out)
        assert out["fallback"] == (8, ["local", "persistent"], True), (rank, out)
        assert out["layout"] == (8, ["persistent", "persistent"], True), (rank, out)


def _disagree(root):
    """Ranks hold different newest steps: the newest step common to all is chosen."""
    from shardkit.checkpoint import CheckpointError

    r = _rank()
    _run(root, range(1, 4))  # local 2, 3 (persistent: none, interval 4)
    _barrier()
    if r == 1:  # rank 1 died before its step-3 copy; its peer never got a replica
        shutil.rmtree(_copy(root, "local", 1, 3))
    else:
        shutil.rmtree(_copy(root, "replica", 1, 3))
    _barrier()
    try:
        with _mgr(root) as mgr:
            mgr.restore(3, _empty())
        err = None
    except CheckpointError as exc:
        err = str(exc)
    return _restart(root, 2), err


def test_disagreeing_newest_step(tmp_path):
    got = run_ranks(_disagree, 2, str(tmp_path), timeout=90)
    for out, err in got:
        assert out == (2, ["local", "local"], True)
        assert err is not None and "rank(s) [1]" in err and "newest step" in err


def _ring(root):
    """3 machines of one rank: rank 2's machine is lost; rank 0 holds its replica."""
    r = _rank()
    _run(root, range(2))
    held = sorted(os.listdir(os.path.join(_node(root), "replica")))
    _barrier()
    if r == 2:
        shutil.rmtree(_node(root))
    _barrier()
    out = _restart(root, 1, keep=False)  # a clean exit removes this manager's files
    _barrier()
    left = sorted(os.path.join(d, f) for d, _, files in os.walk(_node(root)) for f in files)
    return held, out, left


def test_peer_ring_and_cleanup(tmp_path):
    got = run_ranks(_ring, 3, str(tmp_path), timeout=90, env={"LOCAL_WORLD_SIZE": "1"})
    # peer of rank r is (r + 1) % 3: rank r holds the replica of rank r - 1
    assert [g[0] for g in got] == [["rank_00002"], ["rank_00000"], ["rank_00001"]]
    for _, out, left in got:
        assert out == (1, ["local", "local", "peer"], True)
        assert left == []


def _recycling(root):
    """Steps 0, 1, 2 on 2 ranks with max_to_keep=2: step 2's own copy and the replica
    received for it take over the files of step 0's (same inodes), and load exactly."""
    src = 1 - _rank()
    with _mgr(root) as mgr:
        inodes = []
        for s in range(3):
            mgr.save_async(s, _state(s))
            mgr.join()
            _barrier()  # the peer's replica is in place too
            own, held = _copy(root, "local", _rank(), s), _copy(root, "replica", src, s)
            inodes.append((os.stat(_data_file(own)).st_ino, os.stat(_data_file(held)).st_ino))
        left = sorted(os.listdir(os.path.join(_node(root), "replica", f"rank_{src:05d}")))
        state = _empty()
        mgr.restore(2, state)
        return inodes, left, mgr.last_restore.tier, _exact(state, 2)


def test_copies_and_replicas_reuse_the_oldest_files(tmp_path):
    for inodes, left, tier, exact in run_ranks(_recycling, 2, str(tmp_path), timeout=60):
        assert inodes[2] == inodes[0] and inodes[1] != inodes[0]
        assert left == ["step_00000001", "step_00000002"]
        assert (tier, exact) == ("local", True)


def _bounded(root):
    from shardkit.checkpoint import CheckpointManager, LocalTier

    try:
        with CheckpointManager(
            os.path.join(root, "p"), 10, chkpt_on_preemption=False,
            local_tier=LocalTier(directory=_node(root), max_bytes=100),
        ) as mgr:  # fmt: skip
            mgr.save(1, _state(1))
    except ValueError as exc:
        return str(exc)
    return None


def test_max_bytes(tmp_path):
    for msg in run_ranks(_bounded, 2, str(tmp_path), timeout=60):
        assert msg is not None and "max_bytes=100" in msg and "largest shard 60" in msg


def _zero_stall_peer(root):
    """A model an optimizer trains, staged in the background while training goes on; a
    rank whose RAM is lost gets the state of the save call back from its peer."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)

    def step(s):
        optim.zero_grad()
        model(torch.full((2, 8), float(s + _rank()))).pow(2).sum().backward()
        optim.step()

    saved = {}
    try:
        with _mgr(root) as mgr:
            for s in range(1, 4):  # no persistent step (every 4): the ranks' models differ
                step(s)
                state = {"model": model.state_dict(), "optim": optim.state_dict()}
                mgr.save_async(s, state)
                saved[s] = {k: v.clone() for k, v in model.state_dict().items()}
            step(4)  # runs while (or after) step 3's copy is staged
            mgr.join()
            raise _Crash
    except _Crash:
        pass
    _barrier()
    if _rank() == 1:
        shutil.rmtree(_node(root))
    _barrier()
    fresh = torch.nn.Linear(8, 4)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
    from shardkit.checkpoint import prime_optimizer

    prime_optimizer(fresh_optim)
    with _mgr(root) as mgr:
        latest = mgr.latest_step()
        target = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict()}
        mgr.restore(latest, target)
        fresh_optim.load_state_dict(target["optim"])
        exact = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved[latest].items())
        moments = fresh_optim.state_dict()["state"][0]["exp_avg"]
        return latest, mgr.last_restore.tiers_by_rank, exact, bool(moments.abs().sum() > 0)


def test_zero_stall_state_restores_from_peer(tmp_path):
    for out in run_ranks(_zero_stall_peer, 2, str(tmp_path), timeout=90):
        assert out == (3, ["local", "peer"], True, True)


def _full_ram_disk(root, where):
    """Rank 1's RAM disk is full when rank 0's replica arrives: reserving the file's
    space (posix_fallocate, as on a full tmpfs) or making its directory fails with
    ENOSPC. The pair used to hang, rank 0 in its send."""
    import errno

    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointError
    from shardkit.checkpoint._manager import _peer
    from shardkit.checkpoint._manager._local import LocalStore

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def bug(*args, **kwargs):
        raise RuntimeError("not an OSError")

    if dist.get_rank() == 1 and where == "fallocate":
        os.posix_fallocate = full
    elif dist.get_rank() == 1 and where == "bug":
        _peer.take_spare = bug
    elif dist.get_rank() == 1:
        own = LocalStore.recycle
        LocalStore.recycle = lambda self, kind, *a: (full if kind == "replica" else own)(
            self, kind, *a
        )
    out = []
    try:
        with _mgr(root) as mgr:
            for step in (1, 2, 3):
                try:
                    mgr.save_async(step, _state(step))
                    out.append((step, "ok"))
                except CheckpointError as exc:
                    out.append((step, str(exc)))
    except CheckpointError as exc:
        out.append(("close", str(exc)))
    return out


@pytest.mark.parametrize("where", ["fallocate", "directory", "bug"])
def test_a_full_ram_disk_on_the_replica_side_fails_both_ranks_without_a_hang(tmp_path, where):
    env = {"LOCAL_WORLD_SIZE": "1"}
    got = run_ranks(_full_ram_disk, 2, str(tmp_path), where, timeout=90, env=env)
    failed = [[entry for entry in out if entry[1] != "ok"] for out in got]
    assert [len(f) for f in failed] == [1, 1], got  # each rank raised once, and went on
    assert failed[0][0][0] == failed[1][0][0]  # at the same save
    assert "failed on another rank" in failed[0][0][1]
    why = "not an OSError" if where == "bug" else "No space left on device"
    assert why in failed[1][0][1] and "rank 0's shard" in failed[1][0][1]


def _sender_cannot_map(root):
    """Rank 0 cannot map its copy's files (ENOMEM, or a file changed since it was
    listed). It used to fail after its peer had posted the receives, and rank 1 waited
    out the group's 10-minute timeout; rank 0 now sends "nothing" and both go on."""
    import errno

    import torch.distributed as dist

    from shardkit.checkpoint._manager import _peer

    if dist.get_rank() == 0:
        own = _peer._map

        def no_memory(path, size, maps, *, receive):
            if not receive:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
            return own(path, size, maps, receive=receive)

        _peer._map = no_memory
    out = []
    with _mgr(root) as mgr:
        for step in (1, 2):
            out.append(mgr.save_async(step, _state(step)))
        mgr.join()
        replicas = os.path.join(_node(root), "replica", f"rank_{1 - dist.get_rank():05d}")
        return out, sorted(os.listdir(replicas)) if os.path.isdir(replicas) else []


def test_a_sender_that_cannot_map_its_copy_sends_nothing_and_no_rank_waits(tmp_path):
    env = {"LOCAL_WORLD_SIZE": "1"}
    got = run_ranks(_sender_cannot_map, 2, str(tmp_path), timeout=90, env=env)
    assert [out for out, _ in got] == [[True, True], [True, True]], got
    assert got[0][1] == ["step_00000001", "step_00000002"]  # rank 1's replicas arrived
    assert got[1][1] == []  # rank 0's never left
