"""Helpers of the hostile-input tests: a hard time limit, and the CLI run in-process."""

from __future__ import annotations

import contextlib
import io
import signal
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import pytest

from shardkit.cli import main


@contextlib.contextmanager
def fail_after(seconds: int):
    """Fail the test instead of hanging: opening a FIFO to read blocks until a writer
    comes, so a missed O_NONBLOCK would otherwise stall the whole suite."""
    signal.signal(signal.SIGALRM, lambda *a: pytest.fail(f"blocked for {seconds} s"))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def shardkit(*args, code: int) -> SimpleNamespace:
    """``shardkit ARGS`` in this process; asserts the exit code, no traceback and no
    internal class names in what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        got = main([str(a) for a in args])
    result = SimpleNamespace(returncode=got, stdout=out.getvalue(), stderr=err.getvalue())
    assert got == code, (got, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert "Reader(" not in result.stderr + result.stdout
    return result
