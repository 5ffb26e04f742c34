"""No file in the package maps memory executable or hand-assembles machine code."""

import pathlib
import re

import shardkit

_FORBIDDEN = re.compile(r"PROT_EXEC|mprotect|MAP_EXECUTABLE|PAGE_EXECUTE|VirtualProtect")


def test_no_file_in_the_package_maps_memory_executable():
    root = pathlib.Path(shardkit.__file__).parent
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h", ".pyx")]
    assert len(files) > 20, root  # the package itself, not an empty directory
    hits = [
        f"{p.relative_to(root)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if _FORBIDDEN.search(line)
    ]
    assert hits == []


def test_the_pattern_catches_executable_mappings():
    assert _FORBIDDEN.search("libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_EXEC)")
