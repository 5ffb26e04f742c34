"""Reference counting of shared data files between a manager's step directories.

An incremental step references data files that live in the directory of the step that
wrote them. A file is needed while any committed step's metadata links it, so deleting a
step removes its metadata first (it is then no longer listed), then only the files no
committed step references; the directory goes once nothing in it is referenced. A crash
at any point leaves every listed step with all of its files. The references are always
computed from the committed steps' metadata on storage, never from memory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._core._load import read_metadata

if TYPE_CHECKING:
    from ._storage import StepStore

__all__ = ["referenced_files"]


def referenced_files(
    store: StepStore, steps: Iterable[int], cache: dict[int, dict[str, str]] | None = None
) -> dict[str, set[str]]:
    """Step directory name -> names of its files that the metadata of ``steps`` links.

    ``cache`` (step -> linked file -> directory) saves re-reading the metadata of steps
    seen before: a committed step's metadata never changes. Raises if a step's metadata
    cannot be read: a caller must then delete nothing.
    """
    cache = {} if cache is None else cache
    out: dict[str, set[str]] = defaultdict(set)
    steps = list(steps)
    for step in steps:
        if step not in cache:
            md = read_metadata(store.step_url(step), storage_options=store.storage_options)
            cache[step] = {name: link.dir for name, link in md.linked.items()}
        for name, folder in cache[step].items():
            out[folder].add(name)
    for step in set(cache) - set(steps):  # deleted steps' entries
        del cache[step]
    return dict(out)
