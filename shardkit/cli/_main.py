"""Entry point of the ``shardkit`` console script: parser, dispatch and error handling.

Every failure ends in one line on stderr, ``shardkit: error: ...``, never a traceback
(``--debug`` prints the traceback before it, for bug reports; the exit status stays).
Exit codes (docs/cli.md):

0 success; 1 ``verify`` found damage or ``diff`` found differences; 2 usage error (bad
arguments, a missing path, not a checkpoint) or storage error (an OSError, or a storage
backend's own error such as missing cloud credentials); 3 damaged checkpoint (a command
other than ``verify`` met one); 4 internal error (a bug: please report it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback

from .._version import __version__

__all__ = ["CliError", "VerifyFailed", "build_parser", "main", "printable"]

EXIT_VERIFY_FAILED = 1
EXIT_ERROR = 2  # usage error
EXIT_DAMAGED = 3
EXIT_INTERNAL = 4


class CliError(Exception):
    """A user-facing command-line failure; its message is printed as one line."""


class VerifyFailed(CliError):
    """``shardkit ckpt verify`` found a bad checksum (exit status 1, not 2)."""


def printable(text: object) -> str:
    """``text`` with each non-printable character (ESC, CR, newline, bidi overrides, ...)
    escaped as Python writes it (``\\x1b``), for printing names and values read from a
    checkpoint: nothing in one can move the cursor, rewrite a line or restyle the terminal.
    """
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _add_debug(parser: argparse.ArgumentParser, top: bool) -> None:
    # On subcommands the default is SUPPRESS so that `shardkit --debug ckpt ...` is not
    # overwritten with False by the subparser.
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show the full traceback on errors",
    )


def build_parser() -> argparse.ArgumentParser:
    """The complete ``shardkit`` argument parser (``ckpt`` and ``demo`` subcommands)."""
    from . import _ckpt, _demo

    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="Distributed training toolkit for PyTorch: SPMD, FSDP, DDP hooks, checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    _add_debug(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    ckpt = commands.add_parser(
        "ckpt",
        help="list, inspect, verify, diff, convert and materialize checkpoints",
        description="Work with checkpoints. Every PATH is a local path or an fsspec URL.",
    )
    _add_debug(ckpt, top=False)
    _ckpt.add_subcommands(ckpt, lambda p: _add_debug(p, top=False))
    demo = commands.add_parser(
        "demo",
        help="train, preempt, resume, consolidate and evaluate a model on N local ranks",
        description=_demo.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_debug(demo, top=False)
    _demo.add_arguments(demo)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    if isinstance(exc, KeyError) and exc.args:
        text = f"missing key {exc.args[0]!r}"
    return printable(" ".join(text.split()))


def _handled_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [CliError, OSError, ValueError, TypeError, KeyError]
    try:  # the checkpoint layer's own errors (CorruptCheckpointError, ...), when present
        from ..checkpoint import CheckpointError

        errors.append(CheckpointError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    try:
        parser = build_parser()  # imports torch: Ctrl-C often lands here
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    if args.command is None or (
        args.command == "ckpt" and getattr(args, "ckpt_command", None) is None
    ):  # a usage error, as argparse treats a missing argument: help on stderr, exit 2
        with contextlib.redirect_stdout(sys.stderr), contextlib.suppress(SystemExit):
            parser.parse_args([*([args.command] if args.command else []), "--help"])
        return EXIT_ERROR
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `shardkit ckpt inspect ... | head`: not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        _traceback_if(args.debug)
        print("shardkit: interrupted", file=sys.stderr)
        return 130
    except _handled_errors() as exc:
        _traceback_if(args.debug)
        print(f"shardkit: error: {_one_line(exc)}", file=sys.stderr)
        return _exit_code(exc)
    except Exception as exc:  # a bug: still one line, the traceback only with --debug
        _traceback_if(args.debug)
        if is_storage_error(exc):  # the environment (credentials, network), not a bug
            print(
                f"shardkit: error: cannot access {_storage_urls(args)}: {_one_line(exc)}",
                file=sys.stderr,
            )
            return EXIT_ERROR
        print(
            f"shardkit: internal error: {type(exc).__name__}: {_one_line(exc)} "
            "(rerun with --debug for the traceback and please report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


#: Top-level packages of fsspec and its storage backends (and the clients they use): an
#: exception of theirs that is no OSError (botocore's NoCredentialsError, ClientError,
#: EndpointConnectionError; google.auth's DefaultCredentialsError; azure's
#: ClientAuthenticationError; aiohttp's connection errors, ...) is a storage access error.
_STORAGE_PACKAGES = frozenset(
    {
        "fsspec",
        "s3fs",
        "botocore",
        "aiobotocore",
        "boto3",
        "gcsfs",
        "google",
        "adlfs",
        "azure",
        "ocifs",
        "oci",
        "sshfs",
        "asyncssh",
        "paramiko",
        "smbprotocol",
        "webdav4",
        "pyarrow",
        "aiohttp",
        "requests",
        "urllib3",
        "httpx",
    }
)


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or a class it derives from) comes from a storage backend, or is
    an ImportError raised inside one (fsspec's "Install s3fs to access S3")."""
    if any(cls.__module__.partition(".")[0] in _STORAGE_PACKAGES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, ImportError):
        tb = exc.__traceback__
        while tb is not None:
            module = str(tb.tb_frame.f_globals.get("__name__", ""))
            if module.partition(".")[0] in _STORAGE_PACKAGES:
                return True
            tb = tb.tb_next
    return False


def _storage_urls(args: argparse.Namespace) -> str:
    """The command's paths that are remote URLs (all of its paths when none is)."""
    paths = [
        str(p)
        for p in (getattr(args, name, None) for name in ("path", "src", "dst", "a", "b"))
        if p is not None
    ]
    remote = [p for p in paths if "://" in p and not p.startswith("file://")]
    return printable(" or ".join(remote or paths) or "the storage")


def _traceback_if(debug: bool) -> None:
    """``--debug``: the full traceback too; the exit status stays the documented one."""
    if debug:
        traceback.print_exc()


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, VerifyFailed):
        return EXIT_VERIFY_FAILED
    try:
        from ..checkpoint import CorruptCheckpointError

        if isinstance(exc, CorruptCheckpointError):
            return EXIT_DAMAGED
    except ImportError:
        pass
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
