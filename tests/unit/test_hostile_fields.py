"""Every field of metadata.json replaced by hostile values, re-sealed with a valid checksum
(as an attacker would): load raises CorruptCheckpointError, never another exception (no
KeyError, ZeroDivisionError, RecursionError, OSError...), or loads exactly the saved
tensors (a harmless field such as ``created`` or a larger ``block_rows``)."""

import json

import torch
from column_planner import ColumnPlanner
from metadata_edit import reseal_metadata

import shardkit.checkpoint as dcp

_HOSTILE = [-1, 0, 10**12, 2**64, "x", None, [], {}, 1.5, True, [-1], "../x"]


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def test_every_field_with_hostile_values_raises_a_clear_error_or_loads_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(6, 8, generator=g), "h": torch.randn(4, 4, generator=g)}
    dcp.save(state, checkpoint_id=tmp_path, planner=ColumnPlanner())
    original = json.loads((tmp_path / "metadata.json").read_bytes())
    original.pop("metadata_xxh3_64")
    counts = {"raised": 0, "loaded": 0}
    for path in list(_paths(original))[1:]:
        for value in _HOSTILE:
            doc = json.loads(json.dumps(original))
            node = doc
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = value
            reseal_metadata(tmp_path, doc)
            out = {"w": torch.zeros(6, 8), "h": torch.zeros(4, 4)}
            try:
                dcp.load(out, checkpoint_id=tmp_path)
            except dcp.CorruptCheckpointError:
                counts["raised"] += 1
                continue
            assert torch.equal(out["w"], state["w"]) and torch.equal(out["h"], state["h"]), (
                path,
                value,
            )
            counts["loaded"] += 1
    assert counts["raised"] > 10 * counts["loaded"], counts
