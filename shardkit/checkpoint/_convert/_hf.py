"""Export a shardkit checkpoint as a Hugging Face ``from_pretrained`` directory.

Writes sharded ``model-0000k-of-0000n.safetensors`` files and
``model.safetensors.index.json`` tensor by tensor (one reused buffer, never the whole
model), with the HF key names of a template model: the one passed in, or one built from
the config on the meta device (no memory, no download).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from ...runtime._collective import collective_device
from .._core._errors import CheckpointError
from .._core._format import Metadata
from .._core._planner import unwrapped, wrapped_pairs
from .._core._storage import parse_json, read_small_file
from ._io import SafetensorsStreamWriter, check_progress, checkpoint_metadata, read_full

__all__ = ["HFExport", "HFTemplate", "to_hf", "hf_template", "parse_size"]

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
#: far more than any model config; a bound for a file given by a user or found in a directory
_MAX_CONFIG_BYTES = 16 << 20
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class HFTemplate:
    """What a Hugging Face model expects: every state-dict key (in order) with its shape,
    which keys are parameters, and tied aliases (``alias -> the key that is written``)."""

    shapes: dict[str, tuple[int, ...]]
    params: frozenset[str]
    tied: dict[str, str]
    config: Any = None


@dataclass
class HFExport:
    """What :func:`to_hf` wrote and left out.

    Attributes:
        files: the safetensors files, in order (names relative to the output directory).
        weight_map: HF key -> file, as in ``model.safetensors.index.json``.
        prefix: the checkpoint prefix the model was read from (``""``: the top level).
        dropped: checkpoint keys not written (optimizer state, other subtrees, keys the
            model does not have), sorted.
        tied: alias -> written key, for tied weights written once (HF re-ties them).
        missing_buffers: buffers the model has but the checkpoint lacks (HF initializes
            them from the config; parameters missing would be an error instead).
    """

    files: list[str] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)
    prefix: str = ""
    dropped: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    missing_buffers: list[str] = field(default_factory=list)


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string such as ``"5GB"``, ``"500MiB"``, ``"1024"``."""
    if isinstance(value, bool):
        raise TypeError(f"max_shard_size must be an int or a size string, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(
                f"max_shard_size {value!r} is not a size; write e.g. 5GB, 500MiB or 1048576"
            )
        unit = (match.group(2) or "").upper()
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"max_shard_size must be an int or a size string, got {value!r}")
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return size


def _config_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        name = os.fspath(config)
        fs, path = fsspec.core.url_to_fs(name)
        try:
            if isinstance(fs, LocalFileSystem):  # never blocks on a FIFO, never reads /dev/zero
                raw = read_small_file(path, _MAX_CONFIG_BYTES)
            else:
                with fs.open(path, "rb") as f:
                    raw = f.read(_MAX_CONFIG_BYTES + 1)
        except FileNotFoundError as exc:  # the class stays; the message says what it is for
            raise FileNotFoundError(
                exc.errno,
                f"config file {name!r} does not exist; pass the model's config.json, a dict "
                "or a transformers PretrainedConfig",
            ) from None
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ValueError(f"config file {name!r} is over {_MAX_CONFIG_BYTES} bytes")
        try:  # too deep, invalid UTF-8 or not JSON: a ValueError (parse_json)
            data = parse_json(raw)
        except ValueError as exc:
            raise ValueError(f"config file {name!r} is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {os.fspath(config)!r} holds no JSON object")
        return data
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(
        f"config must be a transformers PretrainedConfig, a dict or a path to config.json, "
        f"got {type(config).__name__}"
    )


def _template_module(config: Any):
    """The model class named by the config's ``architectures``, built on the meta device."""
    try:
        import transformers
    except ImportError:
        raise TypeError(
            "building the HF model from its config needs transformers; install it, or pass "
            "model= (the model, e.g. built on the meta device)"
        ) from None
    data = _config_dict(config)
    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.for_model(**data)
    archs = data.get("architectures") or []
    if len(archs) != 1 or not isinstance(archs[0], str):
        raise ValueError(
            f"the config names architectures {archs!r}; it must name exactly one model class "
            "(set config.architectures = ['LlamaForCausalLM']), or pass model="
        )
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        raise ValueError(f"transformers has no model class {archs[0]!r} (config.architectures)")
    with torch.device("meta"):
        return cls(config), config


def hf_template(*, model: Any = None, config: Any = None) -> HFTemplate:
    """The keys, shapes and tied aliases of ``model`` (or of the model ``config`` names).

    ``model`` must be the plain HF model (any device, ``meta`` included), not a wrapper.
    """
    if model is None:
        if config is None:
            raise ValueError("pass config= (or model=): the export needs the model's key names")
        model, config = _template_module(config)
    elif config is None:
        config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if getattr(type(model), "_shardkit_wrapper", False):
        raise ValueError(
            "model= must be the plain HF model (e.g. built on the meta device), not a shardkit "
            "wrapper; pass wrapper.module"
        )
    state = model.state_dict(keep_vars=True)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    params = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        params.add(name)
        source = first.setdefault(id(p), name)
        if source != name:
            tied[name] = source
    return HFTemplate(shapes, frozenset(params), tied, config)


def _wrapper_note(names: Sequence[str], keys: Sequence[str], prefix: str | None) -> str:
    """A sentence if checkpoint ``keys`` hold model parameter ``names`` (under ``prefix``;
    None: the first name under any prefix) with a wrapper's names in them (a DDP / FSDP
    model's own ``state_dict()``), else ''."""
    if prefix is None:
        tail = "." + unwrapped(names[0]) if names else None
        held = next((k for k in keys if tail and ("." + unwrapped(k)).endswith(tail)), None)
    else:
        under = [k for k in keys if k.startswith(prefix)]
        pairs = wrapped_pairs([prefix + n for n in names], under)
        held = pairs[0][1] if pairs else None
    if held is None:
        return ""
    return (
        f" The checkpoint holds {held!r} under a wrapper's names (DDP and FSDP add 'module.'): "
        "it was saved from a wrapped model's state_dict(). Save "
        "shardkit.checkpoint.state_dict.get_model_state_dict(model) instead, whose keys carry "
        "no wrapper names."
    )


def _pick_prefix(prefix: str | None, template: HFTemplate, keys: Sequence[str]) -> str:
    """The checkpoint prefix the model's keys live under (``None``: find it)."""
    needed = [k for k in template.params if k not in template.tied]
    have = set(keys)
    if prefix is not None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {prefix!r}")
        if prefix and not prefix.endswith("."):
            prefix += "."
        if not any(prefix + k in have for k in needed):
            sample = sorted(have)[:5]
            raise ValueError(
                f"no parameter of the model is under prefix {prefix!r} in the checkpoint "
                f"(its keys start like {sample}); pick another prefix."
                + _wrapper_note(needed, keys, prefix)
            )
        return prefix
    probe = min(needed, key=len) if needed else None
    if probe is None:
        return ""
    candidates = {k[: len(k) - len(probe)] for k in keys if k.endswith(probe)}
    candidates = {c for c in candidates if c == "" or c.endswith(".")}
    scored = sorted(
        ((sum(c + k in have for k in needed), c) for c in candidates), key=lambda t: -t[0]
    )
    if not scored:
        raise ValueError(
            f"the checkpoint holds none of the model's parameters (looked for {probe!r} under "
            "any prefix); is it the checkpoint of this model? pass prefix= (the command "
            "line's --prefix) to name its subtree." + _wrapper_note([probe], keys, None)
        )
    best = [c for n, c in scored if n == scored[0][0]]
    if len(best) > 1:
        raise ValueError(
            f"the model's keys appear under several prefixes {sorted(best)} of the checkpoint; "
            "pass prefix= to pick one"
        )
    return best[0]


def _plan(
    metadata: Metadata, template: HFTemplate, prefix: str, dtype: torch.dtype | None
) -> tuple[list[tuple[str, str, torch.dtype, tuple]], HFExport]:
    """(HF key, checkpoint key, output dtype, shape) to write, and the report so far."""
    report = HFExport(prefix=prefix)
    tensors = metadata.tensors
    used: set[str] = set()
    rows, missing, mismatched = [], [], []
    for name, shape in template.shapes.items():
        if name in template.tied:
            report.tied[name] = template.tied[name]
            continue
        group = [name] + [a for a, s in template.tied.items() if s == name]
        source = next((prefix + k for k in group if prefix + k in tensors), None)
        if source is None:
            if name in template.params:
                missing.append(name)
            else:
                report.missing_buffers.append(name)
            continue
        used.update(prefix + k for k in group if prefix + k in tensors)
        meta = tensors[source]
        if tuple(meta.shape) != tuple(shape):
            mismatched.append(f"{source}: {tuple(meta.shape)} vs the model's {tuple(shape)}")
            continue
        out_dtype = meta.dtype
        if dtype is not None and meta.dtype.is_floating_point:
            out_dtype = dtype
        rows.append((name, source, out_dtype, tuple(meta.shape)))
    if missing:
        hint = _wrapper_note(missing, list(tensors), prefix)
        raise CheckpointError(
            f"the checkpoint (prefix {prefix!r}) lacks {len(missing)} parameter(s) of the model: "
            f"{missing[:20]}; from_pretrained would initialise them randomly.{hint} Export the "
            "right checkpoint, or name its model subtree with prefix= (the command line's "
            "--prefix)"
        )
    if mismatched:
        raise CheckpointError(f"shapes differ from the model's: {mismatched[:20]}")
    report.dropped = sorted(set(metadata.keys()) - used)
    return rows, report


def _split(rows, max_bytes: int) -> list[list]:
    files: list[list] = [[]]
    size = 0
    for row in rows:
        nbytes = math.prod(row[3]) * row[2].itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(row)
        size += nbytes
    return files


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _config_json(config: Any, dtype: torch.dtype | None) -> str:
    to_json = getattr(config, "to_json_string", None)
    if callable(to_json) and dtype is None:
        return to_json()
    data = _config_dict(config)
    if dtype is not None:
        data["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def to_hf(
    checkpoint_id: str | os.PathLike,
    path: str | os.PathLike,
    *,
    config: Any = None,
    model: Any = None,
    prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> HFExport:
    """Write a shardkit checkpoint (any layout, any world size) as a Hugging Face directory.

    ``transformers`` loads the result with ``from_pretrained(path)``: ``config.json``,
    ``model-0000k-of-0000n.safetensors`` files and ``model.safetensors.index.json``, keyed
    by the model's own names. Tied weights are written once, as ``save_pretrained`` does
    (HF re-ties them on load; no storage is shared in the files). Tensors stream through
    one reused buffer. In a process group it is collective: every rank must call it (each
    writes every ``world``-th file and rank 0 the index, so no rank holds the whole
    model); called on one rank alone it waits for the others until the group's timeout.

    Args:
        checkpoint_id: the shardkit checkpoint (path or fsspec URL).
        path: the output directory (path or fsspec URL).
        config: the model's config (``PretrainedConfig``, a dict or a path to
            ``config.json``); its ``architectures`` names the model class, built on the
            meta device to learn the keys. Default: ``model.config``.
        model: the plain HF model to take key names and tied weights from (any device,
            ``meta`` included), instead of building one from ``config``.
        prefix: where the model sits in the checkpoint, e.g. ``"model."`` for a
            ``{"model": ..., "optim": ...}`` training checkpoint. Default: found from the
            keys (an ambiguous match is an error).
        max_shard_size: bytes per file (an int, or ``"5GB"`` / ``"500MiB"``).
        dtype: cast floating tensors to this dtype (e.g. ``torch.bfloat16``).
        overwrite: allow writing into a directory that already holds an HF model.
        progress: accepted for symmetry with the other conversions.

    Returns:
        :class:`HFExport`: files written, keys dropped (optimizer state, other subtrees),
        tied aliases. A model parameter missing from the checkpoint raises
        :class:`~shardkit.checkpoint.CheckpointError` (``from_pretrained`` would initialise
        it randomly); so does a shape that differs from the model's.
    """
    check_progress(progress)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    max_bytes = parse_size(max_shard_size)
    metadata, reader = checkpoint_metadata(checkpoint_id)
    template = hf_template(model=model, config=config)
    if template.config is None:
        raise ValueError("pass config=: from_pretrained needs config.json")
    chosen = _pick_prefix(prefix, template, list(metadata.tensors))
    rows, report = _plan(metadata, template, chosen, dtype)
    fs, root = fsspec.core.url_to_fs(os.fspath(path))
    rank, world = _world()
    taken: list[str] = []
    if rank == 0:
        names = (INDEX_FILE, CONFIG_FILE, "model.safetensors")
        taken = [n for n in names if fs.exists(f"{root}/{n}")]
        if not taken or overwrite:
            fs.makedirs(root, exist_ok=True)
    if world > 1:  # every rank raises alike, so none waits at a barrier for rank 0
        flag = torch.tensor([len(taken)], dtype=torch.int64, device=collective_device())
        dist.broadcast(flag, src=0)
        if flag.item() and not taken:
            taken = ["files seen by rank 0"]
    if taken and not overwrite:
        raise FileExistsError(
            f"{os.fspath(path)!r} already holds an HF model ({taken}); pass overwrite=True "
            "or pick an empty directory"
        )
    groups = _split(rows, max_bytes)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    written: list[str] = []
    error: BaseException | None = None
    for i, (name, group) in enumerate(zip(names, groups)):
        report.files.append(name)
        report.weight_map.update((row[0], name) for row in group)
        if i % world != rank or error is not None:
            continue
        try:
            _write_file(f"{root}/{name}", fs, group, reader, metadata)
            written.append(f"{root}/{name}")
        except Exception as exc:  # every rank must learn of it: see _agree
            error = exc
    failed = _agree(error is not None, rank, world)
    if failed:  # no index names a broken export: every rank removes what it wrote
        for target in written:
            _remove_quietly(fs, target)
        if error is not None:
            raise error
        raise CheckpointError(
            f"rank(s) {failed} failed writing the HF export to {os.fspath(path)!r}; "
            "nothing was published (see their error)"
        )
    if rank == 0:
        total = sum(math.prod(r[3]) * r[2].itemsize for r in rows)
        index = {"metadata": {"total_size": total}, "weight_map": report.weight_map}
        with fs.open(f"{root}/{INDEX_FILE}", "w") as f:
            json.dump(index, f, indent=2)
        with fs.open(f"{root}/{CONFIG_FILE}", "w") as f:
            f.write(_config_json(template.config, dtype))
    if world > 1:
        dist.barrier()
    return report


def _write_file(target: str, fs, group, reader, metadata: Metadata) -> None:
    entries = [(row[0], row[2], row[3]) for row in group]
    url = fs.unstrip_protocol(target)
    writer = SafetensorsStreamWriter(url, entries, {"format": "pt"})
    try:
        by_source = {row[1]: row for row in group}
        for batch in read_full(reader, metadata, list(by_source), reuse=True):
            for source, tensor in batch.items():
                name, _source, out_dtype, _shape = by_source[source]
                writer.write(name, tensor if tensor.dtype == out_dtype else tensor.to(out_dtype))
            del batch  # its buffer is reused for the next tensor
    except BaseException:  # the read's error (a damaged chunk) is the one to report
        writer.abort()
        _remove_quietly(fs, target)
        raise
    writer.close()


def _remove_quietly(fs, target: str) -> None:
    try:
        fs.rm_file(target)
    except Exception:  # gone already, or the store refuses: the error raised says why
        pass


def _agree(failed_here: bool, rank: int, world: int) -> list[int]:
    """The ranks whose files failed (a collective when ``world > 1``): a failing rank
    must not leave the others waiting at a barrier, nor rank 0 publish the index."""
    if world == 1:
        return [rank] if failed_here else []
    flags = torch.zeros(world, dtype=torch.int64, device=collective_device())
    flags[rank] = int(failed_here)
    dist.all_reduce(flags)
    return [r for r in range(world) if flags[r].item()]
