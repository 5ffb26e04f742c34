"""The metadata a save commits, assembled from what every rank wrote."""

from __future__ import annotations

import datetime

from ...spmd.layout import Box
from ._format import ChunkMeta, Metadata, ObjectMeta, TensorMeta, decode_value, dtype_from_name
from ._incremental import linked_version, links_from_replies

__all__ = ["build_metadata", "entries"]


def build_metadata(save_id: str, world_size: int, replies: list[dict]) -> Metadata:
    """The checkpoint's metadata from every rank's reply to the write (rank 0's first)."""
    coord = replies[0]
    md = Metadata(
        save_id=save_id,
        world_size=world_size,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    chunks: dict[str, list[ChunkMeta]] = {}
    shapes: dict[str, tuple] = {}
    for reply in replies:
        md.files.update(reply["files"])
        for c in reply["chunks"]:
            shapes[c["key"]] = (dtype_from_name(c["dtype"], c["key"]), tuple(c["shape"]))
            chunks.setdefault(c["key"], []).append(
                ChunkMeta(
                    box=_box(c),
                    file=c["file"],
                    name=c["name"],
                    offset=c["offset"],
                    nbytes=c["nbytes"],
                    block_rows=c["block_rows"],
                    checksums=tuple(c["xxh3_64"]),
                )
            )
    for key in sorted(chunks):
        dtype, shape = shapes[key]
        ordered = sorted(chunks[key], key=lambda c: c.box.offsets)
        md.tensors[key] = TensorMeta(dtype, shape, tuple(ordered))
    md.linked = links_from_replies(replies)
    md.version = linked_version(md.linked) or md.version
    md.values = {k: decode_value(v) for k, v in coord.get("values", {}).items()}
    for reply in replies[1:]:  # entries rank 0 lacks: the lowest rank holding one wins
        _add_missing(md.values, {k: decode_value(v) for k, v in reply.get("values", {}).items()})
    md.objects = {  # each rank sent only keys no lower rank holds
        k: ObjectMeta(o["file"], o["offset"], o["nbytes"], o["xxh3_64"])
        for reply in replies
        for k, o in reply.get("objects", {}).items()
    }
    return md


def entries(values: dict, prefix: tuple = ()) -> list[tuple]:
    """Every entry path of ``values``, into nested dicts (as torch flattens them)."""
    out = []
    for k, v in values.items():
        path = (*prefix, repr(k))
        out.append(path)
        if isinstance(v, dict):
            out += entries(v, path)
    return out


def _add_missing(into: dict, other: dict) -> None:
    """``other``'s entries that ``into`` lacks, into nested dicts too; ``into`` wins."""
    for k, v in other.items():
        if k not in into:
            into[k] = v
        elif isinstance(into[k], dict) and isinstance(v, dict):
            _add_missing(into[k], v)


def _box(c: dict) -> Box:
    return Box(tuple(c["offsets"]), tuple(c["sizes"]))
