"""Memory stays bounded on hostile checkpoints: measured as peak RSS in a fresh process.

A 200 MB metadata.json is refused unread (the limit is 64 MiB); a shape of 10**12 is
refused by ``load``, ``to_safetensors`` and ``shardkit ckpt convert`` before anything is
allocated or written. Each case must raise the growth of peak RSS by less than 64 MiB.
"""

import json
import subprocess
import sys
import textwrap

import torch
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp

_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    import shardkit.checkpoint as dcp
    from shardkit.checkpoint import format_utils as fu
    from shardkit.cli import main

    path = sys.argv[1]
    for action in sys.argv[2:]:
        target = {"w": torch.zeros(4, 8), "b": torch.zeros(3)}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            if action == "load":
                dcp.load(target, checkpoint_id=path)
            elif action == "convert":
                fu.to_safetensors(path, path + ".safetensors", progress=False)
            else:
                print("exit", main(["ckpt", "convert", path, path + ".pt"]))
        except dcp.CorruptCheckpointError as exc:
            print("refused:", exc)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print("growth_kib", after - before)
    """
)


def _run(path, *actions):
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(path), *actions],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    growths = [int(line.split()[1]) for line in out.stdout.splitlines() if "growth_kib" in line]
    assert len(growths) == len(actions), out.stdout
    assert all(g < 64 << 10 for g in growths), (growths, out.stdout)
    return out.stdout + out.stderr


def _save(path):
    dcp.save({"w": torch.ones(4, 8), "b": torch.ones(3)}, checkpoint_id=path)
    return json.loads((path / "metadata.json").read_bytes())


def test_a_200_mb_metadata_file_is_refused_in_bounded_memory(tmp_path):
    _save(tmp_path)
    meta = tmp_path / "metadata.json"
    raw = meta.read_bytes()
    with open(meta, "r+b") as f:  # valid JSON start, 200 MB of padding (sparse on disk)
        f.seek(len(raw) - 1)
        f.write(b" " * 16)
        f.truncate(200 << 20)
    out = _run(tmp_path, "load")
    assert "refused:" in out and "more than the" in out


def test_a_huge_shape_is_refused_in_bounded_memory(tmp_path):
    doc = _save(tmp_path)
    t = doc["tensors"]["b"]
    t["shape"], t["chunks"][0]["sizes"] = [10**12], [10**12]
    t["chunks"][0]["nbytes"] = 4 * 10**12
    reseal_metadata(tmp_path, doc)
    out = _run(tmp_path, "load", "convert", "cli")
    assert out.count("refused:") == 2 and out.count("key 'b'") == 3
    assert "exit 3" in out
    assert not (tmp_path.parent / f"{tmp_path.name}.safetensors").exists()
    assert not (tmp_path.parent / f"{tmp_path.name}.pt").exists()
