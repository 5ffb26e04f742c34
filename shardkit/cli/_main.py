"""Entry point of the ``shardkit`` console script."""

from __future__ import annotations

import argparse
import sys

from .._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="Distributed training toolkit for PyTorch: SPMD, FSDP, DDP hooks, checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
