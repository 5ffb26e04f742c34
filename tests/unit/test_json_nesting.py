"""JSON from files shardkit did not write is measured before ``json.loads`` sees it.

``json.loads`` recurses once per nesting level. Near Python's recursion limit, a finalizer
that the garbage collector runs in the middle of parsing (of some other thread's cyclic
garbage) fails with RecursionError: pytest reported it as three unraisable exceptions
in ``test_manager_hostile_files.py`` on a loaded machine, once in several runs. So
``parse_json`` refuses nesting deeper than ``MAX_PARSE_NESTING`` without parsing.
"""

from __future__ import annotations

import json
import random

import pytest

from shardkit.checkpoint._core import _storage
from shardkit.checkpoint._core._storage import (
    MAX_PARSE_NESTING,
    JSONNestingError,
    json_nesting,
    parse_json,
)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _random_doc(rng: random.Random, depth: int):
    """Nested lists and objects whose strings are full of brackets, quotes, backslashes."""
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([1, 2.5, None, True, "".join(rng.choices('[]{}"\\ab\u00e9', k=6))])
    if rng.random() < 0.5:
        return [_random_doc(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    keys = ("".join(rng.choices('[]{}"\\ab', k=4)) for _ in range(rng.randint(0, 3)))
    return {k: _random_doc(rng, depth - 1) for k in keys}


def test_nesting_matches_the_parsed_depth_whatever_the_strings_hold():
    rng = random.Random(0)
    for _ in range(500):
        doc = _random_doc(rng, rng.randint(0, 12))
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False)):
            assert json_nesting(text) == _depth(doc), text
            assert json_nesting(text.encode()) == _depth(doc), text


@pytest.mark.parametrize(
    "text, depth",
    [("", 0), ("[]", 1), ('["[[[[", [1]]', 2), ('"]]]]]]" [[[[[', 5), ('["\\\\", [[1]]]', 3)],
)
def test_nesting_of_edge_cases(text, depth):
    assert json_nesting(text) == depth


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"a":' * (MAX_PARSE_NESTING + 1) + "1" + "}" * (MAX_PARSE_NESTING + 1)],
    ids=["100000 unclosed", "one level too deep"],
)
def test_deep_json_is_refused_before_json_loads_runs(monkeypatch, text):
    calls = []
    monkeypatch.setattr(_storage.json, "loads", lambda *a, **k: calls.append(a))
    with pytest.raises(JSONNestingError, match=f"deeper than {MAX_PARSE_NESTING}"):
        parse_json(text)
    assert not calls


def test_json_at_the_limit_still_parses():
    text = "[" * MAX_PARSE_NESTING + "]" * MAX_PARSE_NESTING
    assert _depth(parse_json(text)) == MAX_PARSE_NESTING
    assert parse_json(b'{"a": ["[[[", {"b": null}]}') == {"a": ["[[[", {"b": None}]}


def test_a_file_limit_below_the_parser_limit_is_enforced_on_the_raw_text(monkeypatch):
    """``load_json`` (files shardkit did not write: 64 levels) measures the text too; the
    parsed document is not walked again, and too deep text is never parsed."""
    from shardkit.checkpoint import CorruptCheckpointError
    from shardkit.checkpoint._core._validate import MAX_NESTING, load_json

    at_limit = '{"a":' * MAX_NESTING + "1" + "}" * MAX_NESTING
    assert _depth(load_json(at_limit, "f.json")) == MAX_NESTING
    calls = []
    monkeypatch.setattr(_storage.json, "loads", lambda *a, **k: calls.append(a))
    deeper = "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)
    with pytest.raises(
        CorruptCheckpointError, match=f"f.json: JSON nested deeper than {MAX_NESTING}"
    ):
        load_json(deeper, "f.json")
    assert not calls
