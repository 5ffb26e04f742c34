"""`shardkit ckpt` when storage fails: a full disk or file-size limit while writing, a
store that cannot be accessed, and the exit codes of docs/cli.md (storage audit, items
9-13).

- ``convert`` to a ``.pt`` file on a full disk exited 4 ("internal error, please report")
  with torch's ``inline_container.cc ... unexpected pos`` instead of the OS error.
- ``materialize`` left its partial copy on a full disk (the disk stayed full).
- Disk-full errors of writes through fsspec (``convert`` to safetensors) named no file.
- Missing cloud credentials (botocore's NoCredentialsError) and an fsspec backend that
  is not installed exited 4, "a bug in shardkit".
- ``ls`` exited 0 on a DAMAGED step; docs/cli.md gives damaged checkpoints status 3.
- ``verify``'s last line repeated the checkpoint's path.

A full disk is a file-size limit (``RLIMIT_FSIZE``, EFBIG) set in a child process: no
root, no tmpfs. Everything else runs in-process through ``main(argv)``.
"""

import os
import subprocess
import sys

import pytest
import torch
from hostile import shardkit

import shardkit.checkpoint as dcp

#: The child's file-size limit: far below the 1 MiB checkpoint, above any file it reads.
_LIMIT = 64 << 10

_LIMITED = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = ["shardkit", *sys.argv[1:]]
runpy.run_module("shardkit", run_name="__main__")
"""


def _shardkit_with_file_size_limit(*args):
    code = _LIMITED.format(limit=_LIMIT)
    cmd = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _error_line(result):
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardkit: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 1 MiB checkpoint in a directory of its own."""
    path = tmp_path_factory.mktemp("src") / "big"
    dcp.save({"w": torch.randn(256 << 10), "b": torch.randn(10)}, checkpoint_id=path)
    return path


@pytest.mark.parametrize(
    "args",
    [
        ("convert", "out.pt"),
        ("convert", "out.safetensors"),
        ("materialize", "mat"),
    ],
    ids=["convert-torch", "convert-safetensors", "materialize"],
)
def test_a_full_disk_names_the_output_and_leaves_nothing(big, tmp_path, args):
    command, name = args
    result = _shardkit_with_file_size_limit("ckpt", command, big, tmp_path / name)
    line = _error_line(result)
    assert result.returncode == 2, (result.returncode, line)
    assert "internal error" not in line and "inline_container" not in line
    assert "File too large" in line and f"'{tmp_path / name}" in line, line
    assert os.listdir(tmp_path) == []  # no partial output, no temporary left


def test_a_failed_overwrite_keeps_the_old_output(big, tmp_path):
    out = tmp_path / "out.pt"
    torch.save({"old": torch.ones(3)}, out)
    before = out.read_bytes()
    result = _shardkit_with_file_size_limit("ckpt", "convert", big, out, "--overwrite")
    assert result.returncode == 2 and "File too large" in _error_line(result)
    assert out.read_bytes() == before  # written under a temporary name, never renamed
    assert os.listdir(tmp_path) == ["out.pt"]


def test_convert_and_materialize_still_write_their_output(big, tmp_path):
    shardkit("ckpt", "convert", big, tmp_path / "out.pt", code=0)
    state = {"w": torch.empty(256 << 10), "b": torch.empty(10)}
    dcp.load(state, checkpoint_id=big)
    assert torch.equal(torch.load(tmp_path / "out.pt")["w"], state["w"])
    shardkit("ckpt", "materialize", big, tmp_path / "mat", code=0)
    assert shardkit("ckpt", "verify", "--no-progress", tmp_path / "mat", code=0)
    (tmp_path / "empty").mkdir()  # an existing empty directory is materialized into
    shardkit("ckpt", "materialize", big, tmp_path / "empty", code=0)
    assert sorted(os.listdir(tmp_path)) == ["empty", "mat", "out.pt"]


def test_missing_cloud_credentials_are_a_storage_error_naming_the_url(monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    s3fs.S3FileSystem.clear_instance_cache()  # no client made with another test's keys
    try:
        url = "s3://no-such-bucket-shardkit-test/run"
        line = _error_line(shardkit("ckpt", "ls", url, code=2))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert line == f"shardkit: error: cannot access {url}: Unable to locate credentials"


def test_a_missing_fsspec_backend_is_a_storage_error():
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    line = _error_line(shardkit("ckpt", "ls", "gs://b/run", code=2))
    assert line.startswith("shardkit: error: cannot access gs://b/run: ") and "gcsfs" in line


def _truncate_a_file(step):
    md = dcp.read_metadata(step)
    name = md.tensors["w"].chunks[0].file
    (step / name).write_bytes((step / name).read_bytes()[:-4])
    return name


def test_ls_exits_3_on_a_damaged_step_but_0_on_an_incomplete_one(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2):
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=run / f"step_{step:08d}")
    (run / "step_00000003").mkdir()  # an interrupted save: never committed, not damage
    assert "incomplete" in shardkit("ckpt", "ls", run, code=0).stdout
    _truncate_a_file(run / "step_00000002")
    listing = shardkit("ckpt", "ls", run, code=3)
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert rows["1"].endswith("committed") and "DAMAGED" in rows["2"]  # the whole table
    assert "step 2" in listing.stderr and "truncated" in listing.stderr


def test_verify_names_the_checkpoint_once(tmp_path):
    ckpt = tmp_path / "c"
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=ckpt)
    name = _truncate_a_file(ckpt)
    line = _error_line(shardkit("ckpt", "verify", "--no-progress", ckpt, code=1))
    assert line.count(str(ckpt)) == 1, line
    assert line.startswith(f"shardkit: error: {ckpt}: file {name} is ")


_LIBRARY_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from shardkit.checkpoint import format_utils
try:
    format_utils.dcp_to_torch_save(sys.argv[1], sys.argv[2], progress=False)
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc.filename)
"""


def test_dcp_to_torch_save_on_a_full_disk_raises_the_os_error_and_leaves_nothing(big, tmp_path):
    # the library call the CLI makes: torch.save given a path raised its zip writer's
    # RuntimeError ("unexpected pos") and left half a file
    out = tmp_path / "out.pt"
    code = _LIBRARY_LIMITED.format(limit=_LIMIT)
    result = subprocess.run(
        [sys.executable, "-c", code, str(big), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.split() == ["OSError", "27", str(out)], result.stdout + result.stderr
    assert os.listdir(tmp_path) == []
