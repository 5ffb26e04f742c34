"""Crash test: a loop saving asynchronously every step is SIGKILLed at random moments.

After each kill a verifier (this process) checks that the newest listed step restores
exactly what was saved at that step and that retention holds; the loop then restarts,
resumes from that step and checks the restored state bit-exactly itself.

Retention tolerance: a kill can land after a commit but before its background
retention pass, so up to ``MAX_TO_KEEP + MAX_PENDING`` committed steps may be listed
(the manager never lets more accumulate: each save first waits for the previous
commit's retention pass). The listed steps are always the newest, consecutive ones.

The incremental variant keeps a frozen tensor: each step references the frozen bytes in
the directory of the step that wrote them, so retention and the restart's cleanup must
keep exactly the files that listed steps reference (a directory without metadata may
survive, holding nothing else).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

KILLS = 20
KILLS_INCREMENTAL = 8
MAX_TO_KEEP = 3
MAX_PENDING = 1


FROZEN = torch.randn(64, 64, generator=torch.Generator().manual_seed(-1))


def _expected(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(32, 16, generator=g),
            "b": torch.randn(16, generator=g),
            "frozen": FROZEN,
        },
        "optim": {"step": torch.tensor(float(step)), "m": torch.randn(32, 16, generator=g)},
        "progress": {"step": step, "tag": f"s{step}"},
    }


def _alloc() -> dict:
    return {
        "model": {"w": torch.zeros(32, 16), "b": torch.zeros(16), "frozen": torch.zeros(64, 64)},
        "optim": {"step": torch.tensor(0.0), "m": torch.zeros(32, 16)},
        "progress": {"step": -1, "tag": ""},
    }


def _fill(state: dict, step: int) -> None:
    """Overwrite ``state`` in place with step's values (what a training step would do)."""
    want = _expected(step)
    for part in ("model", "optim"):
        for key, t in state[part].items():
            t.copy_(want[part][key])
    state["progress"] = want["progress"]


def _equal(a: dict, b: dict) -> bool:
    tensors = all(torch.equal(a[p][k], b[p][k]) for p in ("model", "optim") for k in a[p])
    return tensors and a["progress"] == b["progress"]


def _manager(url, incremental=False):
    from shardkit.checkpoint import CheckpointManager

    return CheckpointManager(
        url,
        1,
        max_to_keep=MAX_TO_KEEP,
        max_pending_async=MAX_PENDING,
        chkpt_on_preemption=False,
        incremental=incremental,
    )


def _loop(url: str, conn, incremental: bool) -> None:
    """The training loop that gets killed: resume, then save every step asynchronously.

    Its first save takes over the lease of the killed loop (same host, dead pid) and
    removes the incomplete step directories that loop left; it reports what is left
    (incremental: files that no listed step references).
    """
    from shardkit.checkpoint._manager._storage import StepStore

    torch.set_num_threads(1)
    mgr = _manager(url, incremental)
    latest = mgr.latest_step()
    state = _alloc()
    if latest is not None:
        mgr.restore(latest, state)
    ok = latest is None or _equal(state, _expected(latest))
    first = 0 if latest is None else latest + 1
    for step in itertools.count(first):
        _fill(state, step)
        mgr.save_async(step, state)
        if step == first:
            store = StepStore(url)
            if incremental:  # directories of deleted steps may keep referenced files
                leftover = _unreferenced_leftovers(store, store.committed_steps(), skip={first})
            else:
                leftover = [
                    s for s in store.list_step_dirs() if s != first and not store.has_marker(s)
                ]
            conn.send((latest, ok, leftover))


def _unreferenced_leftovers(store, steps, skip=()) -> list[str]:
    """Entries of directories without metadata that no listed step references."""
    from shardkit.checkpoint._manager._refs import referenced_files
    from shardkit.checkpoint._manager._storage import step_dir_name

    referenced = referenced_files(store, steps)
    bad = []
    for s in store.list_step_dirs():
        if s in steps or s in skip:
            continue
        name = step_dir_name(s)
        entries = os.listdir(os.path.join(store.root, name))
        bad += [f"{name}/{e}" for e in entries if e not in referenced.get(name, set())]
        bad += [f"{name}/ (empty)"] if not entries else []
    return bad


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_sigkill_at_random_moments_never_loses_a_committed_step(tmp_path, incremental):
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every child)

    from shardkit.checkpoint._manager._storage import StepStore

    url = str(tmp_path / "run")
    # fork: each restart is a copy of this already-warm process (torch and shardkit
    # imported), so 20 restarts cost well under a second each.
    ctx = mp.get_context("fork")
    rng = random.Random(20261122)
    newest, mid_save_kills = None, 0
    kills = KILLS_INCREMENTAL if incremental else KILLS
    for kill in range(kills):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_loop, args=(url, send, incremental), daemon=True)
        proc.start()
        send.close()
        try:
            assert recv.poll(60), f"kill {kill}: the loop did not start"
            resumed_from, restored_ok, leftover = recv.recv()
            assert resumed_from == newest, f"kill {kill}: resumed from {resumed_from}, not {newest}"
            assert restored_ok, f"kill {kill}: step {resumed_from} did not restore bit-exactly"
            assert leftover == [], f"kill {kill}: incomplete step directories survived {leftover}"
            time.sleep(rng.uniform(0.02, 0.4))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
        assert proc.exitcode == -signal.SIGKILL

        store = StepStore(url)
        dirs = store.list_step_dirs()
        mid_save_kills += any(not store.has_marker(s) for s in dirs)
        mgr = _manager(url, incremental)  # a reader until it saves: it deletes nothing
        steps = mgr.all_steps()
        assert set(steps) <= set(dirs), (steps, dirs)
        if newest is not None:
            assert steps and steps[-1] >= newest, f"kill {kill}: newest went back: {steps}"
        if steps:
            assert len(steps) <= MAX_TO_KEEP + MAX_PENDING, f"kill {kill}: retention: {steps}"
            assert steps == list(range(steps[0], steps[-1] + 1)), steps
            state = mgr.restore(steps[-1], _alloc())
            assert _equal(state, _expected(steps[-1])), f"kill {kill}: step {steps[-1]} differs"
            newest = steps[-1]
        mgr.close()
        assert store.list_step_dirs() == dirs, f"kill {kill}: a reader changed the directory"
    assert newest is not None and newest >= kills, f"the loop barely progressed: {newest}"
    assert mid_save_kills >= 1, "no kill landed during a save; the test exercised nothing"
    if incremental:  # every listed step shares the frozen bytes of an older directory
        from shardkit.checkpoint import read_metadata

        assert read_metadata(store.step_url(newest)).linked, "nothing was shared"
    print(f"newest step {newest}; {mid_save_kills}/{kills} kills interrupted a save")
