"""The data cache folder, and how concurrent ranks and processes fill it safely."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: atomic renames alone still keep readers safe
    fcntl = None


def cache_dir(*parts: str) -> str:
    """``$SWIFT_MCORE_CACHE`` (default ``~/.cache/swift_mcore``) joined with ``parts``, created."""
    root = os.environ.get("SWIFT_MCORE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "swift_mcore")
    path = os.path.join(root, *parts)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` so one process builds while the others wait.

    Without the lock every rank would build the same artifact at once; the later ones would
    waste the time, and a non-deterministic builder could leave ranks holding different
    in-memory copies.
    """
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "a+") as fh:
        if fcntl is not None:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
