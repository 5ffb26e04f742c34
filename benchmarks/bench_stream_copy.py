"""Does the streaming-store copy pay off end to end? ``copy_`` vs streaming, side by side.

The two copy paths that ``shardkit/checkpoint/_core/_stream_copy.py`` serves are timed end to
end in one world of one, each in its own process (the routine is chosen once per process by
``SHARDKIT_STREAMING_COPY``), rounds interleaved so drift in the machine hits both alike:

- ``async_block``: the time ``async_save`` blocks (staging the state into reused buffers);
- ``reshard_load``: a load whose chunks were saved as column halves, so every destination
  row is filled side by side from two chunks (the band path that uses streaming row copies).

Prints one JSON line per size: medians and spreads of both paths and their ratio
(streaming / copy_; below 1 means the streaming stores are faster).

    python benchmarks/bench_stream_copy.py --sizes-mib 64 1024 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
_HERE = os.path.dirname(os.path.abspath(__file__))


def _child(mib: int, root: str, repeats: int) -> dict:
    import torch

    sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
    import shardkit.checkpoint as dcp
    from column_planner import ColumnPlanner

    num_tensors = 4
    rows = mib * MiB // 4 // num_tensors // 1024
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(rows, 1024, generator=g) for i in range(num_tensors)}
    block = []
    for i in range(repeats + 1):  # the first save allocates and touches the staging buffer
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=f"{root}/async")
        elapsed = time.perf_counter() - t0
        fut.result()
        if i:
            block.append(elapsed)
    dcp.save(sd, checkpoint_id=f"{root}/cols", planner=ColumnPlanner())
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    load = []
    for i in range(repeats + 1):  # the first load warms the page cache and the target
        t0 = time.perf_counter()
        dcp.load(target, checkpoint_id=f"{root}/cols")
        elapsed = time.perf_counter() - t0
        if i:
            load.append(elapsed)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    from shardkit.checkpoint._core._stream_copy import streaming_available

    return {
        "async_block": statistics.median(block),
        "reshard_load": statistics.median(load),
        "streaming": streaming_available(),
    }


def _run(mode: str, mib: int, repeats: int) -> dict:
    env = dict(os.environ, SHARDKIT_STREAMING_COPY="1" if mode == "streaming" else "0")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(mib), root, str(repeats)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["streaming"] != (mode == "streaming"):
        raise RuntimeError(f"{mode} run used streaming={result['streaming']}")
    return result


def _spread(values: list[float]) -> list[float]:
    return [round(min(values), 4), round(max(values), 4)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mib, root, repeats = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
        print(json.dumps(_child(mib, root, repeats)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per process")
    args = parser.parse_args()
    for mib in args.sizes_mib:
        runs = {"copy": [], "streaming": []}
        for r in range(args.rounds):
            order = ("copy", "streaming") if r % 2 == 0 else ("streaming", "copy")
            for mode in order:
                runs[mode].append(_run(mode, mib, args.repeats))
        line = {"bench": "stream_copy", "size_mib": mib, "rounds": args.rounds}
        for metric in ("async_block", "reshard_load"):
            c = [x[metric] for x in runs["copy"]]
            s = [x[metric] for x in runs["streaming"]]
            ratios = [b / a for a, b in zip(c, s)]  # paired by round
            line[metric] = {
                "copy_s": round(statistics.median(c), 4),
                "streaming_s": round(statistics.median(s), 4),
                "copy_spread_s": _spread(c),
                "streaming_spread_s": _spread(s),
                "ratio_streaming_over_copy": round(statistics.median(ratios), 3),
                "ratio_spread": _spread(ratios),
            }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
