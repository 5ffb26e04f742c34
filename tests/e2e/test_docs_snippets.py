"""Every Python block in README.md and docs/*.md runs alone, as ``python`` and under torchrun.

Each block is its own script, run in a fresh directory twice: as a plain ``python`` run (a
world of one) and under ``torchrun --nproc-per-node 2``, with no teardown call. Every
process must exit 0, and the block must print something (what it prints shows the world
it ran in: shard sizes, a world size, equal gradients). A block preceded by
``<!-- fragment -->`` (a piece of a larger program, e.g. a training-loop excerpt) is only
compiled. A block preceded by ``<!-- continued -->`` goes on with the example of the blocks
just before it (its prose says so): it runs appended to them, as one script, and that
script (the longest of the chain) stands for the chain's earlier blocks. Examples under
``examples/`` must import without starting to train, and run both ways.

One doc file, or one example, is one test. Their runs start in the background as soon as
collection ends, two at a time, and use the cores the rest of the suite leaves idle; each
test waits for its own runs (so its reported duration is only what was left to wait for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from _torchrun import clean_env, torchrun_cmd

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
BLOCK = re.compile(r"(?:<!--\s*(fragment|continued)\s*-->\s*)?```python\n(.*?)```", re.S)


def snippets(path: Path) -> list[tuple[bool, int, str]]:
    """``(is_fragment, line, script)`` per python block of ``path``; a continued block's
    script starts with the blocks it continues."""
    text, out, story = path.read_text(), [], ""
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(2)) + 1
        if m.group(1) == "fragment":
            out.append((True, line, m.group(2)))
            continue
        story = story + "\n" + m.group(2) if m.group(1) == "continued" else m.group(2)
        out.append((False, line, story))
    return out


def scripts_to_run(path: Path) -> list[tuple[str, str]]:
    """``(script, where)`` of each chain of runnable blocks (a block alone is a chain)."""
    runnable = [(line, code) for frag, line, code in snippets(path) if not frag]
    chains = []
    for i, (line, code) in enumerate(runnable):
        continued = i + 1 < len(runnable) and runnable[i + 1][1].startswith(code + "\n")
        if not continued:
            first = next(ln for ln, c in runnable if code.startswith(c))
            chains.append((code, f"{path.name}:{first}" + (f"-{line}" if first != line else "")))
    return chains


RUN_TIMEOUT_S = 240
_LIVE: set[subprocess.Popen] = set()  # runs in flight, killed if the session ends first
_LIVE_LOCK = threading.Lock()


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``cmd``; on timeout kill it and every process it started (torchrun's workers)."""
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, _ = proc.communicate()
            out += f"\n[killed after {RUN_TIMEOUT_S} s]"
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: torchrun's workers sit in sessions of their own."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:  # the task ended meanwhile
                continue
            found += kids
            todo += kids
    return found


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything it started, so no worker holds the output pipe."""
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


HOWS = ("python", "torchrun --nproc-per-node 2")


def _command(how: str, script: Path, args: list[str]) -> list[str]:
    return (
        [sys.executable, str(script), *args] if how == "python" else torchrun_cmd(script, 2, *args)
    )


def run_job(label: str, how: str, script: Path, runs: list[list[str]], cwd: Path) -> list[str]:
    """Run ``script`` one way, once per argument list in ``runs``, in order, in ``cwd``;
    the failures, each with the run's output. Every run must exit 0 and print something."""
    cwd.mkdir(parents=True)
    failures = []
    for args in runs:
        result = _run(_command(how, script, [a.format(d=cwd) for a in args]), cwd)
        name = f"{label} {args} as {how}" if args else f"{label} as {how}"
        if result.returncode != 0:
            failures.append(f"{name}: exit {result.returncode}\n{result.stdout[-2500:]}")
        elif not result.stdout.strip():
            failures.append(f"{name}: printed nothing; show what it did")
    return failures


# Each example, with small arguments ({d}: its run's directory), both as ``python`` and under
# torchrun; train_with_manager.py runs both ways in test_manager_example / test_torchrun.
EXAMPLE_RUNS = {
    "ddp_digits.py": [["--epochs", "1"]],
    "fsdp_digits.py": [["--epochs", "1", "--out", "{d}/out"]],
    "spmd_fsdp.py": [["--steps", "2"]],
    "spmd_tensor_parallel.py": [["--steps", "2"]],
    "checkpoint_reshard.py": [["save", "{d}/ckpt"], ["load", "{d}/ckpt"]],
}
DOCS_WITH_BLOCKS = [p for p in DOCS if snippets(p)]

# Every run is its own process tree, so no run waits for a test: the runs of every selected
# test of this module start in the background when collection ends (see tests/conftest.py),
# in the tests' order, and fill the cores the in-process tests leave idle; each test then
# waits for its own runs. Two at a time: a torchrun run is three processes.
NUM_PARALLEL_RUNS = 2
_SCHEDULED: dict[str, list[Future]] = {}


def _jobs(test: str, tmp: Path) -> list[tuple]:
    """``run_job`` arguments for the test named ``test`` (its parameter id)."""
    jobs = []
    if test in EXAMPLE_RUNS:
        script = ROOT / "examples" / test
        for how in reversed(HOWS):
            jobs.append((test, how, script, EXAMPLE_RUNS[test], tmp / test / how.split()[0]))
        return jobs
    path = next(p for p in DOCS_WITH_BLOCKS if p.name == test)
    for i, (code, where) in enumerate(scripts_to_run(path)):
        script = tmp / test / str(i) / "block.py"
        script.parent.mkdir(parents=True)
        script.write_text(code)
        for how in reversed(HOWS):
            jobs.append((where, how, script, [[]], script.parent / how.split()[0]))
    return jobs


def _test_id(item) -> str | None:
    prefixes = ("test_doc_blocks_run_alone_both_ways[", "test_examples_run_both_ways[")
    return item.name.split("[", 1)[1][:-1] if item.name.startswith(prefixes) else None


def start_runs(items: list, config) -> None:
    """Start, in the background, the runs of the tests of this module among ``items``.
    Called by tests/conftest.py once collection is done."""
    tests = [t for t in map(_test_id, items) if t is not None and t not in _SCHEDULED]
    if not tests:
        return
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-doc-runs-"))
    pool = ThreadPoolExecutor(NUM_PARALLEL_RUNS, thread_name_prefix="doc-run")
    for test in tests:
        _SCHEDULED[test] = [pool.submit(run_job, *job) for job in _jobs(test, tmp)]

    def stop() -> None:  # a session that ends early starts no more runs and kills its own
        pool.shutdown(wait=False, cancel_futures=True)
        with _LIVE_LOCK:
            for proc in list(_LIVE):
                _kill(proc)
        pool.shutdown(wait=True)
        shutil.rmtree(tmp, ignore_errors=True)

    config.add_cleanup(stop)


@pytest.fixture
def scheduled(request, tmp_path) -> list[Future]:
    """Futures of this test's runs' failures; runs them now if the collection hook did not
    start them (as when the module is run without conftest)."""
    test = _test_id(request.node)
    if test not in _SCHEDULED:
        with ThreadPoolExecutor(NUM_PARALLEL_RUNS) as pool:
            _SCHEDULED[test] = [pool.submit(run_job, *job) for job in _jobs(test, tmp_path)]
    return _SCHEDULED[test]


def _failures(futures) -> list[str]:
    return [f for future in futures for f in future.result()]


@pytest.mark.parametrize("path", DOCS_WITH_BLOCKS, ids=lambda p: p.name)
def test_doc_blocks_run_alone_both_ways(path, scheduled):
    for is_fragment, line, code in snippets(path):
        if is_fragment:
            compile(code, f"{path.name}:{line}", "exec")
    failures = _failures(scheduled)
    assert not failures, "\n\n".join(failures)


def test_docs_have_runnable_blocks():
    assert sum(1 for path in DOCS for frag, _, _ in snippets(path) if not frag) >= 10


_IMPORT_ALL = """
import contextlib, importlib.util, io, json, sys, traceback
import torch.distributed as dist
report = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            spec = importlib.util.spec_from_file_location("example", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        error = None
    except BaseException:
        error = traceback.format_exc()[-2000:]
    report[path] = {"printed": out.getvalue(), "joined": dist.is_initialized(), "error": error}
print(json.dumps(report))
"""


def test_examples_import_without_training():
    """Importing an example must not start training: each guards its main with
    ``__name__``, so importing prints nothing and joins no process group. One interpreter
    imports them all, one after another."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *map(str, EXAMPLES)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert sorted(report) == sorted(map(str, EXAMPLES))
    bad = {
        Path(p).name: r
        for p, r in report.items()
        if r != {"printed": "", "joined": False, "error": None}
    }
    assert not bad, bad


def test_every_example_has_a_run():
    assert sorted(EXAMPLE_RUNS) == sorted(
        p.name for p in EXAMPLES if p.name != "train_with_manager.py"
    )


@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_examples_run_both_ways(name, scheduled):
    failures = _failures(scheduled)
    assert not failures, "\n\n".join(failures)


if __name__ == "__main__":  # python tests/e2e/test_docs_snippets.py [DOC.md ...]: failures only
    for name in sys.argv[1:] or [p.name for p in DOCS_WITH_BLOCKS]:
        for job in _jobs(name, Path(tempfile.mkdtemp())):
            for failure in run_job(*job):
                print(failure, "\n")
