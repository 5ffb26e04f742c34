"""``shardkit ckpt``: ls, inspect, verify, convert and diff checkpoints.

Every PATH is a local path or an fsspec URL. Reads go through ``shardkit.checkpoint``
(``read_metadata``, ``load``, ``FileSystemReader``, so every read is confined to the
checkpoint directory); ``verify`` re-hashes the stored bytes itself, block by block, exactly
as docs/checkpoint-format.md specifies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import fsspec

from ._main import CliError, VerifyFailed, printable

__all__ = ["add_subcommands"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
METADATA_FILE = "metadata.json"


def add_subcommands(parser: argparse.ArgumentParser, add_debug: Callable) -> None:
    """Add ls / inspect / verify / convert / materialize / diff to the ``ckpt`` parser."""
    from ._ckpt_convert import FORMATS_FROM, FORMATS_TO, cmd_convert, cmd_diff
    from ._ckpt_hf import add_hf_arguments

    sub = parser.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")

    def command(name: str, help_: str, func: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        add_debug(p)
        p.set_defaults(func=func)
        return p

    p = command("ls", "list the steps under a CheckpointManager directory", cmd_ls)
    p.add_argument("path", metavar="PATH")
    p = command(
        "inspect", "show the keys, dtypes, shapes, chunks and sizes of a checkpoint", cmd_inspect
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print the same information as JSON")
    p = command("verify", "check every checksum of a checkpoint (exit 1 on a mismatch)", cmd_verify)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = command(
        "convert",
        "convert between shardkit, torch.save, safetensors, torch DCP and Hugging Face",
        cmd_convert,
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--to", choices=FORMATS_TO, help="output format (default: from DST's suffix)")
    p.add_argument(
        "--from", dest="from_", choices=FORMATS_FROM, help="input format (default: detected)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    add_hf_arguments(p)
    p = command(
        "materialize",
        "copy an incremental checkpoint to a new directory that references no other step",
        cmd_materialize,
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p = command("diff", "compare two checkpoints key by key", cmd_diff)
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument(
        "--atol", type=_atol, default=0.0, help="ignore differences up to this (>= 0; 0)"
    )


# -- helpers ----------------------------------------------------------------------------
def _atol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0")
    return value


def fs_and_path(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system and its path for a local path or URL."""
    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    return fs, root.rstrip("/") or root


def require_exists(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """FileNotFoundError naming ``path`` unless something is there."""
    fs, root = fs_and_path(path)
    if not fs.exists(root):
        raise FileNotFoundError(f"{path} does not exist")
    return fs, root


def checkpoint_metadata(path: str):
    """The parsed metadata of the shardkit checkpoint at ``path``, with a clear error."""
    from ..checkpoint import read_metadata

    require_checkpoint_dir(path)
    return read_metadata(path)


def require_checkpoint_dir(path: str) -> None:
    """CliError unless ``path`` is a directory with a metadata.json (which is not read)."""
    fs, root = require_exists(path)
    if not fs.isdir(root):
        raise CliError(f"{path} is a file, not a shardkit checkpoint directory")
    if not fs.exists(f"{root}/{METADATA_FILE}"):
        manager = manager_dir_error(fs, root, path)
        if manager is not None:
            raise manager
        if fs.exists(f"{root}/.metadata"):
            raise CliError(
                f"{path} is a torch.distributed.checkpoint directory, not a shardkit one; "
                f"import it with: shardkit ckpt convert {path} DST --from torch-dcp --to shardkit"
            )
        raise CliError(f"{path} is not a shardkit checkpoint: it has no {METADATA_FILE}")


def manager_dir_error(fs, root: str, path: str) -> CliError | None:
    """The error for a CheckpointManager directory given where one checkpoint is wanted:
    it names the newest step that has a checkpoint (not an incomplete one); None when
    ``path`` holds no step directories."""
    steps = _step_dirs(fs, root)
    if not steps:
        return None
    committed = [s for s in steps if fs.exists(f"{root}/{steps[s]}/{METADATA_FILE}")]
    example = (
        f"e.g. {path.rstrip('/')}/{steps[max(committed)]}"
        if committed
        else "but none of them has a checkpoint (every step is incomplete)"
    )
    return CliError(
        f"{path} is a CheckpointManager directory ({len(steps)} steps); name one step, {example}"
    )


def _step_dirs(fs, root: str) -> dict[int, str]:
    steps = {}
    for entry in fs.ls(root, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        match = _STEP_DIR.match(name)
        if match and entry["type"] == "directory":
            steps[int(match.group(1))] = name
    return steps


def human_bytes(n: int) -> str:
    """``1.5 MiB`` style sizes (of any int: sizes come from a checkpoint's metadata)."""
    for exp, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if n < 1024 ** (exp + 1) or unit == "TiB":
            if unit == "B":
                return f"{n} B"
            tenths = (n * 10 + 1024**exp // 2) // 1024**exp  # ints only: no float overflow
            return f"{tenths // 10}.{tenths % 10} {unit}"
    raise AssertionError("unreachable")


def _json_key(key: Any) -> Any:
    """A dict key json.dumps writes as it is (a finite float too), else its ``repr``."""
    if key is None or isinstance(key, (str, int, bool)):
        return key
    if isinstance(key, float) and math.isfinite(key):
        return key
    return repr(key)


def _jsonable(value: Any) -> Any:
    """A saved value as strict JSON can write it: a tuple or other dict key, and a NaN or
    infinite float, are shown as their ``repr`` (the value format keeps them; strict JSON
    cannot)."""
    if isinstance(value, dict):
        return {_json_key(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # "nan", "inf": strict JSON has no such numbers
    return value


def _table(rows: list[list[str]], right: set[int]) -> str:
    """Aligned columns; every cell escaped with :func:`printable` (names from a checkpoint)."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    )


# -- ls -----------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    """Steps under a CheckpointManager directory, with creation times and sizes.

    Exits 3 after the listing when a committed step is damaged."""
    fs, root = require_exists(args.path)
    if fs.exists(f"{root}/{METADATA_FILE}"):
        raise CliError(
            f"{args.path} is a single checkpoint, not a CheckpointManager directory; "
            f"use: shardkit ckpt inspect {args.path}"
        )
    steps = _step_dirs(fs, root) if fs.isdir(root) else {}
    if not steps:
        raise CliError(
            f"{args.path} holds no step_* checkpoints (not a CheckpointManager directory?)"
        )
    rows = [["STEP", "CREATED", "SIZE", "FILES", "SHARED", "STATUS"]]
    damaged = []
    found, users = _step_statuses(args.path, steps)
    for step in sorted(steps):
        status, md, why = found[step]
        if md is not None:
            size, files = human_bytes(sum(md.files.values())), str(len(md.files))
            rows.append([str(step), md.created, size, files, _shared(md), status])
        else:
            rows.append([str(step), "-", "-", "-", "-", users.get(step, status)])
        if why and status != "incomplete (never committed)":
            damaged.append(f"step {step}: {why}")
    print(_table(rows, right={0, 2, 3, 4}))
    for line in damaged:
        print(f"WARNING {printable(line)}", file=sys.stderr)
    if damaged:  # docs/cli.md: a damaged checkpoint is status 3 (incomplete steps are not)
        from ._main import EXIT_DAMAGED

        return EXIT_DAMAGED
    return 0


def _step_statuses(path: str, steps: dict[int, str]) -> tuple[dict[int, tuple], dict[int, str]]:
    """:func:`step_status` of every step directory, and for each one without a checkpoint
    of its own whose data files committed steps still read (an incremental base whose
    metadata retention removed) a status naming those steps: deleting it breaks them."""
    found = {step: step_status(f"{path.rstrip('/')}/{name}") for step, name in steps.items()}
    by_dir = {name: step for step, name in steps.items()}
    users: dict[int, set[int]] = {}
    for step, (_status, md, _why) in found.items():
        for link in md.linked.values() if md is not None else ():
            holder = by_dir.get(link.dir)
            if holder is not None and found[holder][1] is None:
                users.setdefault(holder, set()).add(step)
    shared = {
        holder: "shared data of step(s) " + ", ".join(map(str, sorted(of)))
        for holder, of in users.items()
    }
    return found, shared


def _shared(md) -> str:
    """How much of a step's tensor data lives in other steps' files (incremental saves)."""
    total = sum(c.nbytes for t in md.tensors.values() for c in t.chunks)
    shared = md.shared_bytes()
    return f"{100 * shared / total:.0f}%" if total and shared else "-"


def cmd_materialize(args: argparse.Namespace) -> int:
    """Copy a checkpoint, inlining the chunks it references in other step directories."""
    from ..checkpoint.format_utils import materialize
    from ._ckpt_output import staged_output

    require_checkpoint_dir(args.src)
    with staged_output(args.dst, directory=True) as out:  # no partial copy left on failure
        md = materialize(args.src, out)
    print(f"wrote {args.dst}: {human_bytes(sum(md.files.values()))} in {len(md.files)} files")
    return 0


def step_status(url: str):
    """``(status, metadata or None, why)`` of one checkpoint directory, without reading
    tensor bytes: ``committed``, ``DAMAGED`` (committed, but its metadata or a file is
    broken: truncated, missing, replaced, a bad header) or ``incomplete (never committed)``
    (no metadata.json)."""
    from ..checkpoint import CorruptCheckpointError, FileSystemReader
    from ..checkpoint._core._format import Metadata
    from ..checkpoint._core._validate import check_files

    reader = FileSystemReader(url)
    try:
        raw = reader.read_metadata()
    except (FileNotFoundError, NotADirectoryError):
        return "incomplete (never committed)", None, "no metadata.json"
    except CorruptCheckpointError as exc:
        return "DAMAGED", None, str(exc)
    try:
        md = Metadata.from_json(raw, f"{url}/{METADATA_FILE}")
    except CorruptCheckpointError as exc:
        return "DAMAGED", None, str(exc)
    try:
        check_files(reader, md, md.file_names(), {})
    except CorruptCheckpointError as exc:
        return "DAMAGED", md, str(exc)
    return "committed", md, ""


# -- inspect ------------------------------------------------------------------------------
def describe(path: str) -> dict:
    """What ``inspect --json`` prints: the checkpoint's header and one entry per key."""
    fs, root = require_exists(path)
    if not fs.isdir(root):
        return _describe_file(path)
    md = checkpoint_metadata(path)
    tensors = {}
    for key in sorted(md.tensors):
        t = md.tensors[key]
        tensors[key] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "chunks": len(t.chunks),
            "bytes": math.prod(t.shape) * t.dtype.itemsize,
        }
    return {
        "path": path,
        "format_version": md.version,
        "created": md.created,
        "world_size": md.world_size,
        "save_id": md.save_id,
        "total_bytes": sum(md.files.values()),
        "shared_bytes": md.shared_bytes(),
        "linked_dirs": sorted({link.dir for link in md.linked.values()}),
        "tensors": tensors,
        "values": {k: _jsonable(md.values[k]) for k in sorted(md.values)},
        "pickled_objects": sorted(md.objects),
    }


def _describe_file(path: str) -> dict:
    """``describe`` of a single safetensors or torch.save file, read by ``diff``'s checked
    readers (a header is validated before anything is allocated; nothing is unpickled
    beyond what torch's ``weights_only`` loader allows)."""
    from ._ckpt_convert import Source

    with Source(path) as src:
        return _describe_source(path, src)


def _describe_source(path: str, src) -> dict:
    tensors = {
        key: {
            "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape),
            "chunks": 1,
            "bytes": math.prod(shape) * dtype.itemsize,
        }
        for key, (dtype, shape) in sorted(src.tensors.items())
    }
    return {
        "path": path,
        "format": src.format,
        "total_bytes": sum(t["bytes"] for t in tensors.values()),
        "tensors": tensors,
        "values": {k: _jsonable(src.values[k]) for k in sorted(src.values)},
        "pickled_objects": [],
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    """A table of keys with dtype, global shape, chunk count and bytes."""
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=2, default=str, allow_nan=False))
        return 0 if "format" in info else _warn_if_damaged(args.path)
    print(f"checkpoint     {printable(info['path'])}")
    if "format" in info:  # a single file
        print(f"format         {info['format']} file")
        print(f"tensor bytes   {human_bytes(info['total_bytes'])}")
    else:
        print(f"format version {info['format_version']}")
        print(f"created        {printable(info['created'])}")
        print(f"world size     {info['world_size']} (at save)")
        print(f"stored bytes   {human_bytes(info['total_bytes'])} in data files")
    if info.get("linked_dirs"):
        print(
            f"shared bytes   {human_bytes(info['shared_bytes'])} read from files of "
            f"{', '.join(info['linked_dirs'])} (incremental; shardkit ckpt materialize "
            "makes a self-contained copy)"
        )
    rows = [["KEY", "DTYPE", "SHAPE", "CHUNKS", "BYTES"]]
    for key, t in info["tensors"].items():
        rows.append(
            [
                key,
                t["dtype"],
                "x".join(map(str, t["shape"])) or "()",
                str(t["chunks"]),
                human_bytes(t["bytes"]),
            ]
        )
    print()
    print(_table(rows, right={3, 4}))
    if info["values"]:
        print()
        for key, value in info["values"].items():
            print(f"{printable(key)} = {printable(json.dumps(value, default=str))}")
    for key in info["pickled_objects"]:
        print(f"{printable(key)} = <pickled object: not loaded>")
    return 0 if "format" in info else _warn_if_damaged(args.path)


def _warn_if_damaged(path: str) -> int:
    """Exit status 3 with a warning when a file of the checkpoint is missing, truncated or
    has a damaged header (checksums of the data are ``verify``'s job)."""
    from ._main import EXIT_DAMAGED

    status, _, why = step_status(path)
    if status == "DAMAGED":
        print(f"shardkit: WARNING: this checkpoint is damaged: {printable(why)}", file=sys.stderr)
        return EXIT_DAMAGED
    return 0


# -- verify -------------------------------------------------------------------------------
def _blocks(chunk, itemsize: int):
    """(start, length) of each checksum block of a chunk, relative to its data."""
    row = math.prod(chunk.box.sizes[1:]) * itemsize if chunk.box.sizes else itemsize
    step = max(1, chunk.block_rows) * row
    return [(s, min(step, chunk.nbytes - s)) for s in range(0, chunk.nbytes, max(1, step))]


def cmd_verify(args: argparse.Namespace) -> int:
    """Re-hash every block of every chunk (and pickled object); exit 1 naming the failures.

    A CheckpointManager directory verifies each of its committed steps in turn.
    """
    fs, root = require_exists(args.path)
    steps = {} if fs.exists(f"{root}/{METADATA_FILE}") else _step_dirs(fs, root)
    if not steps:
        return _verify_one(args.path, args.no_progress)
    bad, verified = [], 0
    _, users = _step_statuses(args.path, steps)
    for step in sorted(steps):
        url = f"{args.path.rstrip('/')}/{steps[step]}"
        if step in users:
            print(f"skipped {url}: no checkpoint of its own; {users[step]} (verified with them)")
            continue
        if not fs.exists(f"{root}/{steps[step]}/{METADATA_FILE}"):
            print(f"skipped {url}: incomplete (never committed, never loaded)")
            continue
        try:
            _verify_one(url, args.no_progress)
            verified += 1
        except VerifyFailed as exc:
            bad.append(str(exc))
    if bad:
        more = f" (and {len(bad) - 1} more steps)" if len(bad) > 1 else ""
        raise VerifyFailed(f"{bad[0]}{more}")
    if not verified:
        raise CliError(f"{args.path}: no committed step to verify (every step is incomplete)")
    return 0


def _verify_one(path: str, no_progress: bool) -> int:
    import xxhash
    from tqdm import tqdm

    from ..checkpoint import CorruptCheckpointError, FileSystemReader
    from ..checkpoint._core._format import Metadata
    from ..checkpoint._core._validate import check_files

    require_checkpoint_dir(path)  # a clear error when it is no checkpoint at all
    reader = FileSystemReader(path)
    try:  # the metadata's own checksum, bounds and structure
        md = Metadata.from_json(reader.read_metadata(), f"{path}/{METADATA_FILE}")
    except CorruptCheckpointError as exc:
        print(f"FAILED {exc}", file=sys.stderr)
        raise VerifyFailed(str(exc)) from None
    failures: list[str] = []
    bad_files = set()
    for name in sorted(md.file_names()):
        try:  # exists, regular file, recorded size, safetensors header
            check_files(reader, md, {name}, {})
        except CorruptCheckpointError as exc:
            failures.append(str(exc))
            bad_files.add(name)
    total = sum(c.nbytes for t in md.tensors.values() for c in t.chunks)
    total += sum(o.nbytes for o in md.objects.values())
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="verify",
        file=sys.stderr,
        disable=no_progress,
        mininterval=0.2,
    )
    buf = memoryview(bytearray(_VERIFY_PIECE))

    def digest_of(name: str, offset: int, length: int) -> str:
        digest = xxhash.xxh3_64()
        for start in range(0, length, _VERIFY_PIECE):
            view = buf[: min(_VERIFY_PIECE, length - start)]
            reader.read_into(name, offset + start, view)
            digest.update(view)
            bar.update(len(view))
        return digest.hexdigest()

    try:
        for key in sorted(md.tensors):
            t = md.tensors[key]
            for chunk in t.chunks:
                label = (
                    f"file {chunk.file}, key {key!r}, chunk offsets={list(chunk.box.offsets)} "
                    f"sizes={list(chunk.box.sizes)}"
                )
                if chunk.file in bad_files:
                    failures.append(f"{label}: unreadable (file missing, wrong size or header)")
                    bar.update(chunk.nbytes)
                    continue
                for i, ((start, length), expected) in enumerate(
                    zip(_blocks(chunk, t.dtype.itemsize), chunk.checksums)
                ):
                    if digest_of(chunk.file, chunk.offset + start, length) != expected:
                        failures.append(f"{label}, block {i}: checksum mismatch")
        for key in sorted(md.objects):
            o = md.objects[key]
            if o.file in bad_files:
                failures.append(
                    f"file {o.file}, key {key!r}: unreadable (file missing or wrong size)"
                )
                continue
            if digest_of(o.file, o.offset, o.nbytes) != o.checksum:
                failures.append(f"file {o.file}, key {key!r} (pickled object): checksum mismatch")
    finally:
        bar.close()
    if failures:
        for line in failures:
            print(f"FAILED {line}", file=sys.stderr)
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        first = failures[0]  # a file check's message names the checkpoint already
        named = first.startswith((f"{path}:", f"{getattr(reader, 'url', path)}:"))
        raise VerifyFailed(f"{first if named else f'{path}: {first}'}{more}")
    chunks = sum(len(t.chunks) for t in md.tensors.values())
    print(f"OK {path}: {len(md.tensors)} tensors, {chunks} chunks, {human_bytes(total)} verified")
    return 0


#: Bytes read and hashed at a time: verify's memory stays at this, whatever the blocks.
_VERIFY_PIECE = 4 << 20
