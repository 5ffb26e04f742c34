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

Blocks run two at a time (the suite's budget is two cores); one doc file is one test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )


def run_block(code: str, where: str, tmp: Path) -> list[str]:
    """Run one block both ways; the failures, each with the block's output."""
    script = tmp / "block.py"
    script.write_text(code)
    failures = []
    for how, cmd in (
        ("python", [sys.executable, str(script)]),
        ("torchrun --nproc-per-node 2", torchrun_cmd(script, 2)),
    ):
        cwd = tmp / how.split()[0]
        cwd.mkdir()
        result = _run(cmd, cwd)
        if result.returncode != 0:
            failures.append(f"{where} as {how}: exit {result.returncode}\n{result.stdout[-2500:]}")
        elif not result.stdout.strip():
            failures.append(f"{where} as {how}: printed nothing; show what the block did")
    return failures


@pytest.mark.parametrize("path", [p for p in DOCS if snippets(p)], ids=lambda p: p.name)
def test_doc_blocks_run_alone_both_ways(path, tmp_path):
    for is_fragment, line, code in snippets(path):
        if is_fragment:
            compile(code, f"{path.name}:{line}", "exec")
    runnable = scripts_to_run(path)
    dirs = [tmp_path / str(i) for i in range(len(runnable))]
    for d in dirs:
        d.mkdir()
    with ThreadPoolExecutor(2) as pool:
        failures = pool.map(
            lambda args: run_block(*args), [(*r, d) for r, d in zip(runnable, dirs)]
        )
        failures = [f for fs in failures for f in fs]
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


if __name__ == "__main__":  # python tests/e2e/test_docs_snippets.py [DOC.md ...]: failures only
    import tempfile

    for name in sys.argv[1:] or [p.name for p in DOCS]:
        path = next(p for p in DOCS if p.name == name)
        for code, where in scripts_to_run(path):
            for failure in run_block(code, where, Path(tempfile.mkdtemp())):
                print(failure, "\n")


# Each example, with small arguments ({d}: a fresh directory), both as ``python`` and under
# torchrun; train_with_manager.py runs both ways in test_manager_example / test_torchrun.
EXAMPLE_RUNS = {
    "ddp_digits.py": [["--epochs", "1"]],
    "fsdp_digits.py": [["--epochs", "1", "--out", "{d}/out"]],
    "spmd_fsdp.py": [["--steps", "2"]],
    "spmd_tensor_parallel.py": [["--steps", "2"]],
    "checkpoint_reshard.py": [["save", "{d}/ckpt"], ["load", "{d}/ckpt"]],
}


def test_every_example_has_a_run():
    assert sorted(EXAMPLE_RUNS) == sorted(
        p.name for p in EXAMPLES if p.name != "train_with_manager.py"
    )


@pytest.mark.parametrize("name", sorted(EXAMPLE_RUNS))
def test_examples_run_both_ways(name, tmp_path):
    script = ROOT / "examples" / name

    def both(how: str) -> list[str]:
        d = tmp_path / how
        d.mkdir()
        out = []
        for args in EXAMPLE_RUNS[name]:
            args = [a.format(d=d) for a in args]
            cmd = (
                [sys.executable, str(script), *args]
                if how == "python"
                else torchrun_cmd(script, 2, *args)
            )
            result = _run(cmd, d)
            if result.returncode != 0:
                out.append(
                    f"{name} {args} as {how}: exit {result.returncode}\n{result.stdout[-3000:]}"
                )
        return out

    with ThreadPoolExecutor(2) as pool:
        failures = [f for fs in pool.map(both, ["python", "torchrun"]) for f in fs]
    assert not failures, "\n\n".join(failures)
