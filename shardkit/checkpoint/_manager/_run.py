"""Which instance of a run directory RAM copies belong to: ``<path>/manager.run``.

The RAM tier names a run by its path, and a copy outlives its process by design. A run
directory removed (``rm -rf``) and started again under the same path is a new run, so
its first writer with a local tier writes a random id into ``manager.run`` (kept as
long as the directory is), every RAM copy records it, and a restore uses only copies
whose id the directory still holds. Copies of an earlier instance are then ignored, and
the new writer's saves and retention remove them as the run's own.
"""

from __future__ import annotations

import logging
import re
import uuid

from .._core._storage import read_small_file

__all__ = ["RUN_FILE", "ensure_run_id", "read_run_id"]

log = logging.getLogger(__name__)

RUN_FILE = "manager.run"
_ID = re.compile(r"^[0-9a-f]{32}$")


def read_run_id(store) -> str | None:
    """The id in ``<path>/manager.run`` of a ``StepStore``, or None (absent, unreadable)."""
    path = f"{store.root}/{RUN_FILE}"
    try:
        if store.local:  # never through a planted symlink; a FIFO does not block
            raw = read_small_file(path, 256)
        else:
            store.fs.invalidate_cache(store.root)
            raw = store.fs.cat_file(path)
    except (OSError, ValueError):
        return None
    text = raw[:256].decode("ascii", "replace").strip()
    return text if _ID.match(text) else None


def ensure_run_id(store) -> str:
    """The run directory's id, written first if it has none (the lease holder only)."""
    found = read_run_id(store)
    if found is not None:
        return found
    new = uuid.uuid4().hex
    store.publish(f"{store.root}/{RUN_FILE}", new.encode())  # replaces a bad file or a symlink
    return new
