"""The local checkpoint tier's pure logic and single-process behaviour: options, peers,
step agreement, source plans, foreign and torn copies, cleanup rules, memory report."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil

import pytest
import torch

from shardkit.checkpoint import CheckpointManager, LocalTier, RestoreInfo
from shardkit.checkpoint._manager._local import LocalStore
from shardkit.checkpoint._manager._tiers import (
    choose_latest,
    default_directory,
    peer_map,
    plan_sources,
)

# -- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"interval": 0}, ValueError, "interval=0"),
        ({"interval": 1.5}, TypeError, "interval=1.5"),
        ({"interval": True}, TypeError, "interval=True"),
        ({"max_to_keep": 0}, ValueError, "max_to_keep=0"),
        ({"peer": 1}, TypeError, "peer=1"),
        ({"max_bytes": 0}, ValueError, "max_bytes=0"),
        ({"max_bytes": "1G"}, TypeError, "max_bytes='1G'"),
        ({"directory": ""}, TypeError, "directory=''"),
        ({"directory": "s3://b/x"}, ValueError, "not a URL"),
    ],
)
def test_local_tier_validation(kwargs, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(".", r"\.")):
        LocalTier(**kwargs)


def test_local_tier_is_frozen_and_keyword_only():
    tier = LocalTier(interval=2)
    assert (tier.interval, tier.directory, tier.max_to_keep, tier.peer, tier.max_bytes) == (
        2,
        None,
        2,
        True,
        None,
    )
    with pytest.raises(AttributeError):
        tier.interval = 3
    with pytest.raises(TypeError):
        LocalTier(2)


def test_manager_refuses_other_tier_objects(tmp_path):
    with pytest.raises(TypeError, match="LocalTier"):
        CheckpointManager(str(tmp_path / "p"), 1, local_tier={"interval": 1})
    with pytest.raises(ValueError, match="read_only=True"):
        CheckpointManager(str(tmp_path / "p"), 1, read_only=True, local_tier=LocalTier())


# -- peers --------------------------------------------------------------------------------


def _machines(*sizes):
    """Every rank's machine as TierEngine gathers it, ranks numbered machine by machine."""
    return [[m, "host"] for m, n in enumerate(sizes) for _ in range(n)]


def test_peer_is_on_the_next_machine():
    # 2 machines x 4 ranks: rank r's replica goes to the same local rank on the other one
    assert peer_map(_machines(4, 4)) == [4, 5, 6, 7, 0, 1, 2, 3]
    # 3 machines x 2 ranks: a ring over machines, (rank + LOCAL_WORLD_SIZE) % world
    assert peer_map(_machines(2, 2, 2)) == [2, 3, 4, 5, 0, 1]
    # machines told apart by hostname alone (no launcher variables): the same ring
    assert peer_map([[0, "b"], [0, "a"], [0, "b"], [0, "a"]]) == [1, 0, 3, 2]


@pytest.mark.parametrize(
    "sizes", [(4, 4), (2, 2, 2), (4,), (1, 1, 1), (2, 1), (1, 2), (3, 1), (2, 3, 1), (1, 1, 5)]
)
def test_peer_map_is_one_consistent_ring(sizes):
    """Every rank builds the map from the same gathered list: a permutation without fixed
    points (each rank sends one replica and holds one), leaving its machine wherever
    another machine has a rank at that position."""
    machines = _machines(*sizes)
    peers = peer_map(machines)
    assert sorted(peers) == list(range(len(machines)))
    assert all(p != r for r, p in enumerate(peers))
    if len(sizes) > 1:
        smallest = min(sizes) * len(sizes)  # positions every machine has
        crossing = sum(machines[r] != machines[p] for r, p in enumerate(peers))
        assert crossing >= smallest


def test_unequal_machines_do_not_follow_each_ranks_local_world_size():
    # torchrun --nproc-per-node 2 on one machine and 1 on another (the audit's hang:
    # each rank's own (rank + LOCAL_WORLD_SIZE) % 3 gave rank 0 two senders, rank 1 none)
    assert peer_map(_machines(2, 1)) == [2, 0, 1]
    assert peer_map(_machines(2, 1)) == peer_map([[0, "a"], [0, "a"], [1, "b"]])


def test_single_machine_and_world_of_one():
    assert peer_map(_machines(4)) == [1, 2, 3, 0]  # same machine: next rank
    assert peer_map(_machines(1)) is None


# -- agreement ----------------------------------------------------------------------------


def _inv(copies, persistent=(), fp="L"):
    return {"fp": fp, "copies": [list(c) for c in copies], "persistent": list(persistent)}


def test_latest_is_newest_step_complete_across_the_world():
    invs = [
        _inv([(0, 5, "local", "L"), (0, 6, "local", "L"), (1, 5, "replica", "L")], [4]),
        _inv([(1, 5, "local", "L"), (0, 5, "replica", "L"), (0, 6, "replica", "L")]),
    ]
    assert choose_latest(invs) == 5  # rank 1's shard of step 6 is nowhere
    invs[1]["copies"].append([1, 7, "local", "L"])
    assert choose_latest(invs) == 5
    invs[0]["persistent"] = [4, 8]
    assert choose_latest(invs) == 8  # persistent has every shard
    assert choose_latest([_inv([]), _inv([])]) is None


def test_latest_with_layout_check_ignores_other_layouts():
    invs = [
        _inv([(0, 5, "local", "old"), (1, 5, "replica", "L")], [4]),
        _inv([(1, 5, "local", "L")]),
    ]
    assert choose_latest(invs) == 5
    assert choose_latest(invs, check_layout=True) == 4


def test_plan_prefers_own_local_then_peer_then_persistent():
    invs = [
        _inv([(0, 5, "local", "L"), (1, 5, "replica", "L")], [5]),
        _inv([(0, 5, "replica", "L")]),
        _inv([(2, 5, "local", "L"), (1, 5, "local", "L")]),  # rank 1's copy seen by rank 2
    ]
    plan = plan_sources(invs, 5)
    assert plan[0] == ("local", 0, "local")
    assert plan[1] == ("peer", 0, "replica")  # a replica before a same-node view
    assert plan[2] == ("local", 2, "local")
    plan = plan_sources(invs, 5, {(1, 0, "replica"), (0, 0, "local")})
    assert plan[1] == ("peer", 2, "local")
    assert plan[0] == ("peer", 1, "replica")
    assert plan_sources(invs, 5, {(0, 0, "local"), (0, 1, "replica")})[0] == (
        "persistent",
        None,
        None,
    )
    plan = plan_sources(invs, 5, {(1, 0, "replica"), (1, 2, "local")})
    assert plan[1] == ("persistent", None, None)
    invs[0]["persistent"] = []
    assert plan_sources(invs, 5, {(1, 0, "replica"), (1, 2, "local")})[1] is None


def test_plan_reads_a_replica_it_sees_itself():
    # one machine: rank 1 sees the replica of its shard that rank 0 keeps in the shared dir
    invs = [_inv([(0, 3, "local", "L"), (1, 3, "replica", "L")]), _inv([(1, 3, "replica", "L")])]
    invs[1]["copies"] += [[0, 3, "local", "L"]]
    assert plan_sources(invs, 3)[1] == ("peer", 1, "replica")


# -- copies on disk -----------------------------------------------------------------------


def _write(store, step, state, keep=1):
    from shardkit.checkpoint._core._flatten import flatten
    from shardkit.checkpoint._manager._local import localized, shard_layout

    flat = flatten(state, for_save=True)
    return store.write_own(step, localized(flat), shard_layout(flat), keep=keep)


def _read_back(store, path, like):
    from shardkit.checkpoint._core._flatten import flatten
    from shardkit.checkpoint._manager._local import shard_layout
    from shardkit.checkpoint._manager._tiers import layout_fingerprint

    target = {k: torch.zeros_like(v) for k, v in like.items()}
    flat = flatten(target, for_save=False)
    store.load_copy(path, flat, layout_fingerprint(shard_layout(flat)))
    return target


def _data_inodes(path):
    return sorted(os.stat(os.path.join(path, n)).st_ino for n in os.listdir(path) if "data-" in n)


def test_oldest_copy_is_recycled_in_place(tmp_path):
    """With keep >= 2 copies, a new copy takes over the files of the oldest (which
    retention would delete next), overwriting them in place: a RAM disk reuses the
    pages. Files the new copy does not need are removed; the copy loads exactly."""
    store = LocalStore(str(tmp_path / "ram"), "file:///run/a", 0, 1)
    big = {"w": torch.arange(4096.0), "b": torch.ones(3)}
    one = _write(store, 1, big, keep=2)
    _write(store, 2, {k: v + 1 for k, v in big.items()}, keep=2)
    old = _data_inodes(one)
    with open(os.path.join(one, "data-stale-00000-009.safetensors"), "wb") as f:
        f.write(b"left by an older save")  # a spare no new file takes
    linked = os.path.join(one, "data-linked-00000-000.safetensors")
    os.link(os.path.join(one, "tier.json"), str(tmp_path / "elsewhere"))
    os.rename(os.path.join(one, "tier.json"), linked)  # never overwritten through a link
    shutil.copy(str(tmp_path / "elsewhere"), os.path.join(one, "tier.json"))
    before = open(str(tmp_path / "elsewhere"), "rb").read()
    small = {"w": torch.arange(100.0) * 3, "b": torch.full((3,), 7.0)}
    three = _write(store, 3, small, keep=2)
    assert store.steps("local", 0) == [2, 3] and not os.path.exists(one)
    assert _data_inodes(three) == old  # the same file, its pages reused
    assert open(str(tmp_path / "elsewhere"), "rb").read() == before
    md = json.loads(open(os.path.join(three, "metadata.json")).read())
    names = {n for n in os.listdir(three) if n not in ("metadata.json", "tier.json")}
    assert names == set(md["files"])  # the stale spare is gone
    for name, size in md["files"].items():  # shrunk to what was written
        assert os.path.getsize(os.path.join(three, name)) == size
    back = _read_back(store, three, small)
    assert all(torch.equal(back[k], small[k]) for k in small)
    assert sorted(s[1] for s in store.scan()) == [2, 3]
    # a recycled write that fails part-way (a full RAM disk) leaves nothing half-written
    # and the newer copy whole
    from shardkit.checkpoint._core import _storage

    real = _storage._write_local

    def full(path, parts, **kw):
        assert kw.get("in_place")  # the recycled files are written in place
        real(path, [b"partial"], **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    _storage._write_local = full
    try:
        with pytest.raises(OSError, match="No space left"):
            _write(store, 5, small, keep=2)
    finally:
        _storage._write_local = real
    assert store.steps("local", 0) == [3]
    assert not [n for n in os.listdir(store.kind_dir("local", 0)) if ".tmp-" in n]
    back = _read_back(store, three, small)
    assert all(torch.equal(back[k], small[k]) for k in small)
    # keep=1: the only copy stays whole until the new one is in place
    store.retain("local", 0, 1)
    tmp, spares = store.recycle("local", 0, 4, 1)
    assert spares == [] and os.listdir(tmp) == [] and store.steps("local", 0) == [3]
    os.rmdir(tmp)
    four = _write(store, 4, small, keep=1)
    assert _data_inodes(four) != _data_inodes(three)


def test_foreign_and_torn_copies_are_ignored(tmp_path, caplog):
    root = str(tmp_path / "ram")
    url = "file:///run/a"
    mine = LocalStore(root, url, 0, 2)
    good = _write(mine, 3, {"w": torch.arange(4.0)})
    assert [c[:4] for c in mine.scan()] == [[0, 3, "local", mine.read_manifest(good)["fp"]]]
    caplog.set_level(logging.WARNING)
    assert LocalStore(root, "file:///run/b", 0, 2).scan() == []  # another run
    assert LocalStore(root, url, 0, 3).scan() == []  # another world size
    assert "another run" in caplog.text and "world of 2" in caplog.text
    # a copy in rank 1's place that names rank 0 (moved by hand)
    os.makedirs(mine.kind_dir("local", 1))
    os.rename(good, mine.copy_path("local", 1, 3))
    assert mine.scan() == []
    os.rename(mine.copy_path("local", 1, 3), good)
    # a temporary (unfinished) copy is never listed
    os.rename(good, good + ".tmp-abc")
    assert mine.scan() == []
    os.rename(good + ".tmp-abc", good)
    # torn: a truncated data file; a tampered manifest
    data = os.path.join(good, next(n for n in os.listdir(good) if n.startswith("data-")))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 1)
    assert mine.scan() == []
    other = _write(mine, 4, {"w": torch.arange(4.0)})
    m = mine.read_manifest(other)
    m["layout"]["tensors"]["w"][0] = [5]
    with open(os.path.join(other, "tier.json"), "w") as f:
        json.dump(m, f)
    assert mine.scan() == []


def test_single_process_cycle_cleanup_and_memory(tmp_path):
    ram = tmp_path / "ram"
    model = torch.nn.Linear(4, 3)
    with CheckpointManager(
        str(tmp_path / "p"), 4, max_to_keep=1, chkpt_on_preemption=False,
        local_tier=LocalTier(directory=ram, max_to_keep=2),
    ) as mgr:  # fmt: skip
        assert mgr.last_restore is None
        for step in range(1, 7):
            assert mgr.should_save(step)
            assert mgr.save(step, {"model": model.state_dict(), "step": step})
            with torch.no_grad():
                model.weight.add_(1.0)
        mgr.join()
        mem = mgr.tier_memory()
        steps = sorted(os.listdir(ram / "local" / "rank_00000"))
        assert steps == ["step_00000005", "step_00000006"]
        on_disk = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(ram / "local")
            for f in fs  # fmt: skip
        )
        assert mem["local"] == on_disk and mem["replica"] == 0  # no peer in a world of one
        assert mem["staging"] == (12 + 3) * 4 and mem["peak"] >= on_disk + mem["staging"]
        assert mgr.latest_step() == 6 and mgr.all_steps() == [4]
        expect = model.weight.detach().clone() - 1.0
        target = {"model": torch.nn.Linear(4, 3).state_dict(), "step": -1}
        mgr.restore(6, target)
        assert torch.equal(target["model"]["weight"], expect) and target["step"] == 6
        assert mgr.last_restore.tier == "local" and mgr.last_restore.tiers_by_rank == ["local"]
        assert isinstance(mgr.last_restore, RestoreInfo)
        mgr.restore(4, target)  # local copy gone (retention): the persistent tier
        assert mgr.last_restore.tier == "persistent" and target["step"] == 4
    assert not ram.exists()  # a clean exit removes the tier


def test_exception_keeps_the_tier_and_foreign_run_ignores_it(tmp_path):
    ram = tmp_path / "ram"
    with pytest.raises(RuntimeError):
        with CheckpointManager(
            str(tmp_path / "a"), 10, chkpt_on_preemption=False,
            local_tier=LocalTier(directory=ram),
        ) as mgr:  # fmt: skip
            mgr.save(1, {"x": torch.ones(2)})
            raise RuntimeError("crash")
    assert (ram / "local" / "rank_00000" / "step_00000001" / "metadata.json").exists()
    with CheckpointManager(
        str(tmp_path / "b"), 10, chkpt_on_preemption=False, local_tier=LocalTier(directory=ram)
    ) as other:
        assert other.latest_step() is None  # run a's copy is foreign to run b
    with CheckpointManager(
        str(tmp_path / "a"), 10, chkpt_on_preemption=False, local_tier=LocalTier(directory=ram)
    ) as again:
        assert again.latest_step() == 1
        out = again.restore(1, {"x": torch.zeros(2)})
        assert torch.equal(out["x"], torch.ones(2)) and again.last_restore.tier == "local"


def test_default_directory_in_dev_shm(tmp_path):
    import shutil

    url = str(tmp_path / "p")
    d = None
    try:
        with CheckpointManager(url, 10, chkpt_on_preemption=False, local_tier=LocalTier()) as mgr:
            d = default_directory(mgr.path)
            mgr.save(1, {"x": torch.ones(2)})
            mgr.join()
            assert os.path.isdir(os.path.join(d, "local", "rank_00000", "step_00000001"))
            if os.path.isdir("/dev/shm"):
                assert d.startswith(f"/dev/shm/shardkit-{os.getuid()}/")
            assert d == default_directory(mgr.path) and d != default_directory(mgr.path + "x")
        assert not os.path.exists(d)
    finally:  # never leave files in /dev/shm, even when an assertion failed
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def test_a_job_removing_the_shared_parent_does_not_break_a_starting_one(tmp_path, monkeypatch):
    """Jobs share ``shardkit-<uid>`` and remove it once empty on clean exit. If that
    happens between creating it and creating a new job's directory inside it, the new
    job creates both again; only removals that never stop fail, with the OS error."""
    parent = tmp_path / "shardkit-uid"
    root = parent / "job"
    real_mkdir = os.mkdir
    races = {"left": 1}

    def mkdir_with_a_closing_job(path, mode=0o777, **kw):
        if os.fspath(path) == str(root) and races["left"] > 0:
            races["left"] -= 1
            os.rmdir(parent)  # another job's prune_empty(parent=True), empty parent
        return real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir_with_a_closing_job)
    LocalStore(str(root), "url", 0, 1)
    assert root.is_dir() and races["left"] == 0
    shutil.rmtree(parent)
    races["left"] = 10**6
    with pytest.raises(FileNotFoundError):
        LocalStore(str(root), "url", 0, 1)
    assert races["left"] == 10**6 - 16  # it gave up after its attempts


def test_max_bytes_names_sizes_and_option(tmp_path):
    with CheckpointManager(
        str(tmp_path / "p"), 10, chkpt_on_preemption=False,
        local_tier=LocalTier(directory=tmp_path / "ram", max_bytes=1000),
    ) as mgr:  # fmt: skip
        assert mgr.save(1, {"x": torch.ones(10)})  # 2 x 40 bytes fit
        # max_to_keep=2: a save reuses the oldest copy's files, so 2 copies at most
        with pytest.raises(ValueError, match=r"needs up to 1200 bytes.*2 steps \(max_to_keep\)"):
            mgr.save(2, {"x": torch.ones(150)})
    with CheckpointManager(
        str(tmp_path / "q"), 10, chkpt_on_preemption=False,
        local_tier=LocalTier(directory=tmp_path / "ram", max_bytes=1000, max_to_keep=1),
    ) as mgr:  # fmt: skip
        with pytest.raises(ValueError, match=r"needs up to 1200 bytes.*being written"):
            mgr.save(2, {"x": torch.ones(150)})  # the copy stays whole while the next is written


# -- zero-stall staging --------------------------------------------------------------------


def _trained():
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()  # the optimizer is known: its tensors are staged in the background
    return model, optim


def _hold(mgr):
    """Keep the tier's background thread busy until the returned event is set."""
    import threading

    release, started = threading.Event(), threading.Event()
    mgr._tiers._pool.submit(lambda: (started.set(), release.wait()))
    started.wait()
    return release


def test_zero_stall_optimizer_step_waits_for_the_staging_copy(tmp_path):
    import threading
    import time

    from shardkit.checkpoint._core._zero_stall import STATS

    model, optim = _trained()
    with CheckpointManager(
        str(tmp_path / "p"), 100, chkpt_on_preemption=False,
        local_tier=LocalTier(directory=tmp_path / "ram"),
    ) as mgr:  # fmt: skip
        expect = {k: v.clone() for k, v in model.state_dict().items()}
        release = _hold(mgr)
        assert mgr.save_async(1, {"model": model.state_dict()})  # returns before copying
        waiting = STATS.waiting
        stepper = threading.Thread(target=optim.step)
        stepper.start()
        deadline = time.monotonic() + 30
        while STATS.waiting == waiting and time.monotonic() < deadline:
            time.sleep(0.001)  # polling a counter, not synchronizing on time
        assert STATS.waiting == waiting + 1 and stepper.is_alive()  # step waits for staging
        release.set()
        stepper.join()
        mgr.join()
        assert not torch.equal(model.weight, expect["weight"])  # the step did run after
        target = {"model": torch.nn.Linear(4, 3).state_dict()}
        mgr.restore(1, target)
        assert all(torch.equal(target["model"][k], v) for k, v in expect.items())


def test_zero_stall_change_outside_step_fails_the_save(tmp_path):
    from shardkit.checkpoint import CheckpointError

    model, _ = _trained()
    with pytest.raises(CheckpointError, match="changed in place"):
        with CheckpointManager(
            str(tmp_path / "p"), 100, chkpt_on_preemption=False,
            local_tier=LocalTier(directory=tmp_path / "ram"),
        ) as mgr:  # fmt: skip
            release = _hold(mgr)
            mgr.save_async(1, {"model": model.state_dict()})
            with torch.no_grad():
                model.weight.add_(1.0)  # not through optimizer.step(): detected
            release.set()
            mgr.save_async(2, {"model": model.state_dict()})  # raises step 1's failure
    assert not (tmp_path / "ram" / "local" / "rank_00000" / "step_00000001").exists()


@pytest.mark.parametrize(
    "header, words",
    [
        ({"step": 4, "files": []}, "not for step 3"),
        ({"step": 3, "files": [["../x", 1]]}, "bad file entry"),
        ({"step": 3, "files": [["a/b", 1]]}, "bad file entry"),
        ({"step": 3, "files": [[".hidden", 1]]}, "bad file entry"),
        ({"step": 3, "files": [["a", -1]]}, "bad file entry"),
        ({"step": 3, "files": [["a", True]]}, "bad file entry"),
        ({"step": 3, "files": [["a", 1], ["a", 2]]}, "named twice"),
        ({"step": 3, "files": [["a", 600], ["b", 600]]}, "more than the 1000 expected"),
        ({"step": 3, "files": "a"}, "bad file list"),
        ([1, 2], "not for step 3"),
    ],
)
def test_peer_header_is_checked_before_anything_is_allocated(header, words):
    from shardkit.checkpoint import CorruptCheckpointError
    from shardkit.checkpoint._manager._peer import _check_header

    with pytest.raises(CorruptCheckpointError, match=words):
        _check_header(header, 3, 1000)
    assert _check_header({"step": 3, "files": [["a", 600], ["b", 400]]}, 3, 1000)


def test_a_clean_close_removes_a_larger_former_worlds_copies(tmp_path):
    """A job resumed on fewer ranks used to leave the former ranks' copies (and every
    replica) in RAM after its clean exit; only a run of the old world size removed them."""
    import shutil

    ram = tmp_path / "ram"
    with pytest.raises(RuntimeError):  # a crash keeps the tier, as a killed 2-rank job would
        with CheckpointManager(
            str(tmp_path / "a"), 10, chkpt_on_preemption=False, local_tier=LocalTier(directory=ram)
        ) as mgr:
            mgr.save(1, {"x": torch.ones(2)})
            raise RuntimeError("crash")
    own = ram / "local" / "rank_00000" / "step_00000001"
    stale = [
        ram / "local" / "rank_00001" / "step_00000001",
        ram / "replica" / "rank_00000" / "step_00000001",
        ram / "replica" / "rank_00001" / "step_00000001",
    ]
    for path in stale:  # copies of the same run, as a 2-rank world leaves them
        shutil.copytree(own, path)
    foreign = ram / "local" / "rank_00002" / "step_00000001"
    shutil.copytree(own, foreign)
    manifest = next(
        p for p in foreign.iterdir() if p.suffix == ".json" and p.name != "metadata.json"
    )
    manifest.write_text(manifest.read_text().replace(str(tmp_path / "a"), str(tmp_path / "other")))
    with CheckpointManager(
        str(tmp_path / "a"), 10, chkpt_on_preemption=False, local_tier=LocalTier(directory=ram)
    ) as again:
        again.restore(1, {"x": torch.zeros(2)})
        again.save(2, {"x": torch.ones(2)})
    assert not any(p.exists() for p in stale) and not own.exists()
    assert foreign.exists()  # another run's copy in the directory is left alone


def test_ram_copy_of_an_op_that_ended_after_its_copy_is_dropped(tmp_path, monkeypatch):
    """The RAM tier's zero-stall copy gets the same last check as async_save: an in-place
    op that was still running while its tensor was copied (its version bump comes at the
    op's end, simulated here by ``add_(0)`` once staging is done) fails the copy, and the
    tier keeps none of that step (the walkthrough restored such a torn copy)."""
    import threading

    from shardkit.checkpoint import CheckpointError
    from shardkit.checkpoint._core import _zero_stall

    def _copied():  # the staging copy is done (wait_for_staging would also check)
        staging = _zero_stall._active
        if staging is not None:
            staging.wait()

    written = threading.Event()
    real = LocalStore.write_own

    def held(self, *args, **kwargs):  # the copy is written only after the op has ended
        assert written.wait(timeout=60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "write_own", held)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    node = str(tmp_path / "node")
    tier = LocalTier(interval=1, directory=node, max_to_keep=3)
    with CheckpointManager(
        str(tmp_path / "p"), 100, chkpt_on_preemption=False, local_tier=tier
    ) as mgr:
        written.set()
        mgr.save_async(1, {"model": model.state_dict()})
        mgr.join()
        written.clear()
        mgr.save_async(2, {"model": model.state_dict()})
        _copied()
        with torch.no_grad():
            model.weight.add_(0.0)
        written.set()
        with pytest.raises(CheckpointError, match=r"'model\.weight'.*in progress"):
            mgr.join()
        local = os.path.join(node, "local", "rank_00000")
        assert sorted(os.listdir(local)) == ["step_00000001"]


@pytest.mark.parametrize(
    "change, words",
    [
        ("new_key", "keys missing from the copy ['model.c.bias', 'model.c.weight']"),
        ("shape", "'model.a.weight' [4, 4] saved, [5, 4] given"),
        ("part", "keys only in the copy ['optim.param_groups', 'optim.state.0.momentum_buffer'"),
    ],
)
def test_restore_names_how_the_ram_copy_differs_from_the_state_given(tmp_path, change, words):
    """A run resumed with a changed model (or restoring part of the state) got 'no tier
    holds the shard of rank(s) [0]' and nothing about keys (walkthrough, 2026-11-28)."""
    from shardkit.checkpoint import CheckpointError

    def model(kind):
        m = torch.nn.Module()
        m.a = torch.nn.Linear(4, 5 if kind == "shape" else 4)
        if kind == "new_key":
            m.c = torch.nn.Linear(4, 4)
        return m

    tier = LocalTier(interval=1, directory=str(tmp_path / "node"))
    saved = model("same")
    opt = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    saved.a(torch.ones(1, 4)).sum().backward()
    opt.step()
    kw = {"chkpt_on_preemption": False, "local_tier": tier}
    with pytest.raises(KeyError):  # leave through an exception: the RAM copies stay
        with CheckpointManager(str(tmp_path / "run"), 5, **kw) as mgr:
            for step in range(1, 4):
                mgr.save_async(step, {"model": saved.state_dict(), "optim": opt.state_dict()})
            mgr.join()
            raise KeyError("crash")
    now = model(change)
    state = {"model": now.state_dict()}
    if change != "part":
        state["optim"] = torch.optim.SGD(now.parameters(), lr=0.1, momentum=0.9).state_dict()
    with CheckpointManager(str(tmp_path / "run"), 5, **kw) as mgr:
        assert mgr.latest_step() == 3
        with pytest.raises(CheckpointError, match="step 3 cannot be restored") as info:
            mgr.restore(3, state)
    assert words in str(info.value), str(info.value)


def test_copies_of_another_world_size_are_reported_in_one_line(tmp_path, caplog):
    """After a resize every RAM copy on the machine is of the old world: they used to be
    logged one line each (8 a rank at 8 -> 4 ranks), burying the one that matters."""
    ram = tmp_path / "ram"
    with pytest.raises(RuntimeError):  # a crash keeps the tier
        with CheckpointManager(
            str(tmp_path / "a"), 10, chkpt_on_preemption=False,
            local_tier=LocalTier(directory=ram, max_to_keep=3),
        ) as mgr:  # fmt: skip
            for step in (1, 2, 3):
                mgr.save(step, {"x": torch.ones(2)})
            raise RuntimeError("crash")
    manifests = [
        p for p in ram.rglob("*.json") if p.name != "metadata.json" and "step_" in str(p.parent)
    ]
    assert len(manifests) == 3
    for path in manifests:  # as a 2-rank world would have written them
        path.write_text(path.read_text().replace('"world_size": 1', '"world_size": 2'))
    caplog.set_level("WARNING")
    with CheckpointManager(
        str(tmp_path / "a"), 10, chkpt_on_preemption=False, local_tier=LocalTier(directory=ram)
    ) as again:
        again.latest_step()
        again.latest_step()
    lines = [r.getMessage() for r in caplog.records if "saved by a world of 2" in r.getMessage()]
    assert len(lines) == 1, lines
    assert str(ram) in lines[0] and "this one has 1" in lines[0]
