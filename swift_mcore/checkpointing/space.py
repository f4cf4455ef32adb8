"""Disk space for a save: what it needs, a refusal before writing when the disk clearly lacks
it, and a failed save (a full disk, say) turned into one clear error, its staging folder
removed, the previous checkpoint left in place as the latest-iteration file's.

Left to torch, a full disk shows as ``unexpected pos 704 vs 598``: the zip writer behind
``torch.save`` (used by DCP for every item of a ``.distcp`` file) gets a short write from
the full disk, and its next write finds the file position off. The OS error (ENOSPC) never
reaches the caller. And the staging folder it leaves keeps filling the disk until the next
save starts, so a resumed run would train and then fail at its first save the same way.

Test hook: ``SWIFT_MCORE_TEST_FAIL_SAVE_AFTER_BYTES=N`` makes the DCP writer behave as on a
disk that fills up after N bytes of checkpoint data in this process (a short write, then
ENOSPC), as a real disk does.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
from typing import Any, Dict, List, Optional

import torch

from ..errors import CheckpointError
from ..runtime import collectives as comm
from . import commit
from .folders import iter_dir_name, read_latest

TEST_FAIL_AFTER_BYTES = "SWIFT_MCORE_TEST_FAIL_SAVE_AFTER_BYTES"
_PER_TENSOR = 2 << 10    # torch.save's zip framing of one tensor in a .distcp file
_SMALL_FILES = 64 << 10  # .metadata, common.pt, the JSON and RNG files
_FULL_DISK_SIGNS = ("No space left on device", "Disk quota exceeded", "unexpected pos")


class DiskSpaceError(CheckpointError):
    """The save was refused before writing: the disk has less free space than it needs."""


_current: Dict[str, Any] = {"need": None}


def estimate(state_dict) -> int:
    """Collective: about the bytes the save writes, over all ranks: each tensor shard once
    (data-parallel replicas are written by one rank only), plus torch.save's framing of
    each (about 1.5 KiB) and the small files."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                          is_main_replica)

    mine = 0
    for value in nested_values(state_dict):
        data = getattr(value, "data", None)
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(
                data, torch.Tensor) and is_main_replica(value.replica_id):
            mine += data.numel() * data.element_size() + _PER_TENSOR
    return int(sum(comm.all_gather(mine))) + _SMALL_FILES


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def check_free(root: str, iteration: int, state_dict) -> int:
    """Collective, before the sharded write: refuse (DiskSpaceError on every rank) if the
    disk under ``root`` has less free space than the save's tensor data alone needs."""
    need = estimate(state_dict)
    _current["need"] = need

    def check() -> Optional[str]:
        free = free_bytes(root)
        if free >= need:
            return None
        return (f"not enough disk space to save checkpoint iteration {iteration} in {root}: "
                f"it needs about {_size(need)}, {_size(free)} are free. Nothing was written; "
                f"{_previous(root)} Free some space, then continue with --resume.")

    message = comm.decide(check)
    if message:
        raise DiskSpaceError(message)
    return need


def guarded(save):
    """Decorator for save_checkpoint(args, state, ...): whatever fails in a save (a full
    disk during the write or the seal, a refusal) is raised on every rank as one
    CheckpointError line, after rank 0 removed the save's staging folder."""

    @functools.wraps(save)
    def wrapper(args, state, *rest, **kwargs):
        from .folders import checkpoint_root

        root = checkpoint_root(args)
        _current["need"] = None
        try:
            with _test_write_limit():
                return save(args, state, *rest, **kwargs)
        except DiskSpaceError:
            comm.decide(_remove_own_staging, root)
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            # Every rank is here together: the save's collectives raise on all of them.
            message = comm.decide(_failed, root, state.iteration, _text(err),
                                  _current["need"])
            raise CheckpointError(message) from err

    return wrapper


def failed_background_save(root: str, iteration: int, err: BaseException):
    """Collective, for a background save (--async_save) that failed when it was finalized:
    its staging folder removed on rank 0, the CheckpointError to raise on every rank."""
    from ..errors import CheckpointError

    return CheckpointError(comm.decide(_failed, root, iteration, _text(err), None))


def _failed(root: str, iteration: int, error: str, need: Optional[int]) -> str:
    """Rank 0: remove the staging folder; say what happened in one line."""
    removed = _remove_own_staging(root)
    final = os.path.join(root, iter_dir_name(iteration))
    if not removed and commit.check_complete(final) is None:
        return (f"checkpoint {final} was written and sealed, but finishing the save failed: "
                f"{error}. --resume continues from it.")
    free = free_bytes(root) if os.path.isdir(root) else None
    need = need if need is not None else _checkpoint_bytes(root)
    gone = "The partial save was removed; " if removed else ""
    if any(sign in error for sign in _FULL_DISK_SIGNS) or (
            need is not None and free is not None and free < need):
        if "unexpected pos" in error:
            error += " (torch's zip writer after a short write: the disk filled up)"
        return (f"saving checkpoint iteration {iteration} failed: out of disk space in "
                f"{root} (the checkpoint needs about {_size(need)}, {_size(free)} are free "
                f"now; the write failed with: {error}). {gone}{_previous(root)} Free some "
                f"space, then continue with --resume.")
    return (f"saving checkpoint iteration {iteration} in {root} failed: {error}. {gone}"
            f"{_previous(root)}")


def _remove_own_staging(root: str) -> List[str]:
    """Rank 0: the staging folders this process created under ``root`` (its pid and host
    are in their names), removed."""
    if not os.path.isdir(root):
        return []
    removed = []
    for name in os.listdir(root):
        owner = commit.staging_owner(name)
        if ".tmp-" in name and owner == (os.getpid(), commit._host()):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _previous(root: str) -> str:
    tracked, _ = read_latest(root)
    if tracked is None:
        return "no earlier checkpoint had been committed."
    return (f"latest_checkpointed_iteration.txt still names iteration {tracked} "
            f"({os.path.join(root, iter_dir_name(tracked))}, untouched).")


def _checkpoint_bytes(root: str) -> Optional[int]:
    """Size of the latest-iteration file's checkpoint from its manifest (the estimate when a save
    failed before its state dict was measured)."""
    tracked, _ = read_latest(root)
    if tracked is None:
        return None
    manifest, _ = commit.read_manifest(os.path.join(root, iter_dir_name(tracked)))
    if not manifest:
        return None
    return sum(entry.get("size", 0) for entry in manifest["files"].values())


def _size(n: Optional[int]) -> str:
    if n is None:
        return "an unknown number of bytes"
    unit, scale = ("GiB", 2**30) if n >= 2**30 else ("MiB", 2**20)
    return f"{n:,} bytes ({n / scale:.1f} {unit})"


def _text(err: BaseException) -> str:
    """The root cause of ``err`` as one short line (DCP wraps a writer's error, with its
    traceback, in a CheckpointException)."""
    found = _root_causes(err)
    full = [e for e in found if isinstance(e, OSError) and e.errno in (errno.ENOSPC,
                                                                       errno.EDQUOT)]
    cause = (full or found or [err])[-1] if not full else full[0]
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        text = f"[Errno {cause.errno}] {os.strerror(cause.errno)}"
        if getattr(cause, "filename", None):
            text += f": {cause.filename}"
    if not isinstance(cause, CheckpointError):
        text = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    return text[:300]


def _root_causes(err: BaseException) -> List[BaseException]:
    chain, seen, todo = [], set(), [err]
    while todo:  # breadth first: the deepest cause comes last
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        chain.append(e)
        todo.append(e.__cause__ or e.__context__)
        for failure in getattr(e, "failures", {}).values():  # DCP CheckpointException
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                todo.append(inner)
    return chain


# ---- test hook: a disk that fills up ---------------------------------------------------
_budget: Dict[str, Any] = {"value": None}


@contextlib.contextmanager
def _test_write_limit():
    limit = os.environ.get(TEST_FAIL_AFTER_BYTES)
    if not limit:
        yield
        return
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _budget["value"] is None:  # shared with the writer processes DCP forks
        _budget["value"] = multiprocessing.get_context("fork").Value("q", int(limit))
    filesystem_async.open = functools.partial(_limited_open, _budget["value"])
    try:
        yield
    finally:
        del filesystem_async.open


def _limited_open(budget, file, mode="r", *args, **kwargs):
    fh = open(file, mode, *args, **kwargs)
    return _FillingFile(fh, budget) if any(m in mode for m in "wax+") else fh


class _FillingFile:
    """A file on a disk with ``budget`` bytes left: writes beyond it are cut short, then
    fail with ENOSPC, as write(2) does."""

    def __init__(self, fh, budget):
        self._fh, self._budget = fh, budget

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        with self._budget.get_lock():
            room = self._budget.value
            n = min(room, len(view))
            self._budget.value = room - n
        if n == 0 and len(view):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._fh.name)
        self._fh.write(view[:n])
        return n

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()
