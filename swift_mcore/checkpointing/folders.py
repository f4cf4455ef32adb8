"""Checkpoint folder names, and the latest-iteration file (latest_checkpointed_iteration.txt,
Megatron's "tracker"; swift-mcore's trackers are the --report_to ones) written atomically."""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ..errors import ArgumentError
from ..input_files import open_regular

LATEST_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_SUBDIR = "checkpoint"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_LATEST_MAX_BYTES = 64  # "1234567\n" and then some; more is not a latest-iteration file


def checkpoint_root(config) -> str:
    """``output_dir/checkpoint``: where a run's checkpoints and their latest-iteration file live."""
    return os.path.join(os.path.abspath(config.logging.output_dir), CHECKPOINT_SUBDIR)


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_dir(name: str) -> Optional[int]:
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def latest_path(root: str) -> str:
    return os.path.join(root, LATEST_FILENAME)


def read_latest(root: str) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None), or (None, why not) when the latest-iteration file is absent or
    unreadable."""
    path = latest_path(root)
    if not os.path.lexists(path):
        return None, f"{path} does not exist"
    try:  # a FIFO or device named like the file would block or never end
        with open_regular(path, "rb") as fh:
            raw = fh.read(_LATEST_MAX_BYTES + 1)
    except ArgumentError as err:
        return None, str(err)
    except OSError as err:
        return None, f"{path} cannot be read ({err})"
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:  # binary garbage: as unreadable as a wrong number
        return None, (f"{path} does not hold an iteration number (it holds binary data: "
                      f"{raw[:16]!r})")
    if len(raw) > _LATEST_MAX_BYTES:
        return None, (f"{path} does not hold an iteration number (it holds "
                      f"{len(raw)}+ bytes: {text[:40]!r})")
    if text == "release":
        return None, f"{path} names a 'release' checkpoint, which has no training state"
    try:
        value = int(text)
    except ValueError:
        return None, f"{path} does not hold an iteration number (it holds {text[:40]!r})"
    if value < 0:
        return None, f"{path} holds a negative iteration ({value})"
    return value, None


def write_latest(root: str, iteration: int) -> None:
    """Replace the latest-iteration file atomically: readers see the old value or the new one, never
    a partial file."""
    from ..atomic_write import write_atomic

    # A new temporary file (never one planted under a guessable name), renamed over the name;
    # a failed write (a full disk) leaves no temp file.
    write_atomic(latest_path(root), f"{iteration}\n")
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
