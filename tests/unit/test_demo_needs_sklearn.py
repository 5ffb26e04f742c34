"""`shardkit demo` without a usable scikit-learn (the `demo` extra): one error line and
exit 2 from the launcher, before torchrun starts any rank."""

import os
import subprocess
import sys

from shardkit.cli import _demo, main
from shardkit.cli._demo_parts import DIGITS_MISSING


def test_missing_sklearn_stops_the_launcher_before_torchrun(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed

    def no_torchrun(cmd, *args, **kwargs):
        raise AssertionError(f"torchrun was started: {cmd}")

    monkeypatch.setattr(_demo.subprocess, "Popen", no_torchrun)
    out = tmp_path / "out"
    code = main(["demo", "--no-preempt", "--steps", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == f"shardkit: error: {DIGITS_MISSING}\n"
    assert "pip install 'shardkit[demo]'" in captured.err
    assert captured.out == ""  # not even the work directory line
    assert not out.exists()


def test_broken_sklearn_is_reported_in_one_line(tmp_path):
    # a scikit-learn that is found but fails to import, in a real `python -m shardkit`
    stub = tmp_path / "stub" / "sklearn"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'scipy'\")\n")
    path = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "shardkit", "demo", "--no-preempt", "--steps", "2"]
        + ["--out", str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # the launcher stopped before printing its work directory
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("shardkit: error: the demo trains on scikit-learn's")
    assert "(No module named 'scipy')" in result.stderr
    assert "pip install 'shardkit[demo]'" in result.stderr
    assert not (tmp_path / "out").exists()
