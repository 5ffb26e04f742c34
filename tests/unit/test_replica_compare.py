"""The after-write replica comparison on synthetic replies (no processes): boxes held by a
subset of ranks (a shard replicated along one mesh axis) are compared only among their
holders, pieces written by one rank keep that rank's copy, split ones are rewritten."""

import torch

from shardkit.checkpoint._core._planner import SavePlan, WriteItem
from shardkit.checkpoint._core._replicas import mismatches_after_write, plan_replicas
from shardkit.spmd.layout import Box

SHAPE = (16, 4)


def _item(rows: tuple[int, int]) -> WriteItem:
    return WriteItem("w", Box((rows[0], 0), (rows[1] - rows[0], 4)), SHAPE, torch.float32)


# ranks 0, 1 hold rows 0-8; ranks 2, 3 hold rows 8-16 (Shard(0) x Replicate on a 2x2 mesh)
LOCAL = [SavePlan([_item((0, 8))]), SavePlan([_item((0, 8))]),
         SavePlan([_item((8, 16))]), SavePlan([_item((8, 16))])]  # fmt: skip
# rows 0-4 by rank 0, 4-8 by rank 1; rows 8-16 whole by rank 2
GLOBAL = [SavePlan([_item((0, 4))]), SavePlan([_item((4, 8))]),
          SavePlan([_item((8, 16))]), SavePlan([])]  # fmt: skip


def _chunk(rows, sums):
    return {"key": "w", "offsets": [rows[0], 0], "sizes": [rows[1] - rows[0], 4],
            "xxh3_64": sums}  # fmt: skip


def _replies(rank1_piece="a2", rank3_copy="b"):
    def shadow(rows, sums):
        return ["w", [rows[0], 0], [rows[1] - rows[0], 4], sums]

    return [
        {"chunks": [_chunk((0, 4), ["a1"])], "replicas": [shadow((4, 8), ["a2"])]},
        {"chunks": [_chunk((4, 8), [rank1_piece])], "replicas": [shadow((0, 4), ["a1"])]},
        {"chunks": [_chunk((8, 16), ["b"])], "replicas": []},
        {"chunks": [], "replicas": [shadow((8, 16), [rank3_copy])]},
    ]


def test_shadow_pieces_are_the_other_holders_pieces():
    plans = [plan_replicas(LOCAL, GLOBAL, r, lambda items: items) for r in range(4)]
    shadows = [[(i.box.offsets, i.box.sizes) for i in p.shadows] for p in plans]
    assert shadows == [[((4, 0), (4, 4))], [((0, 0), (4, 4))], [], [((8, 0), (8, 4))]]
    assert [b for b, _ in plans[0].holders["w"]] == [Box((0, 0), (8, 4)), Box((8, 0), (8, 4))]


def test_equal_copies_of_each_box_are_no_mismatch():
    rp = plan_replicas(LOCAL, GLOBAL, 0, lambda items: items)
    assert mismatches_after_write(rp, _replies()) == ({}, {}, set())


def test_a_split_box_that_differs_is_rewritten_from_its_lowest_holder():
    rp = plan_replicas(LOCAL, GLOBAL, 0, lambda items: items)
    mismatched, keepers, rewrite = mismatches_after_write(rp, _replies(rank1_piece="X"))
    box = Box((0, 0), (8, 4))
    assert mismatched == {"w": [[0], [1]]}
    assert keepers == {("w", box): 0} and rewrite == {("w", box)}


def test_a_box_written_whole_by_one_rank_keeps_that_copy_without_a_rewrite():
    rp = plan_replicas(LOCAL, GLOBAL, 3, lambda items: items)
    mismatched, keepers, rewrite = mismatches_after_write(rp, _replies(rank3_copy="Y"))
    assert mismatched == {"w": [[2], [3]]}
    assert keepers == {("w", Box((8, 0), (8, 4))): 2} and rewrite == set()


def test_without_a_spare_core_hashing_starts_at_the_hand_over(monkeypatch):
    import xxhash

    from shardkit.checkpoint._core import _replicas

    monkeypatch.setattr(_replicas, "_cores", lambda: 1)
    t = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    read = []
    shadows = _replicas.Shadows([_item((0, 16))], lambda i: read.append(i) or t)
    assert read == []  # nothing read while this rank still copies its own bytes out
    shadows.start()
    shadows.start()  # once only
    got = shadows.result()
    # one 4 MiB checksum block: the digest of all 256 bytes, as the writer records it
    assert got == [["w", [0, 0], [16, 4], [xxhash.xxh3_64_hexdigest(t.numpy().tobytes())]]]
    assert len(read) == 1
