"""Loads never map a data file: a file larger than RAM loads within destination + a small
buffer, and a load works under an address-space limit (RLIMIT_AS) far below the file.

The large file is written by our own ``save`` (header, checksums, metadata) from a
read-only anonymous mapping (the kernel's huge zero page, so no memory), through a
``FileSystemWriter`` that leaves a hole for the zero tensor's bytes: it stays sparse on
disk and takes seconds of CPU (hashing the zeros).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

GiB = 1 << 30
MiB = 1 << 20

_SAVE = textwrap.dedent(
    """
    import mmap, os, sys, warnings
    import torch
    import shardkit.checkpoint as dcp
    sys.path.insert(0, sys.argv[3])
    from column_planner import ColumnPlanner

    class SmallColumns(ColumnPlanner):  # "small" as column halves, "huge" whole
        def create_global_plan(self, plans):
            huge = [[i for i in p.items if i.key == "huge"] for p in plans]
            for p in plans:
                p.items[:] = [i for i in p.items if i.key != "huge"]
            out = super().create_global_plan(plans)
            for p, h in zip(out, huge):
                p.items[:0] = h
            return out

    class SparseWriter(dcp.FileSystemWriter):
        # leaves a hole for the zero tensor's bytes, which come right after the header
        # (the largest chunk goes first in a file)

        def write_file(self, name, parts):
            self._makedirs()
            fd = os.open(self.join(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                pos, zero_end = 0, None
                for part in parts:
                    part = memoryview(part).cast("B")
                    if zero_end is None:
                        zero_end = len(part) + big  # the header, then the zeros
                    elif pos + len(part) <= zero_end:
                        pos += len(part)  # a hole reads back as zeros
                        continue
                    os.pwrite(fd, part, pos)
                    pos += len(part)
                os.ftruncate(fd, pos)
            finally:
                os.close(fd)

    big = int(sys.argv[2])
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    zeros = mmap.mmap(-1, big, flags=flags, prot=mmap.PROT_READ)
    try:  # read faults map the huge zero page: one fault per 2 MiB, not per 4 KiB
        zeros.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        huge = torch.frombuffer(zeros, dtype=torch.uint8)
    small = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    writer = SparseWriter(sys.argv[1], sync_files=False, max_file_bytes=None)
    dcp.save({"huge": huge, "small": small}, storage_writer=writer, planner=SmallColumns())
    """
)

_LOAD = textwrap.dedent(
    """
    import os, resource, sys
    import torch
    import shardkit.checkpoint as dcp

    def rss():
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmSize"].split()[0]) * 1024

    small = torch.empty(64, 256)
    torch.zeros(1).add_(1)  # warm torch's allocator and kernels before measuring
    before, vm = rss()
    # ru_maxrss is the peak of the whole process, imports included, which can exceed
    # the RSS measured here; reset the kernel's peak (VmHWM) so it covers the load only.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    headroom = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    if len(sys.argv) > 3:  # show the limit bites: a read-only map of the file fails
        import mmap
        with open(os.path.join(sys.argv[1], sys.argv[3]), "rb") as f:
            try:
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError:
                print("MAPFAIL")
        sys.exit(0)
    dcp.load({"small": small}, checkpoint_id=sys.argv[1], strict=False)
    expect = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    assert torch.equal(small, expect), "values differ"
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    peak = int(status["VmHWM"].split()[0]) * 1024
    print("GROWTH", max(0, peak - before))
    """
)


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.fixture(scope="module")
def huge_checkpoint(tmp_path_factory):
    """A checkpoint whose one data file is larger than RAM (and past 32 GiB), sparse."""
    root = tmp_path_factory.mktemp("huge") / "ckpt"
    big = max(32 * GiB, _ram() + GiB)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = _run(_SAVE, str(root), str(big), tests_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    data = [n for n in os.listdir(root) if n.startswith("data-")]
    assert len(data) == 1, data
    st = os.stat(root / data[0])
    if st.st_blocks * 512 > GiB:
        pytest.skip(f"{root} is not on a file system that keeps holes (sparse files)")
    assert st.st_size > big > _ram()
    return root


def test_resharded_load_from_a_file_larger_than_ram(huge_checkpoint):
    """A band load (the chunks are column halves) from the file's last bytes, past 32 GiB,
    with an address-space limit of 256 MiB over what the process had mapped before: a
    mapping of the file (private or shared) would not fit."""
    out = _run(_LOAD, str(huge_checkpoint), str(256 * MiB))
    assert out.returncode == 0, out.stderr[-3000:]
    growth = int(out.stdout.split("GROWTH")[1])
    assert growth <= 64 * 256 * 4 + 256 * MiB, growth


def test_the_address_space_limit_bites(huge_checkpoint):
    """Under the same limit, even a read-only shared map of the data file fails."""
    (data,) = [n for n in os.listdir(huge_checkpoint) if n.startswith("data-")]
    out = _run(_LOAD, str(huge_checkpoint), str(256 * MiB), data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MAPFAIL" in out.stdout
