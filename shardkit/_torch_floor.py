"""The oldest torch shardkit runs on, checked at import without importing torch.

pip enforces ``torch>=2.12`` from the package metadata, but a torch installed another way
(conda, ``--no-deps``, a source build) is not checked by pip; an older one fails deep in
an import or a test with a missing argument. Checking the installed version first turns
that into one clear error. Why 2.12: docs/migrating.md, "Torch versions".
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["MIN_TORCH", "check_torch_version"]

MIN_TORCH = (2, 12)


def check_torch_version(found: str | None = None) -> None:
    """Raise ImportError if the installed torch is older than :data:`MIN_TORCH`.

    Args:
        found: the version to check (default: the installed torch's, from its package
            metadata; a torch without metadata, e.g. a source tree, is not checked).
    """
    if found is None:
        try:
            found = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None:
        return  # not a release number; let the imports say what is missing
    if (int(match.group(1)), int(match.group(2))) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"shardkit needs torch >= {need}, but torch {found} is installed; upgrade it "
            f"with: pip install 'torch>={need}' (older torch lacks APIs shardkit uses, "
            "see docs/migrating.md, 'Torch versions')"
        )
