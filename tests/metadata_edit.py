"""Rewrite a checkpoint's metadata.json with a valid checksum, for hostile-input tests.

A resealed edit passes the checksum, so only the deeper checks (tiling, bounds, file
sizes, references) can catch it: what an attacker who rewrites the file would produce.
"""

import json
from pathlib import Path

from shardkit.checkpoint._core._validate import seal_metadata


def reseal_metadata(ckpt_dir, doc: dict) -> None:
    """Write ``doc`` (any old ``metadata_xxh3_64`` dropped) as ``ckpt_dir``'s sealed
    metadata.json."""
    body = {k: v for k, v in doc.items() if k != "metadata_xxh3_64"}
    raw = json.dumps(body, separators=(",", ":")).encode()
    (Path(ckpt_dir) / "metadata.json").write_bytes(seal_metadata(raw))
