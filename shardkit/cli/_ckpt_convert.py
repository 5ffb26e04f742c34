"""``shardkit ckpt convert`` and ``shardkit ckpt diff``: formats, detection, per-key reads.

Conversions call ``shardkit.checkpoint.format_utils``; a pair it has no direct function
for goes through a temporary shardkit checkpoint, so memory stays bounded by what each
step allows (safetensors out: one tensor; torch.save out: the whole output).
"""

from __future__ import annotations

import argparse
import os
import stat
import struct
import tempfile
from collections.abc import Iterator

from ._ckpt_output import staged_output
from ._main import CliError, printable

__all__ = ["FORMATS_FROM", "FORMATS_TO", "cmd_convert", "cmd_diff", "detect_format"]

FORMATS_TO = ("safetensors", "torch", "shardkit", "hf")
FORMATS_FROM = ("torch-dcp", "torch", "safetensors", "shardkit")
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def _fs(path: str):
    from ._ckpt import fs_and_path

    return fs_and_path(path)


def detect_format(path: str, *, hint: str = "") -> str:
    """The format of an existing ``path``: shardkit, torch-dcp, safetensors or torch.

    Looks at names and at most 9 bytes; never unpickles anything and never opens a FIFO
    or device. ``hint`` ends the error message (``convert`` suggests ``--from``).
    """
    from ._ckpt import METADATA_FILE, manager_dir_error, require_exists

    fs, root = require_exists(path)
    if fs.isdir(root):
        if fs.exists(f"{root}/{METADATA_FILE}"):
            return "shardkit"
        if fs.exists(f"{root}/.metadata"):
            return "torch-dcp"
        manager = manager_dir_error(fs, root, path)
        if manager is not None:
            raise manager
        raise CliError(
            f"{path} is a directory but neither a shardkit checkpoint ({METADATA_FILE}) nor a "
            f"torch.distributed.checkpoint (.metadata){hint}"
        )
    head = _head(fs, root, path)
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 100 << 20:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save zip / legacy pickle
        return "torch"
    raise CliError(f"cannot tell the format of {path}{hint}")


def _head(fs, root: str, path: str) -> bytes:
    """The first 9 bytes of a file; a local FIFO, device or socket is refused unopened."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        fd = os.open(root, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CliError(f"{path} is not a regular file (a FIFO, device or socket)")
            os.set_blocking(fd, True)
            return os.read(fd, 9)
        finally:
            os.close(fd)
    with fs.open(root, "rb") as f:
        return f.read(9)


def _target_format(dst: str) -> str:
    name = dst.rstrip("/").lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(_TORCH_SUFFIXES):
        return "torch"
    return "shardkit"


def _to_shardkit(src: str, fmt: str, dst: str) -> None:
    from ..checkpoint import format_utils as fu

    if fmt == "torch":
        fu.torch_save_to_dcp(src, dst, progress=True)
    elif fmt == "safetensors":
        fu.from_safetensors(src, dst, progress=True)
    elif fmt == "torch-dcp":
        fu.import_torch_dcp(src, dst, progress=True)
    else:
        raise AssertionError(fmt)


def _from_shardkit(src: str, fmt: str, dst: str) -> None:
    from ..checkpoint import format_utils as fu

    if fmt == "safetensors":
        fu.to_safetensors(src, dst, progress=True)
    elif fmt == "torch":
        fu.dcp_to_torch_save(src, dst, progress=True)
    else:
        raise AssertionError(fmt)


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert SRC to DST; formats from --from/--to or detected from SRC and DST's suffix."""
    if args.to == "hf":
        from ._ckpt_hf import cmd_convert_hf

        return cmd_convert_hf(args)
    src_fmt = args.from_ or detect_format(args.src, hint=f"; pass --from {'|'.join(FORMATS_FROM)}")
    dst_fmt = args.to or _target_format(args.dst)
    if src_fmt == dst_fmt:
        raise CliError(f"{args.src} is already in {src_fmt} format; pick another --to")
    if src_fmt != "torch-dcp":
        from ._ckpt import require_exists

        require_exists(args.src)
    fs, root = _fs(args.dst)
    if fs.exists(root) and not args.overwrite:
        raise CliError(f"{args.dst} already exists; pass --overwrite to replace it")
    # written under a temporary name and renamed into place: a failure (a full disk, a
    # damaged source) leaves no half-written output and an overwritten DST intact
    with staged_output(args.dst, directory=dst_fmt == "shardkit") as out:
        if src_fmt == "shardkit":
            _from_shardkit(args.src, dst_fmt, out)
        elif dst_fmt == "shardkit":
            _to_shardkit(args.src, src_fmt, out)
        else:  # e.g. torch -> safetensors: through a temporary shardkit checkpoint on disk
            with tempfile.TemporaryDirectory(prefix="shardkit-convert-") as tmp:
                _to_shardkit(args.src, src_fmt, tmp)
                _from_shardkit(tmp, dst_fmt, out)
    print(f"wrote {args.dst} ({dst_fmt}, from {src_fmt} {args.src})")
    return 0


# -- diff ---------------------------------------------------------------------------------
class Source:
    """Per-key access to a checkpoint in any readable format, one tensor at a time."""

    def __init__(self, path: str) -> None:
        import torch

        self.path = path
        self.format = detect_format(path)
        self.values: dict[str, object] = {}
        self.tensors: dict[str, tuple] = {}  # key -> (dtype, shape)
        if self.format == "shardkit":
            from ..checkpoint._convert._io import checkpoint_metadata
            from ._ckpt import require_checkpoint_dir

            require_checkpoint_dir(path)  # a CheckpointManager directory is named as such
            # parsed and validated once, every file's size and header checked before any
            # tensor is allocated from the declared shapes; every per-key read reuses it
            md, self._reader = checkpoint_metadata(path)
            self._md = md
            self.tensors = {k: (t.dtype, tuple(t.shape)) for k, t in md.tensors.items()}
            self.values = dict(md.values)
            self.values.update({k: "<pickled object>" for k in md.objects})
        elif self.format == "safetensors":
            from ..checkpoint._convert._io import read_safetensors, safetensors_values

            # the checked reader of `convert` (memory-mapped: tensors cost page cache only);
            # a hostile header is a CorruptCheckpointError naming the file
            self._st, meta = read_safetensors(self._local())
            # non-tensor values written by `convert --to safetensors`
            self.values = safetensors_values(meta, self._st, path)
            for key, tensor in self._st.items():
                self.tensors[key] = (tensor.dtype, tuple(tensor.shape))
        elif self.format == "torch":
            from ..checkpoint._convert._torch_file import TorchFile

            try:  # tensors stay on the meta device until tensor() reads one
                self._file = TorchFile(self._local())
            except ValueError as exc:  # a legacy or big-endian file
                raise CliError(str(exc)) from None
            state = self._file.obj
            if not isinstance(state, dict):
                self.close()
                raise CliError(f"{path} holds a {type(state).__name__}, not a state dict")
            self._flat = dict(_flatten(state))
            for key, value in self._flat.items():
                if isinstance(value, torch.Tensor):
                    self.tensors[key] = (value.dtype, tuple(value.shape))
                else:
                    self.values[key] = value
        else:
            raise CliError(
                f"{path} is a torch.distributed.checkpoint; convert it first: "
                f"shardkit ckpt convert {path} DST --to shardkit"
            )

    def close(self) -> None:
        """Close the open torch file, if any (the other formats hold no descriptor)."""
        file, self._file = getattr(self, "_file", None), None
        if file is not None:
            file.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _local(self) -> str:
        if "://" in self.path and not self.path.startswith("file://"):
            raise CliError(f"{self.format} files are read from local paths only, got {self.path}")
        return self.path.removeprefix("file://")

    def keys(self) -> set[str]:
        """Every key: tensors and values."""
        return set(self.tensors) | set(self.values)

    def tensor(self, key: str):
        """The full tensor stored under ``key``."""
        if self.format == "shardkit":
            from ..checkpoint._convert._io import read_full

            # the metadata parsed in __init__, not once per key (load() would reparse it)
            (out,) = read_full(self._reader, self._md, [key], reuse=False)
            return out[key]
        if self.format == "safetensors":
            return self._st[key]
        return self._file.read(self._flat[key])


def _flatten(value, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(value, dict) and value and all(isinstance(k, (str, int)) for k in value):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], value


def _max_abs_diff(a, b) -> float:
    """The largest |a - b|. Integers are compared exactly (int64 past 2**53 does not
    survive float64); equal infinities, and NaN against NaN, in the same places are
    equal; NaN against a number is NaN (a difference)."""
    import torch

    if a.numel() == 0:
        return 0.0
    a, b = a.reshape(-1), b.reshape(-1)  # elementwise only; some kernels stop at 64 dims
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return float((a != b).sum().item())
    if not a.is_floating_point():
        if torch.equal(a, b):
            return 0.0
        # integers that differ differ by at least 1, whatever float64 rounds them to
        return max(1.0, (a.to(torch.float64) - b.to(torch.float64)).abs().max().item())
    x, y = a.to(torch.float64), b.to(torch.float64)
    same = (x == y) | (x.isnan() & y.isnan())
    if bool(same.all()):
        return 0.0
    return torch.where(same, 0.0, (x - y).abs()).max().item()


def _same_value(a, b) -> bool:
    """Plain values: equal, or spelled alike (a NaN metric saved twice is the same)."""
    return a == b or repr(a) == repr(b)


def cmd_diff(args: argparse.Namespace) -> int:
    """Keys only in A, only in B, and differing keys with the largest |a - b|.

    Exits 0 when the checkpoints match and 1 when they differ, like diff(1).
    """
    with Source(args.a) as a, Source(args.b) as b:
        return _diff(args, a, b)


def _diff(args: argparse.Namespace, a: Source, b: Source) -> int:
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    differ: list[tuple[str, str]] = []
    same = 0
    for key in sorted(a.keys() & b.keys()):
        if key in a.values or key in b.values:
            va, vb = a.values.get(key, "<tensor>"), b.values.get(key, "<tensor>")
            if not _same_value(va, vb):
                differ.append((key, f"value {va!r} vs {vb!r}"))
            else:
                same += 1
            continue
        ta, tb = a.tensor(key), b.tensor(key)
        if ta.shape != tb.shape:
            differ.append((key, f"shape {tuple(ta.shape)} vs {tuple(tb.shape)}"))
        elif ta.dtype != tb.dtype:
            differ.append((key, f"dtype {ta.dtype} vs {tb.dtype}"))
        else:
            delta = _max_abs_diff(ta, tb)
            if delta > args.atol or delta != delta:  # NaN counts as a difference
                differ.append((key, f"max |a-b| = {delta:.6g}"))
            else:
                same += 1
        del ta, tb
    for title, keys in ((f"only in A ({args.a})", only_a), (f"only in B ({args.b})", only_b)):
        print(printable(f"{title}: {len(keys)}"))
        for key in keys:
            print(f"  {printable(key)}")
    print(f"differ: {len(differ)}")
    shown = [(printable(k), printable(why)) for k, why in differ]
    width = max((len(k) for k, _ in shown), default=0)
    for key, why in shown:
        print(f"  {key.ljust(width)}  {why}")
    print(f"identical: {same}")
    return 1 if (only_a or only_b or differ) else 0
