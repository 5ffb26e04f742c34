"""`shardkit ckpt` on hostile and damaged checkpoints: exit codes, one-line errors with the
real cause, damaged steps flagged, nothing unpickled, nothing hanging (issue 15, point 6).

Exit codes (docs/cli.md): 1 verify failed / diff differs, 2 usage error, 3 damaged
checkpoint, 4 internal error. Commands run in-process through ``main(argv)``.
"""

import io
import json
import os
import pickle
import warnings
from contextlib import redirect_stderr

import pytest
import torch
from hostile import fail_after, shardkit
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp
from shardkit.cli import main


@pytest.fixture(autouse=True)
def _no_hang():
    with fail_after(30):
        yield


def _error_line(result):
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardkit: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def _save(path):
    state = {"w": torch.arange(32, dtype=torch.float32).reshape(4, 8), "b": torch.ones(3)}
    return dcp.save(state, checkpoint_id=path)


def _flip_data(path, md):
    chunk = md.tensors["w"].chunks[0]
    f = path / chunk.file
    raw = bytearray(f.read_bytes())
    raw[chunk.offset + 5] ^= 0x10
    f.write_bytes(bytes(raw))
    return chunk.file


def _truncate(path, md):
    name = md.tensors["w"].chunks[0].file
    f = path / name
    f.write_bytes(f.read_bytes()[:-4])
    return name


def test_convert_reports_the_checksum_error_and_leaves_no_output(tmp_path):
    md = _save(tmp_path / "c")
    _flip_data(tmp_path / "c", md)
    out = tmp_path / "out.safetensors"
    line = _error_line(shardkit("ckpt", "convert", tmp_path / "c", out, code=3))
    assert "checksum mismatch" in line and "'w'" in line and "incomplete" not in line
    assert not out.exists()


@pytest.mark.parametrize("out_name", ["big.pt", "big.safetensors"])
def test_convert_never_writes_more_than_it_read(tmp_path, out_name):
    """A resealed 1 KB metadata edit declares 2 GB for 'w' with its 128 bytes of chunks:
    convert refuses it before writing (it used to write a 2 GB file and exit 0)."""
    _save(tmp_path / "c")
    meta = tmp_path / "c" / "metadata.json"
    doc = json.loads(meta.read_bytes())
    doc["tensors"]["w"]["shape"] = [4, 125_000_000]  # float32: 2 GB; the chunk stays 4 x 8
    reseal_metadata(tmp_path / "c", doc)
    out = tmp_path / out_name
    line = _error_line(shardkit("ckpt", "convert", tmp_path / "c", out, code=3))
    assert "key 'w'" in line and "cover 32 of its 500000000 elements" in line, line
    assert not out.exists() and not list(tmp_path.glob(f"{out_name}*"))


def test_verify_and_inspect_flag_a_truncated_committed_checkpoint(tmp_path):
    md = _save(tmp_path / "c")
    name = _truncate(tmp_path / "c", md)
    verify = shardkit("ckpt", "verify", "--no-progress", tmp_path / "c", code=1)
    assert f"{name} is" in verify.stderr and "truncated" in verify.stderr
    inspect = shardkit("ckpt", "inspect", tmp_path / "c", code=3)
    assert "KEY" in inspect.stdout  # the table is still shown
    assert "damaged" in inspect.stderr and name in inspect.stderr


def test_manager_directory_damaged_step_is_not_called_uncommitted(tmp_path):
    root = tmp_path / "run"
    _save(root / "step_00000001")
    md = _save(root / "step_00000002")
    _truncate(root / "step_00000002", md)
    (root / "step_00000003").mkdir()  # an interrupted save: never committed
    ls = shardkit("ckpt", "ls", root, code=3)  # a damaged step: status 3
    rows = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert rows["1"].endswith("committed") and "DAMAGED" in rows["2"]
    assert "never committed" in rows["3"]
    assert "step 2" in ls.stderr and "truncated" in ls.stderr
    verify = shardkit("ckpt", "verify", "--no-progress", root, code=1)
    assert "step_00000002" in _error_line(verify)
    assert "skipped" in verify.stdout and "step_00000003" in verify.stdout
    assert "OK" in verify.stdout and "step_00000001" in verify.stdout


def test_damaged_metadata_is_exit_3_and_a_verify_failure(tmp_path):
    _save(tmp_path / "c")
    meta = tmp_path / "c" / "metadata.json"
    raw = bytearray(meta.read_bytes())
    raw[40] ^= 0x01
    meta.write_bytes(bytes(raw))
    assert "checksum mismatch" in _error_line(shardkit("ckpt", "inspect", tmp_path / "c", code=3))
    assert "checksum mismatch" in shardkit("ckpt", "verify", tmp_path / "c", code=1).stderr


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_auto_detected_torch_dcp_with_a_payload_never_runs_it(tmp_path):
    import torch.distributed.checkpoint as tdcp

    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tdcp.save({"a": torch.ones(2)}, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    (tmp_path / "t" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    hint = shardkit("ckpt", "inspect", tmp_path / "t", code=2)  # detection: names only
    assert "torch.distributed.checkpoint" in _error_line(hint)
    line = _error_line(shardkit("ckpt", "convert", tmp_path / "t", tmp_path / "s", code=3))
    assert "refused" in line
    assert not marker.exists() and not (tmp_path / "s").exists()


def test_a_fifo_hangs_nothing(tmp_path):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    assert "not a regular file" in _error_line(
        shardkit("ckpt", "convert", fifo, tmp_path / "out", code=2)
    )
    md = _save(tmp_path / "c")
    name = md.tensors["w"].chunks[0].file
    (tmp_path / "c" / name).unlink()
    os.mkfifo(tmp_path / "c" / name)
    assert "not a regular file" in shardkit("ckpt", "verify", tmp_path / "c", code=1).stderr
    line = _error_line(shardkit("ckpt", "convert", tmp_path / "c", tmp_path / "o.pt", code=3))
    assert name in line


def test_usage_errors_and_diff_options(tmp_path):
    _save(tmp_path / "c")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a checkpoint at all")
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(["ckpt", "diff", "--atol", "-1", str(tmp_path / "c"), str(tmp_path / "c")])
    assert exit_.value.code == 2 and ">= 0" in err.getvalue()
    line = _error_line(shardkit("ckpt", "diff", junk, tmp_path / "c", code=2))
    assert "cannot tell the format" in line and "--from" not in line
    line = _error_line(shardkit("ckpt", "convert", junk, tmp_path / "x", code=2))
    assert "--from" in line  # convert has it


@pytest.mark.parametrize("argv", [[], ["ckpt"]], ids=["shardkit", "shardkit ckpt"])
def test_a_missing_command_is_a_usage_error(argv, capsys):
    """``shardkit`` alone printed its help and exited 0, so `shardkit && next` went on."""
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"usage: {' '.join(['shardkit', *argv])} ")


def test_an_internal_error_is_one_line_exit_4(tmp_path, monkeypatch):
    from shardkit.cli import _ckpt

    _save(tmp_path / "c")

    def broken(path):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(_ckpt, "describe", broken)
    line = _error_line(shardkit("ckpt", "inspect", tmp_path / "c", code=4))
    assert "internal error" in line and "a bug over two lines" in line and "--debug" in line


def test_torch_file_with_an_expanded_view_is_refused_by_convert_and_diff(tmp_path):
    """A stride-0 view (x.expand(n)) holds n elements over 4 bytes of storage: convert
    wrote 4 MiB (or any n) from a 1.4 KB file and diff asked for 4 TB (exit 4); both now
    refuse the file, naming the key, before allocating or writing anything."""
    small, huge = tmp_path / "small.pt", tmp_path / "huge.pt"
    torch.save({"x": torch.zeros(1).expand(1 << 20)}, small)
    torch.save({"w": torch.zeros(1).expand(10**12)}, huge)
    out = tmp_path / "out"
    line = _error_line(shardkit("ckpt", "convert", small, out, code=3))
    assert "small.pt" in line and "key 'x'" in line and "expanded" in line, line
    assert not out.exists()
    line = _error_line(shardkit("ckpt", "diff", huge, huge, code=3))
    assert "huge.pt" in line and "key 'w'" in line and "4000000000000 bytes" in line, line


def test_torch_file_with_tied_weights_and_views_converts(tmp_path):
    w, x = torch.arange(64.0).reshape(8, 8), torch.arange(24.0).reshape(4, 6)
    state = {"emb": w, "head": w, "t": x.t(), "cols": x[:, ::2]}
    torch.save(state, tmp_path / "ok.pt")
    shardkit("ckpt", "convert", tmp_path / "ok.pt", tmp_path / "ok", code=0)
    shardkit("ckpt", "diff", tmp_path / "ok.pt", tmp_path / "ok", code=0)
