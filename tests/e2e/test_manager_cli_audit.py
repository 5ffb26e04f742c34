"""The checkpoint manager and the command line, as a demanding user tried to break them
(audit of 2026-11-29):

- ``ckpt diff`` called int64 values past 2**53 that differ identical, and identical
  checkpoints holding inf or NaN different;
- ``--debug`` changed the documented exit status to 1;
- ``ckpt ls`` / ``verify`` called the directory holding an incremental run's shared data
  "incomplete (never committed)", which invites deleting it and with it every step;
- ``verify`` of a run whose every step is incomplete verified nothing and exited 0;
- after a failed background save of step N, step N could never be saved again;
- a preemption at a step not newer than the last saved one saved nothing, yet
  ``reached_preemption`` said it had;
- a ``read_only`` manager swallowed SIGTERM;
- a step skipped for malformed metadata was reported as "files missing or cut short".
"""

import logging
import signal

import pytest
import torch
from safetensors.torch import save_file
from test_cli import shardkit

from shardkit.checkpoint import CheckpointError, CheckpointManager

pytestmark = pytest.mark.timeout(120)


def test_diff_compares_integers_exactly(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"step": torch.tensor([2**60], dtype=torch.int64)}, str(a))
    save_file({"step": torch.tensor([2**60 + 1], dtype=torch.int64)}, str(b))
    result = shardkit("ckpt", "diff", a, b, ok=(1,))
    assert "differ: 1" in result.stdout and "identical: 0" in result.stdout


def test_diff_matches_equal_infinities_and_nans(tmp_path):
    values = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")])
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    save_file({"x": values}, str(a))
    save_file({"x": values.clone()}, str(b))
    save_file({"x": torch.tensor([1.0, float("inf"), float("-inf"), 0.0])}, str(c))
    assert "identical: 1" in shardkit("ckpt", "diff", a, b).stdout
    assert "max |a-b| = nan" in shardkit("ckpt", "diff", a, c, ok=(1,)).stdout


def test_debug_keeps_the_documented_exit_status(tmp_path):
    result = shardkit("--debug", "ckpt", "inspect", tmp_path / "no-such", ok=(2,))
    assert "Traceback" in result.stderr and "shardkit: error:" in result.stderr


def test_the_shared_data_of_an_incremental_run_is_named_as_such(tmp_path):
    run, frozen = tmp_path / "run", torch.randn(64, 64)
    with CheckpointManager(
        str(run), 1, max_to_keep=2, incremental=True, chkpt_on_preemption=False
    ) as mgr:
        for step in range(4):  # step 0 holds the frozen tensor every later step reads
            mgr.save(step, {"base": frozen, "lora": torch.full((4, 4), float(step))})
    assert not (run / "step_00000000" / "metadata.json").exists()  # retention removed it
    listing = shardkit("ckpt", "ls", run).stdout
    assert "shared data of step(s) 2, 3" in listing and "incomplete" not in listing
    verified = shardkit("ckpt", "verify", "--no-progress", run).stdout
    assert "step_00000000: no checkpoint of its own; shared data of step(s) 2, 3" in verified
    assert "OK" in verified


def test_verify_of_a_run_without_any_checkpoint_is_an_error(tmp_path):
    (tmp_path / "run" / "step_00000001").mkdir(parents=True)
    result = shardkit("ckpt", "verify", "--no-progress", tmp_path / "run", ok=(2,))
    assert "no committed step to verify" in result.stderr


def test_a_step_whose_background_save_failed_can_be_saved_again(tmp_path, monkeypatch):
    from concurrent.futures import Future

    from shardkit.checkpoint._manager import _io

    def failing(mgr, step, state_dict, base):  # the writer fails (a full disk, ...)
        future = Future()
        future.set_exception(OSError(28, "No space left on device"))
        return future

    with CheckpointManager(str(tmp_path / "run"), 1) as mgr:
        mgr.save(1, {"x": torch.ones(2)})
        with monkeypatch.context() as patch:
            patch.setattr(_io, "save_step_async", failing)
            mgr._watcher.trigger()  # the failed save is the preemption checkpoint
            assert mgr.save_async(2, {"x": torch.ones(2)})
            with pytest.raises(CheckpointError, match="background save of step 2"):
                mgr.join()
        assert mgr.all_steps() == [1]
        assert mgr.should_save(2) and not mgr.reached_preemption(2)
        assert mgr.save(2, {"x": torch.ones(2)})  # retried; it is the preemption one now
        assert mgr.all_steps() == [1, 2] and mgr.reached_preemption(2)


def test_a_preemption_at_an_old_step_is_not_reported_as_taken(tmp_path, caplog):
    path = str(tmp_path / "run")
    with CheckpointManager(path, 1) as mgr:
        for step in range(6):
            mgr.save(step, {"x": torch.full((2,), float(step))})
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        with CheckpointManager(path, 1) as mgr:
            mgr.restore(2, {"x": torch.zeros(2)})  # a rollback in the same directory
            assert "holds steps up to 5" in caplog.text
            mgr._watcher.trigger()  # as if SIGTERM arrived
            assert not mgr.save(3, {"x": torch.zeros(2)})
            assert not mgr.reached_preemption(3)
            assert "preemption signal at step 3 not saved" in caplog.text
            assert mgr.save(6, {"x": torch.zeros(2)})  # the first newer step takes it
            assert mgr.reached_preemption(6)


def test_a_read_only_manager_leaves_sigterm_alone(tmp_path):
    path = str(tmp_path / "run")
    with CheckpointManager(path, 1) as mgr:
        mgr.save(1, {"x": torch.ones(2)})
    before = signal.getsignal(signal.SIGTERM)
    with CheckpointManager(path, 1, read_only=True) as reader:
        assert signal.getsignal(signal.SIGTERM) is before
        reader.restore(1, {"x": torch.zeros(2)})


def test_a_step_with_malformed_metadata_is_skipped_with_the_reason(tmp_path, caplog):
    path = tmp_path / "run"
    with CheckpointManager(str(path), 1, chkpt_on_preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.ones(2)})
    (path / "step_00000002" / "metadata.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        with CheckpointManager(str(path), 1, read_only=True) as reader:
            assert reader.latest_step() == 1
    assert "metadata.json: not valid JSON" in caplog.text


def test_a_damaged_step_names_itself_and_the_step_before_it(tmp_path):
    path = tmp_path / "run"
    with CheckpointManager(str(path), 1, chkpt_on_preemption=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((64,), float(step))})
    (data,) = (path / "step_00000002").glob("data-*")
    raw = bytearray(data.read_bytes())
    raw[-8] ^= 0xFF  # a bit flip of the same size: still listed as committed
    data.write_bytes(bytes(raw))
    with CheckpointManager(str(path), 1, read_only=True) as reader:
        assert reader.latest_step() == 2
        with pytest.raises(CheckpointError) as caught:
            reader.restore(2, {"x": torch.zeros(64)})
    assert type(caught.value).__name__ == "CorruptCheckpointError"
    message = str(caught.value)
    assert f"step 2 under {path} could not be restored" in message
    assert "checksum mismatch" in message and "the newest older step is 1" in message
