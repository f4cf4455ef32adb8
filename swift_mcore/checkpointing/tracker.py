"""Checkpoint folder names and the tracker file (latest_checkpointed_iteration.txt), written
atomically: temp file, fsync, rename, fsync of the folder."""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ..errors import ArgumentError
from ..input_files import open_regular

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_SUBDIR = "checkpoint"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TRACKER_MAX_BYTES = 64  # "1234567\n" and then some; more is not a tracker


def checkpoint_root(args) -> str:
    """``output_dir/checkpoint``: where a run's checkpoints and its tracker live."""
    return os.path.join(os.path.abspath(args.logging.output_dir), CHECKPOINT_SUBDIR)


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def parse_iter_dir(name: str) -> Optional[int]:
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER_FILENAME)


def read_tracker(root: str) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None), or (None, why not) when the tracker is absent or unreadable."""
    path = tracker_path(root)
    if not os.path.lexists(path):
        return None, f"{path} does not exist"
    try:  # a FIFO or device named like the tracker would block or never end
        with open_regular(path, "rb") as fh:
            raw = fh.read(_TRACKER_MAX_BYTES + 1)
    except ArgumentError as err:
        return None, str(err)
    except OSError as err:
        return None, f"{path} cannot be read ({err})"
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:  # binary garbage: as unreadable as a wrong number
        return None, (f"{path} does not hold an iteration number (it holds binary data: "
                      f"{raw[:16]!r})")
    if len(raw) > _TRACKER_MAX_BYTES:
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


def write_tracker(root: str, iteration: int) -> None:
    """Replace the tracker atomically: readers see the old value or the new one, never a
    partial file."""
    path = tracker_path(root)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{iteration}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a failed write (a full disk) leaves no temp file
            os.remove(tmp)
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
