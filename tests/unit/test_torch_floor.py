"""The torch version floor: declared once in pyproject.toml, checked at import.

An audit (2026-11-29) installed older torch releases: 2.4 cannot import shardkit, 2.5 to
2.10 fail the unit tier (missing ``group_src``, ``no_dist``, ``modules(remove_duplicate=)``,
meta-load offsets) and 2.11 fails one dist test; 2.12.1 passes every tier.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardkit._torch_floor import MIN_TORCH, check_torch_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "version", ["2.12.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0.dev20261101", "3.0.0"]
)
def test_supported_versions_pass(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.4.1", "1.13.1+cu117", "2.9.0a0+git1234"])
def test_older_versions_raise_naming_the_version_and_the_fix(version):
    with pytest.raises(ImportError) as caught:
        check_torch_version(version)
    message = str(caught.value)
    assert f"torch {version} is installed" in message
    assert "pip install 'torch>=2.12'" in message


def test_a_version_that_is_not_a_release_number_is_left_to_the_imports():
    check_torch_version("local-build")


def test_the_floor_is_the_one_pyproject_declares():
    # a regex, not tomllib: tomllib is Python 3.11+ and shardkit supports 3.10
    declared = re.findall(
        r'"torch\s*>=\s*(\d+)\.(\d+)[^"]*"', (ROOT / "pyproject.toml").read_text()
    )
    assert len(declared) == 1, declared
    assert tuple(int(n) for n in declared[0]) == MIN_TORCH
