"""Command line: ``python -m shardkit.fsdp.consolidate_sharded_ckpts --ckpt_prefix P --ckpt_suffix S``.

Merges per-rank FSDP checkpoints into one ``{'model': full_state_dict}`` file.
"""

from __future__ import annotations

import argparse
import sys

from ..checkpoint._core._errors import CheckpointError
from ._consolidate import consolidate_sharded_model_checkpoints

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, consolidate with a progress bar, print where the result went."""
    parser = argparse.ArgumentParser(
        prog="python -m shardkit.fsdp.consolidate_sharded_ckpts", description=__doc__
    )
    parser.add_argument("--ckpt_prefix", required=True, help="path prefix of the rank files")
    parser.add_argument(
        "--ckpt_suffix", default="*.pth", help="glob completing the prefix (default *.pth)"
    )
    parser.add_argument(
        "--save_path", default="", help="output file (default <prefix>_consolidated.pth)"
    )
    args = parser.parse_args(argv)
    try:
        full, path = consolidate_sharded_model_checkpoints(
            args.ckpt_prefix, args.ckpt_suffix, args.save_path, progress=True
        )
    except (OSError, ValueError, CheckpointError) as exc:  # a damaged or unreadable file too
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"consolidated {len(full)} entries into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
