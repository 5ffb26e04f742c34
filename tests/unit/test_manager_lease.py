"""CheckpointManager in one process: the writer's lease, symlinks, S3 multipart aborts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from s3_server import LoopbackS3

from shardkit.checkpoint import CheckpointError, CheckpointManager, FileSystemWriter


def _mgr(path, **kw):
    return CheckpointManager(path, 1, chkpt_on_preemption=False, **kw)


def _lease(path):
    with open(os.path.join(path, "manager.lease")) as f:
        return json.load(f)


def _plant_lease(path, **fields):
    os.makedirs(path, exist_ok=True)
    doc = {"owner": "other:1:x", "host": "elsewhere", "pid": 1, "ttl": 60.0}
    doc.update(fields)
    with open(os.path.join(path, "manager.lease"), "w") as f:
        json.dump(doc, f)


def test_lease_is_taken_at_the_first_save_and_released_at_close(tmp_path):
    run = str(tmp_path / "run")
    mgr = _mgr(run)
    assert not os.path.exists(os.path.join(run, "manager.lease"))  # a reader until it saves
    mgr.save(1, {"w": torch.ones(2)})
    lease = _lease(run)
    assert lease["pid"] == os.getpid() and lease["host"] == socket.gethostname()
    assert lease["expires"] > time.time() + 50
    mgr.close()
    assert not os.path.exists(os.path.join(run, "manager.lease"))


def test_live_lease_of_another_host_is_refused_expired_one_taken(tmp_path):
    run = str(tmp_path / "run")
    _plant_lease(run, expires=time.time() + 600)
    with _mgr(run) as mgr:
        with pytest.raises(CheckpointError, match=r"owner 'other:1:x' \(host 'elsewhere'"):
            mgr.save(1, {"w": torch.ones(2)})
        assert mgr.all_steps() == []
    _plant_lease(run, expires=time.time() - 1)  # its writer stopped renewing it
    with _mgr(run) as mgr:
        assert mgr.save(1, {"w": torch.ones(2)})
        assert _lease(run)["pid"] == os.getpid()


def test_lease_of_a_dead_process_on_this_host_is_taken_at_once(tmp_path):
    run = str(tmp_path / "run")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    _plant_lease(run, host=socket.gethostname(), pid=int(dead.stdout), expires=time.time() + 600)
    with _mgr(run) as mgr:
        assert mgr.save(1, {"w": torch.ones(2)})
    _plant_lease(run, host=socket.gethostname(), pid=os.getppid(), expires=time.time() + 600)
    with _mgr(run) as mgr, pytest.raises(CheckpointError, match="lease"):
        mgr.save(2, {"w": torch.ones(2)})


@pytest.mark.parametrize("expires", [1e300, float("nan"), float("inf"), -5.0, True, "soon"])
def test_a_lease_expiring_at_no_real_time_is_unreadable_and_taken(tmp_path, caplog, expires):
    """Damage or tampering: NaN counted as live forever, and 1e300 or inf broke the
    message (OverflowError from time.gmtime) instead of naming the lease."""
    run = str(tmp_path / "run")
    _plant_lease(run, expires=expires)
    with _mgr(run) as mgr:
        assert mgr.save(1, {"w": torch.ones(2)})
        assert _lease(run)["pid"] == os.getpid()
    assert "ignoring an unreadable lease file" in caplog.text


def test_bad_lease_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="lease_ttl"):
        _mgr(str(tmp_path), lease_ttl=0)
    with pytest.raises(ValueError, match="lease_ttl must be .* from 1 to"):
        _mgr(str(tmp_path), lease_ttl=1e12)
    with pytest.raises(TypeError, match="read_only"):
        _mgr(str(tmp_path), read_only=1)


def test_manager_json_symlink_is_replaced_never_written_through(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "step_00000001").mkdir(parents=True)
    os.symlink(victim, run / "step_00000001" / "manager.json")
    with _mgr(str(run)) as mgr:
        assert mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 1.0})
        assert mgr.all_steps() == [1]
    assert victim.read_text() == "precious"
    assert not os.path.islink(run / "step_00000001" / "manager.json")


def test_symlinked_step_dir_is_skipped_and_refused(tmp_path, caplog):
    run, outside = tmp_path / "run", tmp_path / "outside"
    with _mgr(str(outside)) as mgr:
        mgr.save(5, {"w": torch.ones(2)})
    run.mkdir()
    os.symlink(outside / "step_00000005", run / "step_00000005")
    before = sorted(os.listdir(outside / "step_00000005"))
    with caplog.at_level("WARNING"), _mgr(str(run)) as mgr:
        assert mgr.all_steps() == []
        with pytest.raises(CheckpointError, match="step_00000005 is a symlink"):
            mgr.save(5, {"w": torch.zeros(2)})
    assert "skipping step 5" in caplog.text and "symlink" in caplog.text
    assert sorted(os.listdir(outside / "step_00000005")) == before
    assert os.path.islink(run / "step_00000005")


def test_symlink_planted_as_lease_is_refused(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim.txt"
    run.mkdir()
    victim.write_text("precious")
    os.symlink(victim, run / "manager.lease")
    with _mgr(str(run)) as mgr, pytest.raises(CheckpointError, match="manager.lease"):
        mgr.save(1, {"w": torch.ones(2)})
    assert victim.read_text() == "precious"


def test_interrupted_s3_upload_is_aborted_not_completed():
    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        opts = {**s3.storage_options, "default_block_size": 5 << 20}  # multipart at 5 MiB
        writer = FileSystemWriter("s3://ckpt/run", storage_options=opts)

        def parts():
            yield memoryview(bytes(6 << 20))  # one part goes up: a multipart upload exists
            raise RuntimeError("interrupted")

        with pytest.raises(RuntimeError, match="interrupted"):
            writer.write_file("data-x.safetensors", parts())
        fs = s3.filesystem()
        fs.invalidate_cache()
        assert not fs.exists("ckpt/run/data-x.safetensors")  # no truncated object published
        uploads = fs.call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", [])
        assert uploads == [], uploads


def test_writer_start_aborts_uploads_a_killed_writer_left_open():
    with LoopbackS3() as s3:
        s3.make_bucket("ckpt")
        opts = {**s3.storage_options, "default_block_size": 5 << 20}
        fs = s3.filesystem()

        def orphan(key):  # a part is uploaded, then the writer "dies" (never closes)
            f = fs.open(key, "wb", block_size=5 << 20)
            f.write(bytes(6 << 20))
            f.closed = True  # nobody will ever complete or abort it
            return key

        def uploads():
            found = fs.call_s3("list_multipart_uploads", Bucket="ckpt").get("Uploads", [])
            return sorted(u["Key"] for u in found)

        stale = orphan("ckpt/run/step_00000003/data-x.safetensors")
        other = orphan("ckpt/run/notes/big.bin")  # not a step: left alone
        keys = sorted(k.split("/", 1)[1] for k in (stale, other))
        assert uploads() == keys
        mgr = _mgr("s3://ckpt/run", storage_options=opts)
        assert uploads() == keys  # a reader aborts nothing
        mgr.save(4, {"w": torch.ones(2)})
        assert uploads() == ["run/notes/big.bin"]
        mgr.close()


def test_heartbeat_renews_the_lease_between_saves(tmp_path):
    run = str(tmp_path / "run")
    with _mgr(run, lease_ttl=1.5) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        first = _lease(run)["expires"]
        deadline = time.monotonic() + 20  # renewed every 0.5 s; generous for a busy host
        while _lease(run)["expires"] == first and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a file for a change, not ordering threads
        assert _lease(run)["expires"] > first, "the heartbeat never renewed the lease"
        assert _lease(run)["owner"] == mgr._lease.owner


def test_a_writer_that_lost_its_lease_deletes_nothing(tmp_path, caplog):
    run = str(tmp_path / "run")
    old = _mgr(run, max_to_keep=1)
    old.save(1, {"w": torch.ones(2)})
    old.save(2, {"w": torch.ones(2)})
    old.join()
    new = _mgr(run, take_over_lease=True)  # keeps every step
    new.save(3, {"w": torch.ones(2)})
    with caplog.at_level("WARNING"):
        old._retain()  # a retention pass of the old writer, after the take-over
    assert "lost its lease" in caplog.text
    assert new.all_steps() == [2, 3]  # old's max_to_keep=1 would have deleted step 2
    with pytest.raises(CheckpointError, match="lost its lease"):
        old.save(4, {"w": torch.ones(2)})
    new.close()
    old.close()
