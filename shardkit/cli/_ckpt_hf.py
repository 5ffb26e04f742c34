"""``shardkit ckpt convert SRC DIR --to hf``: a Hugging Face ``from_pretrained`` directory."""

from __future__ import annotations

import argparse
import tempfile

from ._main import CliError

__all__ = ["add_hf_arguments", "cmd_convert_hf"]

_DTYPES = ("float32", "bfloat16", "float16")


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    """The options only ``--to hf`` reads."""
    g = p.add_argument_group("--to hf (a Hugging Face from_pretrained directory)")
    g.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help="the model's config.json (its 'architectures' names the model class; needs "
        "transformers)",
    )
    g.add_argument(
        "--prefix",
        help="where the model sits in the checkpoint, e.g. 'model.' (default: found from keys)",
    )
    g.add_argument(
        "--max-shard-size", default="5GB", help="bytes per safetensors file (default: 5GB)"
    )
    g.add_argument("--dtype", choices=_DTYPES, help="cast floating tensors to this dtype")


def cmd_convert_hf(args: argparse.Namespace) -> int:
    """Export SRC (any readable checkpoint format) as an HF directory at DST."""
    import torch

    from ..checkpoint import CheckpointError, CorruptCheckpointError
    from ..checkpoint.hf import to_hf
    from ._ckpt_convert import _to_shardkit, detect_format

    if not args.config:
        raise CliError("--to hf needs --config CONFIG_JSON (from_pretrained needs config.json)")
    src_fmt = args.from_ or detect_format(args.src)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        if src_fmt == "shardkit":
            report = _export(to_hf, args.src, args, dtype)
        else:
            with tempfile.TemporaryDirectory(prefix="shardkit-convert-") as tmp:
                _to_shardkit(args.src, src_fmt, tmp)
                report = _export(to_hf, tmp, args, dtype)
    except CorruptCheckpointError:
        raise  # a damaged checkpoint: its own exit status (3), its own message
    except (CheckpointError, FileExistsError) as exc:
        raise CliError(str(exc)) from None
    print(
        f"wrote {args.dst} (hf: {len(report.files)} safetensors file(s), "
        f"{len(report.weight_map)} tensors, from {src_fmt} {args.src} prefix {report.prefix!r})"
    )
    if report.tied:
        print(f"tied (written once): {', '.join(f'{a} -> {s}' for a, s in report.tied.items())}")
    print(f"dropped {len(report.dropped)} key(s) not in the model")
    for key in report.dropped:
        print(f"  {key}")
    if report.missing_buffers:
        print(f"buffers from the config: {', '.join(report.missing_buffers)}")
    return 0


def _export(to_hf, src: str, args: argparse.Namespace, dtype):
    return to_hf(
        src,
        args.dst,
        config=args.config,
        prefix=args.prefix,
        max_shard_size=args.max_shard_size,
        dtype=dtype,
        overwrite=args.overwrite,
        progress=True,
    )
