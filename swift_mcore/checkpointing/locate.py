"""Which checkpoint a run resumes from: ``--resume`` (auto: under output_dir),
``--resume PATH`` / ``--load PATH`` / export's and infer's ``--model PATH`` (a checkpoint
folder, a root holding latest_checkpointed_iteration.txt, or a run's output_dir).

The latest-iteration file decides. Two exceptions, each returned as a warning that every caller
(pt/sft ``--resume`` and ``--load``, export, infer) prints through ``announce``:
- it names a missing or incomplete folder, or is unreadable: the newest complete one;
- the save after it was sealed and renamed but the update of the latest-iteration file was cut off:
  that newer checkpoint (its manifest names the latest-iteration file's checkpoint as its parent).
  Newer checkpoints of an abandoned branch (a run that resumed from an older one) are ignored.

A folder Megatron-LM (or ms-swift) wrote is usable when whole (``check_usable``): it has no
manifest, and is never reported as a half-finished swift-mcore save.

The checkpoint found is refused, not replaced by another, when the facts it stores twice
disagree (its folder's name and train_state.json, say: consistency.py).
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Tuple

from .commit import (MANIFEST_FILENAME, check_complete, complete_checkpoints,
                     list_checkpoints, read_manifest)
from ..errors import CheckpointError
from . import consistency, megatron_lm
from .folders import (CHECKPOINT_SUBDIR, LATEST_FILENAME, iter_dir_name, parse_iter_dir,
                      read_latest)

Found = Tuple[Optional[str], List[str]]  # (checkpoint folder or None, warnings)


def announce(found: Found, log: Callable[[str], None]) -> Optional[str]:
    """The folder of a ``resolve`` result, once its warnings went through ``log``: the one
    place a fallback (or a resumed unrecorded successor) is told to the user."""
    folder, warnings = found
    for line in warnings:
        log(f"WARNING: {line}")
    return folder


def is_checkpoint_folder(path: str) -> bool:
    return (parse_iter_dir(os.path.basename(os.path.normpath(path))) is not None
            or os.path.exists(os.path.join(path, MANIFEST_FILENAME))
            or os.path.exists(os.path.join(path, "metadata.json")))


def check_usable(folder: str) -> Optional[str]:
    """None if ``folder`` can be loaded: a sealed swift-mcore checkpoint (commit's
    check_complete), or a whole Megatron-LM / ms-swift one (megatron_lm.problem); else why
    not."""
    if megatron_lm.is_megatron_lm(folder):
        return megatron_lm.problem(folder)
    return check_complete(folder)


def resolve(spec: str, default_root: str, flag: str = "--resume") -> Found:
    """``spec`` is 'auto' (look under ``default_root``) or a path. Raises CheckpointError
    for an explicit path that is missing or unusable, and for a checkpoint whose facts
    stored twice disagree (consistency.py), whichever way it was found."""
    found = _find(spec, default_root, flag)
    if found[0] is not None:
        consistency.check(found[0], flag)
    return found


def _find(spec: str, default_root: str, flag: str) -> Found:
    if spec == "auto":
        return in_root(default_root, explicit=None)
    path = os.path.abspath(os.path.expanduser(spec))
    if not os.path.exists(path):
        raise CheckpointError(f"{flag} {spec}: {path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {spec}: {path} is not a folder (give a checkpoint "
                              f"folder such as .../checkpoint/iter_0000100, or the "
                              f"checkpoint folder holding {LATEST_FILENAME})")
    run_root = os.path.join(path, CHECKPOINT_SUBDIR)
    if os.path.isdir(run_root) and not is_checkpoint_folder(path):
        path = run_root  # a run's output_dir: its checkpoint folder holds the latest file
    if is_checkpoint_folder(path):
        problem = check_usable(path)
        if problem:
            others = [p for _, p in complete_checkpoints(os.path.dirname(path))]
            hint = (f" Complete checkpoints next to it: {', '.join(others[-3:])}."
                    if others else "")
            raise CheckpointError(f"{flag} {spec}: {path} is not a usable checkpoint: "
                                  f"{problem}.{hint}")
        return path, []
    return in_root(path, explicit=f"{flag} {spec}")


def in_root(root: str, explicit: Optional[str]) -> Found:
    tracked, why = read_latest(root)
    latest_exists = os.path.exists(os.path.join(root, LATEST_FILENAME))
    folders = list_checkpoints(root)
    complete = complete_checkpoints(root)
    warnings: List[str] = []
    if tracked is not None:
        folder = os.path.join(root, iter_dir_name(tracked))
        problem = check_usable(folder)
        if problem is None:
            successor = _unrecorded_successor(folder, complete)
            if successor:
                warnings.append(
                    f"{successor} was sealed after the latest-iteration file's checkpoint "
                    f"{folder} but latest_checkpointed_iteration.txt was not updated "
                    f"(interrupted); resuming from it")
                return successor, warnings
            return folder, warnings
        reason = (f"{LATEST_FILENAME} names iteration {tracked}, but {folder} is not "
                  f"usable: {problem}")
    elif latest_exists:
        reason = why
    elif folders:
        reason = f"{root} has checkpoint folders but no {LATEST_FILENAME}"
    else:
        if explicit:
            raise CheckpointError(f"{explicit}: {root} holds no checkpoint (no "
                                  f"{LATEST_FILENAME} and no iter_* folder)")
        return None, warnings
    if complete:
        newest = complete[-1][1]
        warnings.append(f"{reason}; falling back to the newest complete checkpoint {newest}")
        return newest, warnings
    raise CheckpointError(
        f"{reason}, and no other complete checkpoint exists under {root}. Nothing was "
        f"changed on disk. To start from scratch, move {root} away or choose another "
        f"--output_dir; to resume from elsewhere, pass --resume PATH.")


def _unrecorded_successor(tracked_folder: str, complete) -> Optional[str]:
    manifest, _ = read_manifest(tracked_folder)
    tracked_id = manifest.get("id") if manifest else None
    if not tracked_id:
        return None
    newest = None
    tracked_iteration = parse_iter_dir(os.path.basename(tracked_folder))
    for iteration, path in complete:
        if iteration <= tracked_iteration:
            continue
        other, _ = read_manifest(path)
        if other and other.get("parent_id") == tracked_id:
            newest = path
    return newest


def existing_checkpoints(root: str) -> List[str]:
    """Complete checkpoints under ``root`` (a fresh run refuses to write over them)."""
    return [path for _, path in complete_checkpoints(root)]
