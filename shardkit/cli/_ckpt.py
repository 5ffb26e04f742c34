"""``shardkit ckpt``: ls, inspect, verify, convert and diff (placeholder parser)."""

from __future__ import annotations

import argparse

__all__ = ["add_subcommands"]


def add_subcommands(parser: argparse.ArgumentParser, add_debug) -> None:
    """Add the ckpt subcommands to ``parser``."""
    parser.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")
