"""The embedded default corpus: the running Python's standard-library sources (on every machine)."""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from functools import lru_cache
from typing import Iterator, List, Tuple

# Large enough to train a 4096-token BPE and a few epochs of a tiny model, small enough that
# training the tokenizer and tokenizing the corpus both take about a second on two cores.
MAX_CORPUS_BYTES = 6_000_000
# A handful of generated modules (pydoc topics, unicode tables) are data, not code; they would
# crowd out dozens of ordinary modules.
MAX_FILE_BYTES = 256_000
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idle_test"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _skip_dir(name: str) -> bool:
    return name in _SKIPPED_DIRS or name.startswith(("test", "config-"))


@lru_cache(maxsize=None)
def corpus_files(root: str | None = None, max_bytes: int = MAX_CORPUS_BYTES
                 ) -> Tuple[Tuple[str, int], ...]:
    """(relative path, size) of the selected files, in sorted path order.

    Files are taken in sorted order while they fit under ``max_bytes``; the selection depends
    only on the file tree, never on walk order or timestamps.
    """
    root = root or stdlib_root()
    found: List[Tuple[str, int]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _skip_dir(d)]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"),
                              os.path.getsize(path)))
    chosen, total = [], 0
    for rel, size in sorted(found):
        if size <= MAX_FILE_BYTES and total + size <= max_bytes:
            chosen.append((rel, size))
            total += size
    if not chosen:
        raise RuntimeError(f"no Python sources found under {root} for the embedded corpus")
    return tuple(chosen)


def _read(root: str, rel: str) -> bytes:
    with open(os.path.join(root, rel), "rb") as fh:
        return fh.read()


def iter_documents(root: str | None = None) -> Iterator[str]:
    """One document per source file, decoded leniently so odd bytes never stop a run."""
    root = root or stdlib_root()
    for rel, _ in corpus_files(root):
        yield _read(root, rel).decode("utf-8", errors="replace")


@lru_cache(maxsize=None)
def fingerprint(root: str | None = None) -> str:
    """sha256 over names and bytes of the selection.

    Hashing the content (a few MB) is cheap enough to do at every start, and
    unlike (size, mtime) it is identical on two machines with the same Python.
    """
    root = root or stdlib_root()
    digest = hashlib.sha256(f"stdlib-corpus/v1 max={MAX_CORPUS_BYTES}".encode())
    for rel, _ in corpus_files(root):
        data = _read(root, rel)
        digest.update(f"\0{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def describe() -> str:
    files = corpus_files()
    return (f"Python {sys.version.split()[0]} standard library: {len(files)} files, "
            f"{sum(s for _, s in files) / 1e6:.1f} MB")
