"""Checks of the paths a command will write, before any work: a folder flag that names a
file (or lies under one), an output file that is a folder. Each is an ArgumentError naming
the flag, where the OS would otherwise raise halfway through (after tokenizing or training).
"""

from __future__ import annotations

import os
from typing import Sequence

from ..errors import ArgumentError


# What pt and sft write under --output_dir (a file or folder of the other kind is refused).
OUTPUT_FOLDERS = ("checkpoint", "runs", "data_cache")
OUTPUT_FILES = ("metrics.jsonl", "sample_ids.jsonl")


def _first_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _creatable(full: str) -> str:
    """Why ``full`` (absolute) cannot be created or written, or ''."""
    existing = _first_existing(full)
    if not os.path.isdir(existing):
        return f"{existing} is a file, so nothing can be created under it"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return ""


def check_output_dir(path: str, flag: str = "--output_dir", folders: Sequence[str] = (),
                     files: Sequence[str] = ()) -> None:
    """``path`` is a folder, or can be created as one: no file of that name and no file
    among its parents, and writable. ``folders``/``files``: names inside it that the
    command writes as folders/files; one of the other kind is refused too."""
    full = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.lexists(full) and not os.path.isdir(full):
        raise ArgumentError(f"{flag} {path} is a file, not a folder; give a folder (it is "
                            f"created if missing)")
    problem = _creatable(full)
    if problem:
        raise ArgumentError(f"{flag} {path}: {problem}")
    for name in folders:
        inner = os.path.join(full, name)
        if os.path.lexists(inner) and not os.path.isdir(inner):
            raise ArgumentError(f"{flag} {path}: {inner} is a file, but it is where the "
                                f"{name} folder goes; move it away")
    for name in files:
        inner = os.path.join(full, name)
        if os.path.isdir(inner):
            raise ArgumentError(f"{flag} {path}: {inner} is a folder, but it is where the "
                                f"{name} file goes; move it away")


def check_run_outputs(args) -> None:
    """pt and sft: --output_dir and --data_cache_path, checked by the command line before a
    run starts (not in validate: export and infer rebuild a saved run's arguments, whose
    output_dir need not exist on this machine)."""
    check_output_dir(args.logging.output_dir, "--output_dir", folders=OUTPUT_FOLDERS,
                     files=OUTPUT_FILES)
    if args.data.data_cache_path:
        check_output_dir(args.data.data_cache_path, "--data_cache_path")


def check_output_files(paths: Sequence[str], flag: str) -> None:
    """Files a command will (re)write: none is a folder, and their folder can be made."""
    for path in paths:
        full = os.path.abspath(os.path.expanduser(str(path)))
        if os.path.isdir(full):
            raise ArgumentError(f"{flag}: {path} is a folder, but it is a file this command "
                                f"writes; move it away or choose another {flag}")
        problem = _creatable(os.path.dirname(full))
        if problem:
            raise ArgumentError(f"{flag}: {path} cannot be written: {problem}")
