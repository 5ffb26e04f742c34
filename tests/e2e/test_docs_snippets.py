"""Every Python snippet in README.md and docs/*.md runs, and every example imports.

Snippets of one file run in order in one fresh single-process interpreter (a world of
one), like a doctest session, so later snippets may use names from earlier ones. A snippet
preceded by ``<!-- fragment -->`` (a piece of a larger program, e.g. a training-loop
excerpt) is compiled, not run.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
BLOCK = re.compile(r"(<!--\s*fragment\s*-->\s*)?```python\n(.*?)```", re.S)


def _snippets(path: Path):
    for match in BLOCK.finditer(path.read_text()):
        yield bool(match.group(1)), match.group(2)


def _clean_env():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_snippets_run(path, tmp_path):
    runnable, fragments = [], []
    for is_fragment, code in _snippets(path):
        (fragments if is_fragment else runnable).append(code)
    for code in fragments:
        compile(code, f"{path.name}:fragment", "exec")
    if not runnable:
        return
    script = tmp_path / "snippets.py"
    script.write_text("\n\n".join(runnable))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert result.returncode == 0, f"{path.name} snippets failed:\n{result.stderr[-3000:]}"


def test_docs_have_snippets():
    assert sum(1 for path in DOCS for _ in _snippets(path)) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_import(path):
    # importing must not start training: examples guard their main with __name__
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('example', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_clean_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
