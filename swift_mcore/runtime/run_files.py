"""Files swift-mcore creates, appends to or removes in a run folder (or at an output path the
user gives), never through a link planted there.

Anyone who can write a shared run folder can plant ``metrics.jsonl -> ~/.bashrc`` or a hard
link to a file of the user who trains there. So a file is

- appended to or created with ``O_NOFOLLOW`` (a symbolic link is refused, never followed),
  and kept only if it is a regular file with one link (a hard link to a file elsewhere, a
  FIFO or a device is refused, before anything is written into it);
- removed by its name in its folder (``unlink(name, dir_fd=...)``), never by a resolved path,
  and only when it is still the file that was opened;
- replaced through a new temporary sibling and a rename (atomic_write.py), which replaces
  the name, never the file a link at that name points to.

A refusal is an ``OutputError`` (errors.py) naming the path, the same one line for every
command. A write that fails (a full disk) leaves no half-written record: the file is cut
back to what it held, and the error names the file and the cause.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterable, Optional

from ..errors import OutputError

# The records a run keeps directly in its --output_dir (the checkpoint folder is apart).
METRICS = "metrics.jsonl"
SAMPLE_IDS = "sample_ids.jsonl"
ELASTIC_FAILURES = "elastic_failures.jsonl"
TRACKER_IDS = "trackers.json"
PLOT = "loss.png"
RUN_RECORDS = (METRICS, SAMPLE_IDS, ELASTIC_FAILURES, TRACKER_IDS, PLOT)

_OPEN_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def what_is_wrong(st: os.stat_result) -> Optional[str]:
    """Why a file with this (lstat) status must not be written by a run; None if it may."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_nlink != 1:
        return f"is a hard link ({st.st_nlink} names for one file)"
    return None


def refusal(path: str, problem: str) -> str:
    return (f"{path} {problem}; swift-mcore writes its run files only as regular files of "
            f"their own and never follows a link planted in a run folder: remove {path}, or "
            f"choose another output folder")


def check(path: str) -> None:
    """Raise OutputError when ``path`` exists and may not be written as a run file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise OutputError(f"{path} cannot be examined ({err.strerror or err})") from None
    problem = what_is_wrong(st)
    if problem:
        raise OutputError(refusal(path, problem))


def check_folder(folder: str, names: Iterable[str] = RUN_RECORDS) -> None:
    """Before a run writes anything: none of its records in ``folder`` is a planted link."""
    for name in names:
        check(os.path.join(folder, name))


def check_replaceable(path: str, magic: bytes, kind: str, flag: str = "") -> None:
    """An output path a command may write: a new name in an existing folder, or a file it wrote
    before (a regular file with one link that starts with ``magic``, ``kind``). Any other file (a
    run's records, a checkpoint folder's latest-iteration file, a link) is refused: OutputError
    naming the path (after ``flag``, the option that gave it)."""
    who = f"{flag} {path}" if flag else path
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"{who}: its folder {folder} does not exist")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise OutputError(f"{who} cannot be examined ({err.strerror or err})") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{who} is a folder; give a file name for {kind}")
    problem = what_is_wrong(st)
    if problem is None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(magic))
        except OSError as err:
            problem = f"cannot be read ({err.strerror or err})"
        else:
            if head != magic:
                problem = f"exists and is not {kind}"
    if problem:
        raise OutputError(f"{who} {problem}; it is written only as a new file or over {kind} "
                          f"written before, never over another file: choose another name")


def open_fd(path: str, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a run file without following a link; the descriptor of a regular file
    with one link, or OutputError naming the path."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OutputError(refusal(path, "is a symbolic link")) from None
        if err.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK): not a file
            raise OutputError(refusal(path, "is not a regular file")) from None
        raise OutputError(f"{path} cannot be opened for writing ({err.strerror or err})"
                          ) from None
    try:
        problem = what_is_wrong(os.fstat(fd))
        if problem:
            raise OutputError(refusal(path, problem))
        if _OPEN_FLAGS & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Record:
    """A run record open for appending whole lines (utf-8), created if missing."""

    def __init__(self, path: str):
        self.path = path
        self.fd: Optional[int] = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def append(self, text: str) -> None:
        """``text`` (whole lines) appended in one write, or nothing: a failed write (a full
        disk) is cut back off and raised as OutputError naming the file."""
        data = text.encode("utf-8")
        start = os.fstat(self.fd).st_size
        try:
            written = os.write(self.fd, data)
            if written != len(data):  # a short write: the disk filled up under it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise OutputError(write_failure(self.path, err)) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def append_line(path: str, text: str) -> None:
    """Open ``path`` as a Record, append ``text`` whole, close."""
    record = Record(path)
    try:
        record.append(text)
    finally:
        record.close()


def write_failure(path: str, err: OSError, left: str = "nothing half-written was left in it",
                  then: str = "then continue with --resume") -> str:
    """One line: which file, why (a full disk said as such), what was left, what to do."""
    cause = err.strerror or str(err)
    if err.errno in FULL_DISK:
        return (f"writing {path} failed: out of disk space ({cause}); {left}. Free some "
                f"space, {then}")
    return f"writing {path} failed ({cause}); {left}"


def unlink(path: str, expected: Optional[os.stat_result] = None) -> bool:
    """Remove ``path`` by its name in its folder (a link there is removed itself, never what
    it points to). ``expected``: only if the name still is that file (same device and
    inode). True if removed."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                         | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if expected is not None:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
                return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(dir_fd)
