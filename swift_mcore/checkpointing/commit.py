"""The commit protocol: a checkpoint is written into a hidden staging folder, then sealed with a
manifest (every file's size and CRC-32, fsynced), renamed into place and only then named by the
latest-iteration file. A folder without a valid manifest is never resumed from. Rotation and
replacement move folders out of sight before deleting them. A checkpoint's Hugging Face folder
(``iter_NNNNNNN-hf``, --save_safetensors) is staged, fsynced and renamed the same way, and is
deleted with its checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import ArgumentError
from ..input_files import first_not_regular, inside, load_json, open_regular
from ..runtime import collectives as comm
from ..runtime.run_lock import pid_alive
from .folders import fsync_dir, iter_dir_name, parse_iter_dir

MANIFEST_FILENAME = "manifest.json"
FORMAT = "swift-mcore-checkpoint"
FORMAT_VERSION = 1
_CHUNK = 16 << 20
_OWNER_RE = re.compile(r"\.tmp-[0-9a-f]+-p(\d+)-(.+)$")


# ---- staging ----------------------------------------------------------------------------
def new_token() -> str:
    """A fresh name part from os.urandom: never draws from the RNGs a checkpoint saves."""
    return uuid.uuid4().hex[:12]


HF_SUFFIX = "-hf"  # iter_0000200-hf: the Hugging Face folder of iter_0000200


def staging_dir(root: str, iteration: int, token: str, suffix: str = "") -> str:
    """``.iter_0000200.tmp-<token>-p<pid>-<host>``: named for the process that writes it
    (rank 0), so that a later save can tell a dead process's leftover from a live save.
    ``suffix`` HF_SUFFIX: the staging folder of the checkpoint's Hugging Face folder."""
    return os.path.join(root, f".{iter_dir_name(iteration)}{suffix}.tmp-{token}-"
                              f"p{os.getpid()}-{_host()}")


def staging_owner(name: str) -> Optional[Tuple[int, str]]:
    """(pid, host) of the process a staging folder's name names; None for an older name."""
    match = _OWNER_RE.search(name)
    return (int(match.group(1)), match.group(2)) if match else None


def remove_stale(root: str, keep: Sequence[str] = (), locked: bool = False) -> List[str]:
    """Delete hidden leftovers of interrupted saves, replacements and rotations; returns
    what was removed. A staging folder of a live run is never deleted: with ``locked`` (the
    caller holds the run lock on the output folder, runtime/run_lock.py) no other run can
    be writing here, and every staging folder is a leftover; without it, only one whose
    owner (in its name) was a process of this host that has ended."""
    removed = []
    for name in os.listdir(root):
        if name.startswith(".iter_") and any(tag in name for tag in
                                             (".tmp-", ".old-", ".deleting-")):
            path = os.path.join(root, name)
            if path in keep or not os.path.isdir(path):
                continue
            if ".tmp-" in name and not _staging_is_leftover(name, locked):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _staging_is_leftover(name: str, locked: bool) -> bool:
    if locked:
        return True
    owner = staging_owner(name)
    return owner is not None and owner[1] == _host() and (
        owner[0] == os.getpid() or not pid_alive(owner[0]))


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname() or "host")[:64]


# ---- manifest ---------------------------------------------------------------------------
def list_files(folder: str) -> List[str]:
    """Every regular file under ``folder``, as sorted relative paths."""
    found = []
    for base, _dirs, files in os.walk(folder):
        for name in files:
            found.append(os.path.relpath(os.path.join(base, name), folder))
    return sorted(found)


def checksum(path: str, fsync: bool = False) -> Tuple[int, int]:
    """(size, CRC-32) of one file; with ``fsync`` its data is also forced to disk."""
    crc, size = 0, 0
    with open_regular(path, "rb") as fh:  # a FIFO swapped in would block a plain open
        while True:
            block = fh.read(_CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
            size += len(block)
        if fsync:
            os.fsync(fh.fileno())
    return size, crc


def seal(folder: str, extra: Optional[dict] = None) -> Dict[str, dict]:
    """Collective: checksum (and fsync) every file, the work shared over ranks; rank 0 then
    writes the manifest and fsyncs it and the folder. Returns the file table. A failure on
    any rank (a full disk, say) is raised on every rank."""
    files = comm.decide(list_files, folder)
    mine = files[comm.rank()::comm.world_size()]
    part: Dict[str, Tuple[int, int]] = {}

    def checksum_mine():
        for rel in mine:
            part[rel] = checksum(os.path.join(folder, rel), fsync=True)

    comm.raise_if_any(comm.attempt(checksum_mine))
    table: Dict[str, dict] = {}
    for piece in comm.all_gather(part):
        for rel, (size, crc) in piece.items():
            table[rel] = {"size": size, "crc32": crc}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION,
                "files": dict(sorted(table.items())), **(extra or {})}
    comm.decide(write_manifest, folder, manifest)
    return table


def write_manifest(folder: str, manifest: dict) -> None:
    path = os.path.join(folder, MANIFEST_FILENAME)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(folder)


def read_manifest(folder: str) -> Tuple[Optional[dict], Optional[str]]:
    path = os.path.join(folder, MANIFEST_FILENAME)
    if not os.path.lexists(path):
        return None, f"it has no {MANIFEST_FILENAME} (the save did not finish)"
    try:  # a regular file, its size and nesting bounded (input_files)
        manifest = load_json(path, MANIFEST_FILENAME)
    except ArgumentError as err:
        return None, f"its {err}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None, f"its {MANIFEST_FILENAME} is not a swift-mcore checkpoint manifest"
    if manifest.get("version", 0) > FORMAT_VERSION:
        return None, (f"it was written in checkpoint format version {manifest['version']}; "
                      f"this swift-mcore reads up to {FORMAT_VERSION}")
    if not isinstance(manifest.get("files"), dict):
        return None, f"its {MANIFEST_FILENAME} lacks the file table"
    for rel, entry in manifest["files"].items():
        try:  # every name stays inside the folder: no ../, no absolute path
            inside(folder, rel, f"its {MANIFEST_FILENAME}")
        except ArgumentError as err:
            return None, str(err)
        if not isinstance(entry, dict) or not all(
                type(entry.get(key)) is int and entry[key] >= 0 for key in ("size", "crc32")):
            return None, (f"its {MANIFEST_FILENAME} records {rel!r:.200} without a size and "
                          f"crc32 (non-negative integers)")
    return manifest, None


def check_complete(folder: str) -> Optional[str]:
    """None if ``folder`` is a sealed checkpoint whose files all exist with their recorded
    sizes, and which holds nothing but regular files and folders (cheap: stat only; a FIFO
    or device would block or never end whatever later opens it); else why not."""
    if not os.path.isdir(folder):
        return "it does not exist"
    manifest, problem = read_manifest(folder)
    if problem:
        return problem
    problem = first_not_regular(folder)
    if problem:
        return problem
    for rel, entry in manifest["files"].items():
        path = os.path.join(folder, rel)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{rel} is missing"
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest records {entry['size']} (truncated?)"
    return None


def verify_checksums(folder: str) -> None:
    """Collective: every file's CRC-32 against the manifest, the work shared over ranks.
    Raises CheckpointError on every rank if any file differs."""
    manifest, problem = read_manifest(folder)
    error = None
    if problem:
        error = f"checkpoint {folder} cannot be used: {problem}"
    else:
        files = sorted(manifest["files"])
        for rel in files[comm.rank()::comm.world_size()]:
            entry = manifest["files"][rel]
            try:
                size, crc = checksum(os.path.join(folder, rel))
            except (OSError, ArgumentError) as err:
                error = f"checkpoint {folder} cannot be used: {rel} cannot be read ({err})"
                break
            if (size, crc) != (entry["size"], entry["crc32"]):
                error = (f"checkpoint {folder} is corrupted: {rel} does not match its "
                         f"checksum in {MANIFEST_FILENAME} (size {size} vs {entry['size']}, "
                         f"crc32 {crc:08x} vs {entry['crc32']:08x})")
                break
    comm.raise_if_any(error)


# ---- publishing, listing, rotation ------------------------------------------------------
def publish(staging: str, final: str) -> None:
    """Rename the sealed staging folder to its final name (rank 0). An existing folder of
    that name (a re-save of the same iteration) is moved aside first and then deleted."""
    root = os.path.dirname(final)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(root, f".{os.path.basename(final)}.old-{new_token()}")
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(root)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def sync_tree(folder: str) -> None:
    """fsync every file under ``folder`` and the folders themselves (before a rename makes
    it visible: a folder written by another process, such as an export)."""
    for base, _dirs, names in os.walk(folder):
        for name in names:
            with open(os.path.join(base, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(base)


def remove_folder(path: str) -> bool:
    """Move ``path`` out of sight (a hidden ``.deleting-`` name), then delete it; False if
    it did not exist. A crash in between leaves only a hidden leftover (remove_stale)."""
    if not os.path.isdir(path):
        return False
    root = os.path.dirname(path)
    aside = os.path.join(root, f".{os.path.basename(path)}.deleting-{new_token()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return True


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(iteration, folder) of every visible iter_* folder, oldest first, sealed or not."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        iteration = parse_iter_dir(name)
        path = os.path.join(root, name)
        if iteration is not None and os.path.isdir(path):
            found.append((iteration, path))
    return sorted(found)


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """The sealed, intact checkpoints under ``root``, oldest first."""
    return [(it, path) for it, path in list_checkpoints(root) if check_complete(path) is None]


def rotate(root: str, keep: int, protect: Optional[int], newest: int,
           also_protect: Sequence[Optional[int]] = ()) -> List[str]:
    """Delete sealed checkpoints beyond the newest ``keep`` up to iteration ``newest`` (the
    one just saved), never the one numbered ``protect`` (the latest-iteration file's) nor those in
    ``also_protect`` (the best checkpoint). A checkpoint's Hugging Face folder goes with
    it. Folders of a later iteration (an abandoned branch, left by a run that resumed from
    an older checkpoint) and unsealed folders are left alone. Returns what was removed."""
    complete = [(it, p) for it, p in complete_checkpoints(root) if it <= newest]
    kept = {it for it, _ in complete[-keep:]} if keep > 0 else set()
    protected = {protect, *also_protect} - {None}
    removed = []
    for iteration, path in complete:
        if iteration in kept or iteration in protected:
            continue
        remove_folder(path)
        removed.append(path)
        if remove_folder(path + HF_SUFFIX):
            removed.append(path + HF_SUFFIX)
    if removed:
        fsync_dir(root)
    return removed
