"""The ``shardkit`` command line: ``shardkit ckpt ...`` and ``shardkit demo``."""

from ._main import CliError, VerifyFailed, build_parser, main

__all__ = ["CliError", "VerifyFailed", "build_parser", "main"]
