"""The demo's restart clock: process start time from /proc and the phase breakdown."""

import json
import subprocess
import sys
import time

import pytest

from shardkit.cli._demo_restart import RecoveryClock, process_start_time


def test_process_start_time_is_when_the_process_started():
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from shardkit.cli._demo_restart import process_start_time as p;"
            "import time; print(p(), time.time())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    started, now = float(out[0]), float(out[1])
    assert before - 0.02 <= started <= now  # one 10 ms clock tick of resolution
    assert process_start_time() < before


def test_breakdown_adds_up_from_the_kill(tmp_path, monkeypatch):
    kill = tmp_path / "kill.json"
    killed_at = time.time() - 5.0
    kill.write_text(json.dumps({"rank": 1, "step": 3, "time": killed_at}))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    clock = RecoveryClock(str(kill))
    assert clock.restarted and clock.restart_count == 1
    for phase in ("rendezvous", "setup", "restore", "first_step"):
        clock.mark(phase)
    parts = clock.breakdown()
    assert list(parts) == ["restart", "rendezvous", "setup", "restore", "first_step"]
    assert parts["restart"] == pytest.approx(clock.marks["start"] - killed_at)
    assert clock.total() == pytest.approx(clock.marks["first_step"] - killed_at)
    with pytest.raises(ValueError, match="unknown phase 'restart'"):
        clock.mark("restart")


def test_first_attempt_has_no_restart_phase(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    clock = RecoveryClock(str(tmp_path / "absent.json"))
    clock.mark("rendezvous")
    assert not clock.restarted and list(clock.breakdown()) == ["rendezvous"]
