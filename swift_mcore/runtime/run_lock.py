"""One run per --output_dir: an exclusive lock on the folder, held for the run's whole life.

A second run (or `export --to_mcore`) on a folder in use refuses at start, before any work,
with one line naming the folder and the process that holds it (pid, host, start time).

- The lock is ``fcntl.flock`` on ``output_dir/.run.lock``. The OS releases it when its
  holder ends, however it ends: a SIGKILLed run never blocks the next ``--resume``.
- One process of a run holds it: the `swift-mcore` launcher of node 0 (NPROC_PER_NODE),
  or else global rank 0. A launcher hands it to its ranks through ``SWIFT_MCORE_RUN_LOCK``
  (the token written in the lock file), so the ranks of one run never lock each other out.
- Only the holder keeps the lock file open: processes it forks (data loader workers,
  checkpoint writers) close their copy at once, so none of them outlives the holder with
  the lock. Within one process the lock is re-entrant (a second Trainer on the same folder,
  e.g. train, then resume, in one Python session).
- The file holds who took it, as JSON, for the refusal message. A clean release deletes it
  (a run stopped by bad input leaves its folder as it found it); one left by a killed run
  is taken over by the next.
- The lock is taken in the folder's real path (a --output_dir given through a link locks the
  folder it names). Its file is opened and removed as run files are (runtime/run_files.py):
  a link or a hard link planted as ``.run.lock`` is refused, never followed, written or
  deleted; so is a planted link among the run's records or as its checkpoint folder (which
  would take the saves into a folder this lock does not cover, another run's, say).
- A child closes its copy when it first runs, which on a loaded machine can be after its
  parent has already died: a lock whose recorded holder has ended is therefore waited for
  (``ENDED_HOLDER_GRACE_S``) before the run is refused.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

from ..errors import ArgumentError, OutputError
from . import run_files

try:
    import fcntl
except ImportError:  # Windows: no lock (documented in docs/resume.md)
    fcntl = None

LOCK_FILENAME = ".run.lock"
ENV = "SWIFT_MCORE_RUN_LOCK"  # "<token> <lock file>": a launcher's lock, handed to its ranks
ENDED_HOLDER_GRACE_S = 5.0    # how long a lock left only to the children of an ended holder
                              # is waited for: time for them to close their inherited copy
# Folders of a run that must be its own (checkpointing.CHECKPOINT_SUBDIR: the ground floor
# cannot import it): a link there would take writes outside the folder this lock covers.
OWN_FOLDERS = ("checkpoint",)


@dataclass
class RunLock:
    path: str                # the lock file, in the folder's real path
    fd: Optional[int]        # None: held for this process by the launcher that started it
    info: dict               # pid, host, started, command, token
    created_folder: bool     # the folder did not exist before (removed again if left empty)
    locked: bool = True      # False where the file system offers no lock (nothing detected)


_held: Dict[str, RunLock] = {}  # real path of the lock file -> lock held by this process
_fork_hook = {"installed": False}


def lock_file(folder: str) -> str:
    """The lock file of ``folder``: in the folder's real path, the file's own name kept
    (a link planted as the lock file is never resolved)."""
    return os.path.join(os.path.realpath(os.path.expanduser(folder)), LOCK_FILENAME)


def hostname() -> str:
    return socket.gethostname() or "unknown-host"


def describe(info: Optional[dict]) -> str:
    """'pid 123 on host h (swift-mcore pt, started 2025-01-01T10:00:00+0000)'."""
    if not info:
        return "a process whose details cannot be read"
    what = f"{info['command']}, " if info.get("command") else ""
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} ({what}started "
            f"{info.get('started', '?')})")


def holder_ended(info: Optional[dict]) -> bool:
    """The recorded holder ran on this host and is gone: what holds the lock now is a
    process it started that still has the lock file open."""
    return bool(info) and info.get("host") == hostname() and isinstance(info.get("pid"), int) \
        and not pid_alive(info["pid"])


def refusal(folder: str, path: str, info: Optional[dict]) -> str:
    if holder_ended(info):
        return (f"--output_dir {folder} is in use by another run: {describe(info)} has ended, "
                f"but a process it started still holds its lock file {path} (`fuser -v "
                f"{path}` names it). Stop that process, or choose another --output_dir.")
    return (f"--output_dir {folder} is in use by another run: {describe(info)} holds its "
            f"lock file {path}. Wait for that run to end or stop it, or choose another "
            f"--output_dir.")


def acquire(folder: str, command: str) -> RunLock:
    """Take the lock on ``folder`` (created if missing), or raise ArgumentError naming the
    process that holds it. Re-entrant in one process."""
    folder = os.path.abspath(os.path.expanduser(folder))
    created = not os.path.isdir(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ArgumentError(f"--output_dir {folder} cannot be created ({err.strerror or err})"
                            ) from None
    path = lock_file(folder)
    if path in _held:
        return _held[path]
    check_own_files(folder)
    if fcntl is None:
        return _register(RunLock(path, None, {}, created, locked=False))
    ended_since = None  # when the lock was first seen held only for an ended holder
    while True:
        try:
            fd = run_files.open_fd(path, os.O_RDWR | os.O_CREAT)
        except OutputError as err:
            raise ArgumentError(f"--output_dir {folder}: its lock file {err}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_info(fd)
            os.close(fd)
            if _handed_over(path, info):
                return _register(RunLock(path, None, info, created))
            if holder_ended(info):
                ended_since = ended_since or time.monotonic()
                if time.monotonic() - ended_since < ENDED_HOLDER_GRACE_S:
                    time.sleep(0.05)
                    continue
            raise ArgumentError(refusal(folder, path, info)) from None
        except OSError as err:  # a file system without flock: run, but say so
            os.close(fd)
            print(f"WARNING: cannot lock {path} ({err.strerror or err}); a second run on "
                  f"{folder} would not be detected", file=sys.stderr, flush=True)
            return _register(RunLock(path, None, {}, created, locked=False))
        if _same_file(fd, path):
            break
        os.close(fd)  # a holder deleted this file while we waited for it: lock the new one
    info = {"pid": os.getpid(), "host": hostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
            "token": uuid.uuid4().hex}
    data = (json.dumps(info) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    return _register(RunLock(path, fd, info, created))


def acquire_for_run(folder: str, command: str) -> None:
    """Collective (or on one process): global rank 0 takes the lock, unless a launcher holds
    it for some ranks (SWIFT_MCORE_RUN_LOCK): those ranks check that it does. (Under
    torchrun's c10d rendezvous the launcher of node 0 need not start global rank 0.) A
    refusal is raised on every rank, so all ranks stop together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        acquire(folder, command)
        return
    handed = [None] * dist.get_world_size()
    dist.all_gather_object(handed, bool(os.environ.get(ENV)))
    error = None
    if handed[dist.get_rank()] or (not any(handed) and dist.get_rank() == 0):
        try:
            acquire(folder, command)
        except ArgumentError as err:
            error = str(err)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise ArgumentError(errors[0])


def acquire_for_cli(folder: str, command: str, launching: bool, node_rank: int = 0
                    ) -> Optional[RunLock]:
    """The CLI, before any heavy import: a launcher of node 0 takes the lock for its ranks,
    a plain one-process run for itself. A rank started by torchrun leaves it to the
    Trainer (collective, so that every rank stops on a refusal)."""
    if launching:
        return acquire(folder, command) if node_rank == 0 else None
    if os.environ.get("RANK", "0") != "0" or "LOCAL_RANK" in os.environ:
        return None
    return acquire(folder, command)


def child_env(lock: Optional[RunLock]) -> Dict[str, str]:
    """Environment for the processes a launcher starts: they find the lock held for them."""
    if lock is None or not lock.info.get("token"):
        return {}
    return {ENV: f"{lock.info['token']} {lock.path}"}


def check_own_files(folder: str) -> None:
    """Before any work: the run's records in ``folder`` are no planted links, and its
    checkpoint folder is its own (ArgumentError naming the path otherwise)."""
    try:
        run_files.check_folder(folder)
    except OutputError as err:
        raise ArgumentError(f"--output_dir {folder}: {err}") from None
    for name in OWN_FOLDERS:
        sub = os.path.join(folder, name)
        if os.path.islink(sub):
            raise ArgumentError(
                f"--output_dir {folder}: {sub} is a link (to {os.readlink(sub)}); a run keeps "
                f"its checkpoints in a folder of its own, which its lock covers (a link could "
                f"take them into another run's folder): remove the link, or choose another "
                f"--output_dir")


def holds(folder: str) -> bool:
    """Whether this process (or the launcher that started it) holds the lock on ``folder``."""
    lock = _held.get(lock_file(folder))
    return lock is not None and lock.locked


def release(folder: str) -> None:
    """Give the lock on ``folder`` up (and delete the file) if this process holds it."""
    lock = _held.pop(lock_file(folder), None)
    if lock is not None:
        _close(lock)


def release_all() -> None:
    for path in list(_held):
        _close(_held.pop(path))


# ---- internals --------------------------------------------------------------------------
def _register(lock: RunLock) -> RunLock:
    _held[lock.path] = lock
    if not _fork_hook["installed"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook["installed"] = True
    return lock


def _forget_in_child() -> None:
    """A forked child (a data loader worker, a checkpoint writer) must not keep the lock
    alive after its parent ends: close its copy of the descriptor (not LOCK_UN, which would
    release the parent's lock too)."""
    for lock in _held.values():
        if lock.fd is not None:
            try:
                os.close(lock.fd)
            except OSError:
                pass
    _held.clear()


def _close(lock: RunLock) -> None:
    if lock.fd is not None:
        try:  # while still holding it: nobody can lock it meanwhile
            run_files.unlink(lock.path, expected=os.fstat(lock.fd))
        except OSError:
            pass
        os.close(lock.fd)
    if lock.created_folder:
        try:
            os.rmdir(os.path.dirname(lock.path))  # only if the run left it empty
        except OSError:
            pass


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_info(fd: int) -> Optional[dict]:
    """The holder's JSON; retried briefly, as the holder may be writing it just now."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
            if isinstance(info, dict):
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def _handed_over(path: str, info: Optional[dict]) -> bool:
    """The lock is held by the launcher that started this process (SWIFT_MCORE_RUN_LOCK)."""
    token, _, handed_path = os.environ.get(ENV, "").partition(" ")
    return bool(token and info and info.get("token") == token and handed_path
                and lock_file(os.path.dirname(handed_path)) == path)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one we may not signal does: EPERM)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True
