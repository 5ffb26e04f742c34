"""`shardkit ckpt ...` on real files: output, exit codes, one-line errors.

Most checks call the command line's ``main(argv)`` in this process, which is exactly what
the console script runs, because each fresh interpreter costs seconds of torch import on
a loaded 2-core machine; ``test_entry_points_as_subprocesses`` runs the real executables
(the console script and ``python -m shardkit``) for exit codes, stderr and --debug.
"""

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from harness import run_ranks
from safetensors.torch import load_file

import shardkit.checkpoint as dist_cp
from shardkit.cli import main


def shardkit(*args, ok=(0,)):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in args])
    result = SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    assert code in ok, (code, result.stdout, result.stderr)
    return result


def subprocess_shardkit(*args, console_script=False, ok=(0,)):
    exe = (
        [str(Path(sys.executable).parent / "shardkit")]
        if console_script
        else [
            sys.executable,
            "-m",
            "shardkit",
        ]
    )
    result = subprocess.run([*exe, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert result.returncode in ok, (result.returncode, result.stdout, result.stderr)
    return result


def one_line_error(result, *needles):
    """Non-zero exit, exactly one `shardkit: error:` line, no traceback."""
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardkit: error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _save_sharded(path):
    import shardkit.spmd as xs

    mesh = xs.Mesh([0, 1], (2,), ("data",))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    state = {
        "model": {"w": xs.mark_sharding(w, mesh, ("data", None)), "b": torch.arange(5.0)},
        "step": 7,
    }
    dist_cp.save(state, checkpoint_id=path)
    return w.tolist()  # plain data: a tensor would travel as a shared fd of a dying process


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    sharded = root / "sharded"
    w = torch.tensor(run_ranks(_save_sharded, 2, str(sharded), timeout=120)[0])
    plain = root / "plain"
    state = {"model": {"w": w.clone(), "b": torch.arange(5.0)}, "step": 7}
    dist_cp.save(state, checkpoint_id=str(plain))
    changed = root / "changed"
    state["model"]["w"][1, 2] += 0.25
    state["model"]["extra"] = torch.ones(3)
    del state["model"]["b"]
    dist_cp.save(state, checkpoint_id=str(changed))
    return {"root": root, "sharded": sharded, "plain": plain, "changed": changed, "w": w}


def test_inspect_table_and_json(ckpts):
    table = shardkit("ckpt", "inspect", ckpts["sharded"]).stdout
    assert "world size     2 (at save)" in table and "format version 2" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("model.w "))
    assert row[:4] == ["model.w", "float32", "6x4", "2"]  # saved by 2 ranks: 2 chunks
    assert "step = 7" in table
    info = json.loads(shardkit("ckpt", "inspect", "--json", f"file://{ckpts['sharded']}").stdout)
    md = dist_cp.read_metadata(str(ckpts["sharded"]))
    assert info["world_size"] == 2 and info["format_version"] == 2
    assert info["created"] == md.created and info["values"] == {"step": 7}
    assert info["tensors"]["model.w"] == {
        "dtype": "float32",
        "shape": [6, 4],
        "chunks": 2,
        "bytes": 96,
    }
    assert info["tensors"]["model.b"]["chunks"] == 1


def test_inspect_single_files(tmp_path):
    """inspect reads a safetensors or torch.save file too (it refused any file before),
    through diff's checked readers: a hostile header is refused, nothing allocated."""
    from safetensors.torch import save_file

    state = {"w": torch.zeros(6, 4), "b": torch.zeros(6, dtype=torch.bfloat16)}
    save_file(state, tmp_path / "m.safetensors")
    torch.save({"model": state, "epoch": 3}, tmp_path / "m.pt")
    info = json.loads(shardkit("ckpt", "inspect", "--json", tmp_path / "m.safetensors").stdout)
    assert info["format"] == "safetensors" and info["total_bytes"] == 96 + 12
    assert info["tensors"]["b"] == {"dtype": "bfloat16", "shape": [6], "chunks": 1, "bytes": 12}
    table = shardkit("ckpt", "inspect", tmp_path / "m.pt").stdout
    assert "format         torch file" in table and "epoch = 3" in table
    row = next(line.split() for line in table.splitlines() if line.startswith("model.w "))
    assert row[:3] == ["model.w", "float32", "6x4"]
    # a header declaring 2**40 floats over 8 bytes of data
    header = b'{"x":{"dtype":"F32","shape":[1099511627776],"data_offsets":[0,8]}}'
    (tmp_path / "bad.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + b"\0" * 8
    )
    one_line_error(shardkit("ckpt", "inspect", tmp_path / "bad.safetensors", ok=(3,)), "'x'")


def test_verify_ok_then_corrupt_names_file_key_and_chunk(ckpts, tmp_path):
    import shutil

    ok = shardkit("ckpt", "verify", ckpts["sharded"])
    assert ok.stdout.startswith("OK ") and "2 tensors, 3 chunks" in ok.stdout
    assert "verify" in ok.stderr  # the progress bar

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["sharded"], bad)
    md = dist_cp.read_metadata(str(bad))
    chunk = md.tensors["model.w"].chunks[1]
    path = bad / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 3] ^= 0x40
    path.write_bytes(bytes(data))
    result = subprocess_shardkit("ckpt", "verify", "--no-progress", bad, ok=(1,))
    assert "FAILED" in result.stderr
    one_line_error(result, chunk.file, "'model.w'", "offsets=[3, 0]", "checksum mismatch")
    # a truncated file is named too, and the other commands refuse the corrupt data
    path.write_bytes(bytes(data[:-8]))
    one_line_error(shardkit("ckpt", "verify", bad, ok=(1,)), chunk.file, "truncated")
    one_line_error(shardkit("ckpt", "diff", bad, ckpts["sharded"], ok=(3,)), chunk.file)


def test_ls_lists_manager_steps_with_times_and_sizes(tmp_path):
    run = tmp_path / "run"
    mgr = dist_cp.CheckpointManager(str(run), save_interval=10, chkpt_on_preemption=False)
    for step in range(21):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()
    (run / "step_00000030").mkdir()  # an interrupted save: no metadata.json
    out = shardkit("ckpt", "ls", run).stdout.splitlines()
    assert out[0].split() == ["STEP", "CREATED", "SIZE", "FILES", "SHARED", "STATUS"]
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["0", "10", "20", "30"]
    for r in rows[:3]:
        md = dist_cp.read_metadata(str(run / f"step_{int(r[0]):08d}"))
        assert r[1] == md.created and r[-1] == "committed" and r[3] == "B"
    assert rows[3][1] == "-" and "incomplete" in out[4]
    # verify on the run directory checks every committed step and skips the incomplete one
    checked = shardkit("ckpt", "verify", "--no-progress", run).stdout.splitlines()
    assert [x.split()[0] for x in checked] == ["OK", "OK", "OK", "skipped"]
    one_line_error(shardkit("ckpt", "ls", run / "step_00000010", ok=(2,)), "single checkpoint")
    one_line_error(shardkit("ckpt", "inspect", run, ok=(2,)), "CheckpointManager directory")


def test_convert_every_direction_round_trips(ckpts, tmp_path):
    src, w = ckpts["sharded"], ckpts["w"]
    st, pt = tmp_path / "m.safetensors", tmp_path / "m.pt"
    shardkit("ckpt", "convert", src, st)  # --to inferred from the suffix
    shardkit("ckpt", "convert", src, pt, "--to", "torch", "--from", "shardkit")
    assert torch.equal(load_file(st)["model.w"], w)
    assert torch.equal(torch.load(pt, weights_only=True)["model.w"], w)
    # torch.save -> safetensors goes through a temporary shardkit checkpoint
    st2 = tmp_path / "from_torch.safetensors"
    shardkit("ckpt", "convert", pt, st2, "--to", "safetensors")
    back = tmp_path / "back"
    shardkit("ckpt", "convert", st2, back, "--to", "shardkit")
    # a torch.distributed.checkpoint directory imports too
    import torch.distributed.checkpoint as tdcp

    tdir = tmp_path / "torch_dcp"
    tdcp.save({"model": {"w": w, "b": torch.arange(5.0)}}, checkpoint_id=str(tdir), no_dist=True)
    imported = tmp_path / "imported"
    shardkit("ckpt", "convert", tdir, imported, "--from", "torch-dcp", "--to", "shardkit")
    # everything that came back equals the source, key by key (diff exits 0)
    same = shardkit("ckpt", "diff", src, back).stdout
    assert "differ: 0" in same and "only in A" in same and "identical: 3" in same
    assert "identical: 2" in shardkit("ckpt", "diff", imported, st, ok=(1,)).stdout
    # an existing destination is kept unless --overwrite
    one_line_error(shardkit("ckpt", "convert", src, st, ok=(2,)), "already exists")
    shardkit("ckpt", "convert", src, st, "--overwrite")


def test_diff_reports_keys_and_largest_difference(ckpts):
    out = shardkit("ckpt", "diff", ckpts["plain"], ckpts["changed"], ok=(1,)).stdout
    lines = out.splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("only in A"))) + 1].split() == [
        "model.b"
    ]
    assert any(x.split() == ["model.extra"] for x in lines)
    differ = next(x for x in lines if x.strip().startswith("model.w"))
    assert "max |a-b| = 0.25" in differ
    assert "identical: 1" in out  # step
    # a sharded save and a plain save of the same values are identical
    assert shardkit("ckpt", "diff", ckpts["sharded"], ckpts["plain"]).returncode == 0
    tolerant = shardkit("ckpt", "diff", "--atol", "0.3", ckpts["plain"], ckpts["changed"], ok=(1,))
    assert "differ: 0" in tolerant.stdout


def test_bad_inputs_give_one_line_and_debug_gives_traceback(ckpts, tmp_path):
    missing = tmp_path / "nope"
    for cmd in (["ls"], ["inspect"], ["verify"], ["convert", "--to", "torch"], ["diff"]):
        args = [*cmd[:1], missing, *cmd[1:]]
        if cmd[0] == "convert":
            args.append(tmp_path / "out.pt")
        if cmd[0] == "diff":
            args.append(ckpts["plain"])
        one_line_error(shardkit("ckpt", *args, ok=(2,)), str(missing), "does not exist")
    # a corrupt metadata file
    bad = tmp_path / "badmeta"
    bad.mkdir()
    (bad / "metadata.json").write_text("{not json")
    one_line_error(shardkit("ckpt", "inspect", bad, ok=(3,)), "not valid JSON")  # damaged
    # wrong formats
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    one_line_error(shardkit("ckpt", "convert", junk, tmp_path / "x", ok=(2,)), "cannot tell")
    one_line_error(shardkit("ckpt", "inspect", junk, ok=(2,)), "cannot tell the format")
    # demo options that cannot work are refused before anything starts
    one_line_error(shardkit("demo", "--hook", "fp16", ok=(2,)), "--strategy ddp only")
    one_line_error(shardkit("demo", "--nnodes", "2", ok=(2,)), "--master-addr", "--out")
    one_line_error(shardkit("demo", "--nproc", "4", "--batch-size", "2", ok=(2,)), "--batch-size 2")
    # --debug adds the traceback, on either side of the subcommand; the status stays
    for args in (["--debug", "ckpt", "inspect", missing], ["ckpt", "inspect", "--debug", missing]):
        result = shardkit(*args, ok=(2,))
        assert "Traceback" in result.stderr and "FileNotFoundError" in result.stderr


def test_entry_points_as_subprocesses(ckpts, tmp_path):
    version = subprocess_shardkit("--version", console_script=True)
    assert version.stdout.startswith("shardkit ")
    info = json.loads(subprocess_shardkit("ckpt", "inspect", "--json", ckpts["sharded"]).stdout)
    assert info["tensors"]["model.w"]["chunks"] == 2
    missing = tmp_path / "nope"
    one_line_error(subprocess_shardkit("ckpt", "verify", missing, ok=(2,)), "does not exist")
    debug = subprocess_shardkit("--debug", "ckpt", "verify", missing, ok=(2,))
    assert "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


def test_fsspec_urls_work_like_paths():
    # memory:// lives in this process, which is why this runs main() in-process
    url = "memory://cli-test/run"
    mgr = dist_cp.CheckpointManager(url, save_interval=1, chkpt_on_preemption=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((3, 2), float(step)), "note": "x"})
    mgr.close()
    rows = shardkit("ckpt", "ls", url).stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["1", "2"]
    info = json.loads(shardkit("ckpt", "inspect", "--json", f"{url}/step_00000002").stdout)
    assert info["tensors"]["w"]["shape"] == [3, 2] and info["values"] == {"note": "x"}
    assert shardkit("ckpt", "verify", f"{url}/step_00000002").stdout.startswith("OK")
    diff = shardkit("ckpt", "diff", f"{url}/step_00000001", f"{url}/step_00000002", ok=(1,))
    assert "max |a-b| = 1" in diff.stdout
    shardkit("ckpt", "convert", f"{url}/step_00000002", "memory://cli-test/w.safetensors")
    shardkit("ckpt", "convert", "memory://cli-test/w.safetensors", "memory://cli-test/back")
    same = shardkit("ckpt", "diff", f"{url}/step_00000002", "memory://cli-test/back")
    assert "identical: 2" in same.stdout
