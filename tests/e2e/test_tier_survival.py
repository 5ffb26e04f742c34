"""The local checkpoint tier survives the death of its process, and only a clean exit
removes it: a real process saves, then dies (SIGKILL, SIGTERM, an uncaught exception);
a new process finds the copies, restores bit-exactly from the local tier, and its clean
exit removes them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from _torchrun import clean_env

SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from shardkit.checkpoint import CheckpointManager, LocalTier

    how, url, ram = sys.argv[1:]
    mgr = CheckpointManager(url, 10, chkpt_on_preemption=False,
                            local_tier=LocalTier(directory=ram))
    for step in range(1, 4):
        mgr.save_async(step, {"w": torch.arange(6.0) * step, "step": step})
    mgr.join()
    print("saved", flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    raise RuntimeError("training crashed")
    """
)

RESTORE = textwrap.dedent(
    """
    import sys, torch
    from shardkit.checkpoint import CheckpointManager, LocalTier

    url, ram = sys.argv[1:]
    with CheckpointManager(url, 10, chkpt_on_preemption=False,
                           local_tier=LocalTier(directory=ram)) as mgr:
        step = mgr.latest_step()
        state = mgr.restore(step, {"w": torch.zeros(6), "step": -1})
        assert torch.equal(state["w"], torch.arange(6.0) * 3) and state["step"] == 3
        print("restored", step, mgr.last_restore.tier, flush=True)
    """
)


@pytest.mark.parametrize("how", ["sigkill", "sigterm", "exception"])
def test_tier_survives_a_dead_process_and_goes_on_clean_exit(how, tmp_path):
    url, ram = str(tmp_path / "run"), str(tmp_path / "ram")
    (tmp_path / "save.py").write_text(SAVE)
    (tmp_path / "restore.py").write_text(RESTORE)
    run = dict(cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    died = subprocess.run([sys.executable, "save.py", how, url, ram], **run)
    expected = {"sigkill": -signal.SIGKILL, "sigterm": -signal.SIGTERM, "exception": 1}[how]
    assert died.returncode == expected, died.stdout + died.stderr
    assert "saved" in died.stdout
    copies = sorted(os.listdir(os.path.join(ram, "local", "rank_00000")))
    assert copies == ["step_00000002", "step_00000003"]
    back = subprocess.run([sys.executable, "restore.py", url, ram], **run)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "restored 3 local" in back.stdout
    assert not os.path.exists(ram)  # the clean exit of the restoring process removed it
