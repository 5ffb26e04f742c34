"""Load a Hugging Face safetensors directory straight into a sharded model.

Each rank reads, through ``safetensors.safe_open(...).get_slice``, only the byte ranges of
its own shards: FSDP's dim-0 rows, a ShardedTensor's box, or the whole tensor for a
replicated one. Nothing is gathered and no rank reads the whole file.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ...spmd import ShardedTensor
from .._core._errors import CorruptCheckpointError
from .._core._format import SAFETENSORS_NAMES
from .._core._storage import open_regular, read_small_file
from .._core._validate import load_json
from .._state_dict._fqn import clean_key, unwrap
from .._state_dict._model import get_model_state_dict
from ._hf import INDEX_FILE

__all__ = ["load_hf", "hf_weight_map"]

_SINGLE = "model.safetensors"
#: Largest ``model.safetensors.index.json`` read (bytes). An index holds one short line per
#: tensor: the largest published ones (MoE models with ~100,000 tensors) are about 10 MiB.
MAX_INDEX_BYTES = 32 << 20


def _check_name(name: Any, index_path: str) -> str:
    if (
        not isinstance(name, str)
        or not name.endswith(".safetensors")
        or os.path.basename(name) != name
        or name.startswith(".")
    ):
        raise CorruptCheckpointError(
            f"{index_path}: weight_map names file {name!r}; it must be a plain "
            "'*.safetensors' file name in the same directory"
        )
    return name


def hf_weight_map(path: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """The directory and ``{key: file}`` of an HF checkpoint (sharded with an index, a
    single ``model.safetensors``, or a path to one ``.safetensors`` file)."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(f"load_hf reads local directories only (safetensors mmap), got {text!r}")
    text = text.removeprefix("file://")
    if os.path.isfile(text):
        if not text.endswith(".safetensors"):
            raise ValueError(f"{text!r} is not a .safetensors file nor an HF model directory")
        folder, single = os.path.split(text)
        return folder or ".", dict.fromkeys(_keys(text), single)
    index = os.path.join(text, INDEX_FILE)
    if os.path.isfile(index):
        # the Hub's cache links the index to its blob: resolve the link, then read without
        # following one (a FIFO or device swapped in is refused, never waited on)
        raw = read_small_file(os.path.realpath(index), MAX_INDEX_BYTES)
        if len(raw) > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(
                f"{index}: more than {MAX_INDEX_BYTES} bytes; an index of key -> file names "
                "is far smaller (a hostile or wrong file?)"
            )
        data = load_json(raw, index)
        wmap = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(k, str) for k in wmap):
            raise CorruptCheckpointError(f"{index}: no 'weight_map' object of key -> file")
        out = {k: _check_name(v, index) for k, v in wmap.items()}
        for name in set(out.values()):
            if not os.path.isfile(os.path.join(text, name)):
                raise FileNotFoundError(f"{index} names {name!r}, which is not in {text!r}")
        return text, out
    single = os.path.join(text, _SINGLE)
    if os.path.isfile(single):
        return text, dict.fromkeys(_keys(single), _SINGLE)
    raise FileNotFoundError(
        f"{text!r} holds neither {INDEX_FILE} nor {_SINGLE}: not an HF safetensors checkpoint"
    )


def _open(path: str):
    try:
        os.close(open_regular(path))  # a FIFO or device in its place: refused, not waited on
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


_MAX_HEADER = 100 << 20


class _Header:
    """A safetensors file's header, checked against the file's size (hostile input)."""

    def __init__(self, path: str) -> None:
        self.path = path
        # the Hub's cache links each shard to its blob, so links are followed; a FIFO or
        # device swapped in is refused at once (NotRegularFileError), never waited on
        self.fd = open_regular(path)
        try:
            size = os.fstat(self.fd).st_size
            raw = os.pread(self.fd, 8, 0)
            hlen = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < hlen <= min(_MAX_HEADER, size - 8):
                raise CorruptCheckpointError(f"{path}: safetensors header length {hlen} is invalid")
            header = load_json(os.pread(self.fd, hlen, 8), path, "safetensors header")
        except BaseException:
            self.close()
            raise
        self.base, self.size = 8 + hlen, size
        self.entries = header if isinstance(header, dict) else {}

    def byte_range(self, key: str, dtype: str, shape: tuple, itemsize: int) -> int | None:
        """Where ``key``'s data starts, if stored as ``dtype`` / ``shape``; else None."""
        info = self.entries.get(key)
        if not isinstance(info, dict) or info.get("dtype") != dtype:
            return None
        offsets = info.get("data_offsets")
        if list(info.get("shape", ())) != list(shape) or not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            return None
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            return None
        if self.base + end > self.size:
            raise CorruptCheckpointError(
                f"{self.path}: {key!r} byte range {begin}..{end} runs past the end of the file"
            )
        return self.base + begin

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path}: truncated at byte {offset + done}")
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rows_read(head: _Header, key: str, slices: tuple, live: torch.Tensor, shape: tuple) -> bool:
    """Read a dim-0 row range straight into ``live`` (one pread): FSDP's shards, and any
    box whole on every other dim. False when the layout or dtype does not allow it."""
    if not slices or not live.is_contiguous() or live.dtype not in SAFETENSORS_NAMES:
        return False
    if any(s.start != 0 or s.stop != n for s, n in zip(slices[1:], shape[1:])):
        return False
    itemsize = live.element_size()
    start = head.byte_range(key, SAFETENSORS_NAMES[live.dtype], shape, itemsize)
    if start is None:
        return False
    row = math.prod(shape[1:]) * itemsize
    head.read_into(live, start + slices[0].start * row)
    return True


def _keys(path: str) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


def _missing_hint(missing: list[str], files_keys) -> str:
    """A sentence for mixture-of-experts weights stored per expert, else ''."""
    per_expert = any(".experts.0." in k for k in files_keys)
    if not per_expert or not any("experts" in k for k in missing):
        return ""
    return (
        "the files store the experts one by one (experts.0. ..., the Hub's layout), which "
        "transformers converts to this model's stacked experts as it loads; load_hf copies "
        "tensors by name and does not. Load such a checkpoint with from_pretrained into the "
        "plain model before wrapping it; "
    )


def _box_of(value: Any, key: str) -> tuple[tuple[slice, ...], torch.Tensor]:
    """The slices this rank holds of ``value`` and the live tensor to copy them into."""
    if isinstance(value, ShardedTensor):
        box = value.local_box()
        return box.slices(), value.local_tensor()
    if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, nn.Parameter):
        return tuple(slice(0, s) for s in value.shape), value
    raise TypeError(
        f"load_hf fills plain tensors and shardkit ShardedTensors; {key!r} is a "
        f"{type(value).__name__} (load it with shardkit.checkpoint.load after to_hf's reverse)"
    )


def load_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    prefix: str = "",
    strict: bool = True,
) -> list[str]:
    """Fill ``model``'s parameters and buffers, in place, from an HF safetensors checkpoint.

    ``model`` may be plain, shardkit-FSDP-wrapped, or hold ShardedTensor parameters
    (tensor parallel): each rank reads only the bytes of its own shard of every tensor
    (``safe_open(...).get_slice``), cast to the model's dtype. A tied weight the files
    store once (as ``save_pretrained`` writes them) fills every alias.

    Args:
        model: the model to fill; its keys (unwrapped FQNs) are the HF names.
        path: an HF directory (``model.safetensors.index.json`` with its shards, or a
            single ``model.safetensors``), or one ``.safetensors`` file; local paths only.
        prefix: where the HF model sits inside ``model`` (e.g. ``"lm."``); keys outside it
            are left alone.
        strict: a model parameter the files lack raises ``KeyError`` naming it; with
            ``False`` it keeps its value. Buffers the files lack always keep theirs.

    Returns:
        The model keys (under ``prefix``) that kept their values.
    """
    if not isinstance(model, nn.Module):  # load_hf(path, model) said "expected str, bytes"
        raise TypeError(
            f"load_hf(model, path): model must be a torch.nn.Module, got "
            f"{type(model).__name__}; the model comes first"
        )
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a string, got {prefix!r}")
    if prefix and not prefix.endswith("."):
        prefix += "."
    folder, wmap = hf_weight_map(path)
    state = get_model_state_dict(model)
    root = unwrap(model)
    buffers = {clean_key(root, name) for name, _ in root.named_buffers()}
    groups: dict[int, set[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(clean_key(root, name))
    tied = {k: g for g in groups.values() for k in g}
    targets = {}
    for key, value in state.items():
        if key.startswith(prefix):
            targets[key] = _box_of(value, key)
    if not targets:  # nothing would be loaded, whatever `strict` says
        firsts = sorted({key.split(".")[0] + "." for key in state})[:8]
        raise ValueError(
            f"no key of the model starts with prefix={prefix!r}: the model's keys start with "
            f'{firsts}; pass the prefix under which the HF model sits ("" for the model '
            "itself)"
        )
    kept: list[str] = []
    pending: dict[str, list[tuple[str, tuple, torch.Tensor]]] = {}
    for key, (slices, live) in targets.items():
        hf_key = key[len(prefix) :]
        if hf_key in wmap:
            pending.setdefault(wmap[hf_key], []).append((hf_key, slices, live))
        else:
            kept.append(key)
    missing, filled_aliases = [], set()
    for key in kept:
        aliases = tied.get(key, ())
        if any(a[len(prefix) :] in wmap for a in aliases if a.startswith(prefix)):
            filled_aliases.add(key)  # a tied alias, filled through the key the files hold
            continue
        if key in buffers:
            continue
        missing.append(key)
    kept = [key for key in kept if key not in filled_aliases]
    if missing and strict:
        raise KeyError(
            f"the HF checkpoint {os.fspath(path)!r} lacks {len(missing)} parameter(s) of the "
            f"model: {missing[:20]}; {_missing_hint(missing, wmap)}pass strict=False to keep "
            "their current values (they are then not loaded)"
        )
    handles = {name: _open(os.path.join(folder, name)) for name in pending}
    heads: dict[str, _Header] = {}
    try:
        # every shape first (headers only), so a mismatch changes nothing
        for name, items in pending.items():
            held = set(handles[name].keys())
            for hf_key, _slices, _live in items:
                if hf_key not in held:
                    raise CorruptCheckpointError(
                        f"{os.path.join(folder, name)}: the index maps {hf_key!r} to this "
                        "file, which does not hold it"
                    )
                shape = tuple(handles[name].get_slice(hf_key).get_shape())
                want = _shape_of(state[prefix + hf_key])
                if shape != want:
                    raise ValueError(
                        f"{os.path.join(folder, name)}: {hf_key!r} has shape {shape} but the "
                        f"model's is {want}"
                    )
        with torch.no_grad():
            for name, items in pending.items():
                f = handles[name]
                head = heads[name] = _Header(os.path.join(folder, name))
                for hf_key, slices, live in items:
                    if live.numel() == 0:
                        continue  # an empty shard: nothing of this tensor on this rank
                    shape = _shape_of(state[prefix + hf_key])
                    if _rows_read(head, hf_key, slices, live, shape):
                        continue
                    # other boxes (e.g. column shards) and dtype casts: safetensors slices
                    data = f.get_slice(hf_key)[slices] if slices else f.get_tensor(hf_key)
                    live.copy_(data.reshape(live.shape))
    finally:
        handles.clear()
        for head in heads.values():
            head.close()
    return sorted(kept)


def _shape_of(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)
