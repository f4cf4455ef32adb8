"""The best checkpoint's record: ``checkpoint/best.json`` (metric, value, iteration, folders)
and the links ``checkpoint/best -> iter_NNNNNNN`` and ``checkpoint/best-hf ->
iter_NNNNNNN-hf``, replaced atomically (the names are replaced or removed, never a file a
link planted there points to); no second copy of the weights. The TrainState
(training/best.py) decides which checkpoint is best; rotation never deletes it."""

from __future__ import annotations

import json
import os
from typing import Optional

from ..atomic_write import write_atomic
from ..errors import ArgumentError
from ..input_files import load_json
from ..runtime import run_files
from .commit import HF_SUFFIX, new_token
from .state import TrainState
from .folders import fsync_dir, iter_dir_name

RECORD = "best.json"
LINK = "best"
HF_LINK = "best-hf"


def write(root: str, state: TrainState) -> Optional[dict]:
    """Rank 0, after a save: the record and links for ``state``'s best checkpoint (None:
    no best checkpoint on disk yet). A run judging a metric that has no best yet (a new
    branch resumed from before its first evaluation) removes an older record."""
    if state.best_metric is None:
        return None
    folder = iter_dir_name(state.best_iteration) if state.best_iteration is not None else None
    if folder is None or not os.path.isdir(os.path.join(root, folder)):
        if folder is None:
            for name in (RECORD, LINK, HF_LINK):
                _remove(os.path.join(root, name))
        return None
    hf_folder = folder + HF_SUFFIX
    has_hf = os.path.isdir(os.path.join(root, hf_folder))
    record = {"metric": state.best_metric, "greater_is_better": state.best_greater_is_better,
              "value": state.best_value, "iteration": state.best_iteration,
              "folder": folder, "hf_folder": hf_folder if has_hf else None}
    write_atomic(os.path.join(root, RECORD), json.dumps(record, indent=1) + "\n")
    _link(root, LINK, folder)
    if has_hf:
        _link(root, HF_LINK, hf_folder)
    else:
        _remove(os.path.join(root, HF_LINK))
    fsync_dir(root)
    return record


def read(root: str) -> Optional[dict]:
    """The record ``write`` left (None if there is none or it is unreadable)."""
    try:  # a regular file only (a FIFO would block), bounded JSON
        record = load_json(os.path.join(root, RECORD))
    except ArgumentError:
        return None
    return record if isinstance(record, dict) else None


def _link(root: str, name: str, target: str) -> None:
    """``root/name -> target`` (relative), replaced atomically. Where the file system has
    no symbolic links, best.json alone names the best checkpoint."""
    path = os.path.join(root, name)
    if os.path.islink(path) and os.readlink(path) == target:
        return
    tmp = os.path.join(root, f".{name}.tmp-{new_token()}")
    try:
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):
            run_files.unlink(tmp)


def _remove(path: str) -> None:
    """The name removed in its folder: a link itself, never its target."""
    if os.path.lexists(path) and (os.path.islink(path) or os.path.isfile(path)):
        run_files.unlink(path)
