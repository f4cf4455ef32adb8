"""The package's cache folder (tokenizers, tokenized inputs, measured peaks), and how
concurrent ranks and processes fill it safely."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterator

from .errors import OutputError

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
    path = os.path.join(folder, ".lock")
    # A link planted at the lock's name (a shared cache) is refused, never created through.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise OutputError(f"{path}: cannot be opened as the cache's lock file ({err.strerror}"
                          f"); a link or another file is in its place: remove it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OutputError(f"{path}: is not a regular file, so it cannot be the cache's "
                              f"lock file: remove it")
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
