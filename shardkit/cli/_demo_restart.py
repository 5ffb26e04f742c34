"""Timing a restart of the demo: from the SIGKILL of a rank to its first resumed step.

Every timestamp is wall-clock (``time.time()``), so the killed process's note of the
kill and the restarted processes' marks compare on one machine (or on machines whose
clocks agree).
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["RecoveryClock", "process_start_time"]


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc; now where there is no /proc.

    So the interpreter's start-up and imports count towards what follows the start.
    Resolution: one clock tick (10 ms on Linux).
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime): clock ticks since boot
        # the boot's epoch time, to the microsecond (/proc/stat's btime is whole seconds)
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class RecoveryClock:
    """Marks of one restarted process: start, then each phase of its recovery.

    ``kill_file`` is the JSON note ``{"rank", "step", "time"}`` the killed rank wrote
    just before its SIGKILL; without it (a real crash) the restart phase is unknown.
    """

    PHASES = ("restart", "rendezvous", "setup", "restore", "first_step")

    def __init__(self, kill_file: str | None = None) -> None:
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.restarted = self.restart_count > 0
        self.killed_at = None
        if self.restarted and kill_file and os.path.exists(kill_file):
            with open(kill_file) as f:
                self.killed_at = float(json.load(f)["time"])
        self.marks = {"start": process_start_time()}

    def mark(self, phase: str) -> None:
        """Note that ``phase`` (rendezvous, setup, restore, first_step) ended now."""
        if phase not in self.PHASES[1:]:
            raise ValueError(f"unknown phase {phase!r}; choose from {self.PHASES[1:]}")
        self.marks[phase] = time.time()

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase: restart (kill -> process start), rendezvous (process start ->
        process group joined, imports included), setup (model, optimizer, manager),
        restore, first_step. Phases not reached, or unknown, are left out."""
        out = {}
        if self.killed_at is not None:
            out["restart"] = self.marks["start"] - self.killed_at
        previous = self.marks["start"]
        for phase in self.PHASES[1:]:
            if phase in self.marks:
                out[phase] = self.marks[phase] - previous
                previous = self.marks[phase]
        return out

    def total(self) -> float:
        """Seconds from the kill (or the process start) to the last mark."""
        return sum(self.breakdown().values())
