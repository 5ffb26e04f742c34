"""Layers import downward only: runtime -> spmd -> checkpoint -> fsdp/ddp -> cli."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "shardkit"
# what each layer may import from shardkit (besides itself)
ALLOWED = {
    "runtime": set(),
    "spmd": {"runtime"},
    "checkpoint": {"runtime", "spmd"},
    "ddp": {"runtime"},
    "fsdp": {"runtime", "spmd", "checkpoint"},
    "cli": {"runtime", "spmd", "checkpoint", "ddp", "fsdp"},
}
BASE = {"_version"}


def _shardkit_imports(path: Path, layer: str):
    tree = ast.parse(path.read_text())
    package_parts = path.relative_to(ROOT.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shardkit" and len(parts) > 1:
                    yield node.lineno, parts[1]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package_parts[: len(package_parts) - node.level + 1])
                target = base + (node.module.split(".") if node.module else [])
                if len(target) > 1:
                    yield node.lineno, target[1]
                else:  # "from .. import runtime"
                    for alias in node.names:
                        yield node.lineno, alias.name
            elif node.module and node.module.split(".")[0] == "shardkit":
                parts = node.module.split(".")
                if len(parts) > 1:
                    yield node.lineno, parts[1]
                else:
                    for alias in node.names:
                        yield node.lineno, alias.name


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_point_down(layer):
    offenders = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for lineno, target in _shardkit_imports(path, layer):
            if target != layer and target not in ALLOWED[layer] | BASE:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{lineno} imports {target}")
    assert offenders == []


def test_spmd_layout_is_pure():
    tree = ast.parse((ROOT / "spmd" / "layout.py").read_text())
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.startswith("torch") for name in imported), imported
