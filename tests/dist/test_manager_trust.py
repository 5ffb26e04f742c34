"""CheckpointManager never loses a step, on 2 real ranks.

A second writer is refused by the lease, a reader during a save deletes nothing, a bad
step is skipped, disagreeing steps raise everywhere, and a save that hit ENOSPC leaves
no partial files so the next one succeeds once space is back.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest
import torch
from harness import run_ranks


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(64, 8), "b": torch.zeros(8), "step": -1}


def _same(got: dict, step: int) -> bool:
    want = _state(step)
    return (
        torch.equal(got["w"], want["w"])
        and torch.equal(got["b"], want["b"])
        and got["step"] == want["step"]
    )


def _mgr(path, **kw):
    from shardkit.checkpoint import CheckpointManager

    return CheckpointManager(path, 1, chkpt_on_preemption=False, **kw)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# -- two writers --------------------------------------------------------------------------
def _two_writers(tmp):
    from shardkit.checkpoint import CheckpointError

    out = {}
    a = _mgr(f"{tmp}/run")
    a.save(1, _state(1))
    b = _mgr(f"{tmp}/run")  # a second trainer on the same directory
    try:
        b.save(2, _state(2))
        out["b_refused"] = None
    except CheckpointError as exc:
        out["b_refused"] = str(exc)
    out["a_saves_on"] = a.save(2, _state(2))
    out["steps"] = a.all_steps()
    out["restored_2"] = _same(a.restore(2, _empty()), 2)
    # a third one takes over explicitly; the first then fails at its next save
    c = _mgr(f"{tmp}/run", take_over_lease=True)
    out["c_saves"] = c.save(3, _state(3))
    try:
        a.save(4, _state(4))
        out["a_lost"] = None
    except CheckpointError as exc:
        out["a_lost"] = str(exc)
    out["final"] = c.all_steps()
    c.close()
    b.close()
    a.close()
    return out


def test_second_writer_is_refused_and_destroys_nothing(tmp_path):
    for r in run_ranks(_two_writers, 2, str(tmp_path)):
        assert r["b_refused"] and "lease" in r["b_refused"], r["b_refused"]
        assert "take_over_lease=True" in r["b_refused"] and "read_only=True" in r["b_refused"]
        assert f"pid {os.getpid()}" not in r["b_refused"]  # names the writer's pid, not ours
        assert r["a_saves_on"] and r["steps"] == [1, 2] and r["restored_2"]
        assert r["c_saves"]
        assert r["a_lost"] and "lost its lease" in r["a_lost"], r["a_lost"]
        assert r["final"] == [1, 2, 3]


# -- a reader during a save -------------------------------------------------------------------
def _reader_during_save(tmp):
    import threading

    import torch.distributed as dist

    from shardkit.checkpoint._core import _storage

    real = _storage.FileSystemWriter.write_file
    written, gate = threading.Event(), threading.Event()

    def held_write(self, name, parts):
        real(self, name, parts)
        if "step_00000002" in self.url:
            written.set()
            assert gate.wait(60), "the test never released the save"

    _storage.FileSystemWriter.write_file = held_write
    out = {}
    try:
        writer = _mgr(f"{tmp}/run")
        writer.save(1, _state(1))
        assert writer.save_async(2, _state(2))
        assert written.wait(60)  # step 2's data is on disk, its commit not yet done
        dist.barrier()
        for kw in ({"read_only": True}, {}):  # explicit reader, and implicit until a save
            reader = _mgr(f"{tmp}/run", **kw)
            out.setdefault("reader_steps", []).append(reader.all_steps())
            out.setdefault("reader_restores", []).append(_same(reader.restore(1, _empty()), 1))
            reader.close()
        try:
            _mgr(f"{tmp}/run", read_only=True).save(3, _state(3))
            out["ro_save"] = "saved"
        except ValueError as exc:
            out["ro_save"] = str(exc)
        out["in_progress_kept"] = os.path.isdir(f"{tmp}/run/step_00000002")
        gate.set()
        writer.join()
        out["steps"] = writer.all_steps()
        out["restored_2"] = _same(writer.restore(2, _empty()), 2)
        writer.close()
    finally:
        gate.set()
        _storage.FileSystemWriter.write_file = real
    return out


def test_reader_during_training_deletes_nothing(tmp_path):
    for r in run_ranks(_reader_during_save, 2, str(tmp_path)):
        assert r["reader_steps"] == [[1], [1]] and r["reader_restores"] == [True, True]
        assert "read-only" in r["ro_save"], r["ro_save"]
        assert r["in_progress_kept"]
        assert r["steps"] == [1, 2] and r["restored_2"]


# -- a bad step among good ones ---------------------------------------------------------------
def _bad_step(tmp):
    import torch.distributed as dist

    rank = dist.get_rank()
    path = f"{tmp}/run"
    with _mgr(path) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step))
    if rank == 0:  # damage steps 3, 4 and 5 three ways
        with open(f"{path}/step_00000005/metadata.json", "w") as f:
            f.write('{"format": "shardkit", "tensors": 5')  # malformed JSON
        with open(f"{path}/step_00000004/metadata.json", "w") as f:
            f.write('{"format": [], "tensors": {"w": 7}}')  # valid JSON, wrong shape
        os.remove(f"{path}/step_00000003/metadata.json")
        os.mkfifo(f"{path}/step_00000003/metadata.json")  # would block a plain open()
    dist.barrier()
    records = _Records()
    logging.getLogger("shardkit").addHandler(records)
    try:
        mgr = _mgr(path)
        out = {"steps": mgr.all_steps(), "latest": mgr.latest_step()}
        out["restored"] = _same(mgr.restore(out["latest"], _empty()), out["latest"])
        out["saved_6"] = mgr.save(6, _state(6))
        out["after"] = mgr.all_steps()
        mgr.close()
    finally:
        logging.getLogger("shardkit").removeHandler(records)
    out["warnings"] = records.messages if rank == 0 else None
    return out


def test_bad_step_is_skipped_and_the_newest_good_step_restores(tmp_path):
    res = run_ranks(_bad_step, 2, str(tmp_path), timeout=60)
    for r in res:
        assert r["steps"] == [1, 2] and r["latest"] == 2 and r["restored"]
        assert r["saved_6"] and r["after"] == [1, 2, 6]
    warned = " | ".join(res[0]["warnings"])
    for step in (3, 4, 5):
        assert f"skipping step {step}" in warned, warned


# -- ranks disagree on the step ---------------------------------------------------------------
def _mismatched_steps(tmp):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    mgr = _mgr(f"{tmp}/run")
    for what, args in (("step", (3 + rank,)), ("force", (5, rank == 1))):
        try:
            out[what] = ("returned", mgr.save(*args[:1], _state(5), *args[1:]))
        except ValueError as exc:
            out[what] = ("raised", str(exc))
    try:  # a loss that is NaN on one rank only
        mgr.save(3, _state(3), metrics={"loss": float("nan") if rank == 1 else 0.5})
        out["metrics"] = ("returned",)
    except ValueError as exc:
        out["metrics"] = ("raised", str(exc))
    out["steps"] = mgr.all_steps()
    out["then"] = mgr.save(4, _state(4)) and mgr.all_steps()
    mgr.close()
    return out


def test_ranks_passing_different_steps_raise_on_every_rank(tmp_path):
    got = run_ranks(_mismatched_steps, 2, str(tmp_path))
    assert "another rank passed invalid metrics" in got[0]["metrics"][1]
    assert "metrics" in got[1]["metrics"][1] and "nan" in got[1]["metrics"][1].lower()
    for r in got:
        assert r["step"][0] == "raised" and "steps from 3 to 4" in r["step"][1], r["step"]
        assert r["force"][0] == "raised" and "force" in r["force"][1], r["force"]
        assert r["metrics"][0] == "raised", r["metrics"]
        assert r["steps"] == []
        assert r["then"] == [4]


def _different_options(tmp):
    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointManager

    from shardkit.checkpoint import LocalTier

    rank = dist.get_rank()
    out = []
    for kw in (
        {"save_interval": 2 + rank},
        # a RAM tier bound on one rank only: that rank alone refused its saves
        {"save_interval": 1, "local_tier": LocalTier(directory=tmp, max_bytes=2**30 + rank)},
    ):
        try:
            CheckpointManager(os.path.join(tmp, "run"), chkpt_on_preemption=False, **kw)
            out.append("constructed")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_ranks_given_different_options_raise_on_every_rank(tmp_path):
    """save_interval 2 on rank 0 and 3 on rank 1 used to hang at the first save (each
    rank in a different collective) past the group timeout (errors audit)."""
    for interval, tier in run_ranks(_different_options, 2, str(tmp_path), timeout=60):
        assert "different options on different ranks (save_interval: [2, 3]" in interval
        assert "max_to_keep" not in interval
        assert "local_tier.max_bytes: [1073741824, 1073741825]" in tier, tier


# -- ENOSPC, then space again -----------------------------------------------------------------
def _enospc(tmp, real_disk):
    import torch.distributed as dist

    from shardkit.checkpoint import CheckpointError
    from shardkit.checkpoint._core import _storage

    rank = dist.get_rank()
    path, ballast = f"{tmp}/run", f"{tmp}/ballast"
    quota = {"bytes": None}
    real_write = _storage._write_local

    def du() -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp) for f in fs)

    def quota_write(p, parts, *, exclusive, sync, **kw):
        def limited():
            for part in parts:
                if quota["bytes"] is not None and du() + len(part) > quota["bytes"]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), p)
                yield part

        real_write(p, limited(), exclusive=exclusive, sync=sync, **kw)

    if not real_disk:  # a fault-injecting disk: a byte quota over everything under tmp
        _storage._write_local = quota_write
    out = {}
    try:
        mgr = _mgr(path)
        state = {"w": torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256)}
        mgr.save(1, state)
        dist.barrier()
        if rank == 0:  # fill the disk: leave less room than one checkpoint
            if real_disk:
                with open(ballast, "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * (64 << 10))
                            f.flush()
                    except OSError:
                        pass
                os.truncate(ballast, max(0, os.path.getsize(ballast) - (256 << 10)))
        dist.barrier()
        quota["bytes"] = du() + (256 << 10)
        try:
            mgr.save(2, {"w": state["w"] + 2})
            out["full"] = None
        except CheckpointError as exc:
            out["full"] = str(exc)
        out["left_behind"] = sorted(os.listdir(path))
        dist.barrier()
        if rank == 0 and real_disk:
            os.remove(ballast)  # space is back
        dist.barrier()
        quota["bytes"] = du() + (4 << 20)
        out["saved_3"] = mgr.save(3, {"w": state["w"] + 3})
        out["steps"] = mgr.all_steps()
        got = mgr.restore(3, {"w": torch.zeros(512, 256)})
        out["restored_3"] = torch.equal(got["w"], state["w"] + 3)
        # the same with a background save: the failure surfaces at join()
        dist.barrier()
        quota["bytes"] = du() + (256 << 10)
        if real_disk and rank == 0:
            with open(ballast, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (64 << 10))
                        f.flush()
                except OSError:
                    pass
        dist.barrier()
        mgr.save_async(4, {"w": state["w"] + 4})
        try:
            mgr.join()
            out["async_full"] = None
        except CheckpointError as exc:
            out["async_full"] = str(exc)
        dist.barrier()  # the coordinator has removed the failed step by its join()
        out["async_left_behind"] = sorted(os.listdir(path))
        dist.barrier()  # both ranks listed before close() releases the lease
        mgr.close()
    finally:
        _storage._write_local = real_write
    return out


def _check_enospc(res):
    for r in res:
        assert r["full"] and "No space left" in r["full"], r["full"]
        assert r["left_behind"] == ["manager.lease", "step_00000001"], r["left_behind"]
        assert r["saved_3"] and r["steps"] == [1, 3] and r["restored_3"]
        assert r["async_full"] and "background save of step 4" in r["async_full"]
        assert r["async_left_behind"] == ["manager.lease", "step_00000001", "step_00000003"]


def test_enospc_leaves_nothing_and_the_next_save_succeeds(tmp_path):
    _check_enospc(run_ranks(_enospc, 2, str(tmp_path), False))


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 3 MiB tmpfs (needs root and mount rights; skipped without them)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the fault-injecting test covers ENOSPC")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_on_a_real_full_filesystem(small_tmpfs):
    _check_enospc(run_ranks(_enospc, 2, str(small_tmpfs), True))
