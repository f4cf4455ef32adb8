"""Raw text inputs (jsonl, json, parquet, csv, txt, saved `datasets` folders) found and read.

Reading goes through the Hugging Face `datasets` library, one file at a time, so every error
names its file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import ArgumentError
from ..input_files import (check_json_lines, check_regular, first_not_regular, inside,
                           load_json)

# suffix -> the `datasets` builder that reads it. A .txt file holds one document per line.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
            ".txt": "text"}
SAVED = "saved"  # Source.kind of a folder written by Dataset(Dict).save_to_disk
ACCEPTED = " ".join(BUILDERS) + " files, folders of them, glob patterns, or a folder saved " \
                                "by datasets' save_to_disk"
# Part of every cache key built from sources: change it whenever reading changes what a
# source yields (another builder, another rule for which rows are documents).
READER_VERSION = 2


@dataclass(frozen=True)
class Source:
    path: str
    kind: str  # a `datasets` builder name, or SAVED

    def describe(self) -> str:
        return "a saved datasets folder" if self.kind == SAVED else f"{self.kind} data"


def is_saved_dataset(folder: str) -> bool:
    """save_to_disk writes state.json (a Dataset) or dataset_dict.json (a DatasetDict)."""
    return any(os.path.lexists(os.path.join(folder, name))
               for name in ("state.json", "dataset_dict.json"))


def check_saved(path: str, flag: str) -> None:
    """A saved datasets folder holds regular files only (a FIFO would block `datasets`, a
    device never end), its JSON files are bounded, and the files and splits they name stay
    inside it; else an ArgumentError naming the file."""
    problem = first_not_regular(path)
    if problem:
        raise ArgumentError(f"{flag} {path}: {problem}; swift-mcore reads input only from "
                            f"regular files")
    for base, _dirs, names in os.walk(path):
        for name in sorted(n for n in names if n.endswith(".json")):
            file = os.path.join(base, name)
            document = load_json(file, f"{flag} {file}")
            if name == "state.json" and isinstance(document, dict):
                for entry in document.get("_data_files") or []:
                    inside(base, entry.get("filename") if isinstance(entry, dict) else entry,
                           f"{flag} {file}")
            elif name == "dataset_dict.json" and isinstance(document, dict):
                for split in document.get("splits") or []:
                    inside(base, split, f"{flag} {file}")


def _source(path: str, flag: str) -> Source:
    if os.path.isdir(path):
        if is_saved_dataset(path):
            check_saved(path, flag)
            return Source(path, SAVED)
        raise ArgumentError(f"{flag} {path}: a folder that is not a saved datasets folder "
                            f"(no state.json or dataset_dict.json); accepted: {ACCEPTED}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in BUILDERS:
        raise ArgumentError(f"{flag} {path}: unsupported file type '{suffix or '(none)'}'; "
                            f"accepted: {ACCEPTED}")
    # a FIFO or device named data.jsonl would block the reader or never end
    check_regular(path, f"{flag} {path}")
    if os.path.getsize(path) == 0:
        raise ArgumentError(f"{flag} {path}: is empty (0 bytes)")
    return Source(path, BUILDERS[suffix])


def _walk(folder: str) -> List[str]:
    """Supported files and saved datasets folders under ``folder``, sorted by path. A saved
    folder is one input: its own .json files (state, info) are not documents."""
    found = []
    for base, dirs, files in os.walk(folder):
        # Hidden entries (.git, .ipynb_checkpoints) are skipped, as a shell glob would.
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files = [f for f in files if not f.startswith(".")]
        for name in list(dirs):
            if is_saved_dataset(os.path.join(base, name)):
                found.append(os.path.join(base, name))
                dirs.remove(name)
        found.extend(os.path.join(base, f) for f in files
                     if os.path.splitext(f)[1].lower() in BUILDERS)
    return sorted(found)


def expand_inputs(patterns: Sequence[str], flag: str = "--input") -> List[Source]:
    """The sources named by paths, folders (a saved datasets folder, or the supported files
    under it) and glob patterns, in the order given; each pattern's matches sorted."""
    if not patterns:
        raise ArgumentError(f"{flag} is empty; give files, folders or glob patterns ({ACCEPTED})")
    sources: List[Source] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if os.path.isdir(pattern) and not is_saved_dataset(pattern):
            matches = _walk(pattern)
            if not matches:
                raise ArgumentError(f"{flag} {pattern}: the folder holds no {' '.join(BUILDERS)} "
                                    f"files and is not a saved datasets folder")
        elif glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise ArgumentError(f"{flag} {pattern}: no file matches the pattern")
        elif os.path.exists(pattern):
            matches = [pattern]
        else:
            raise ArgumentError(f"{flag} {pattern}: no such file or folder (accepted: "
                                f"{ACCEPTED})")
        sources.extend(_source(path, flag) for path in matches)
    return sources


# ---- reading ------------------------------------------------------------------------------

def _open_saved(source: Source, flag: str):
    import datasets

    data = datasets.load_from_disk(source.path)
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ArgumentError(f"{flag} {source.path}: a saved DatasetDict without a 'train' "
                                f"split (it has {', '.join(data) or 'none'}); save the split "
                                f"to tokenize on its own")
        data = data["train"]
    return data


def _open(source: Source, flag: str):
    """A `datasets` Dataset (saved folders: memory-mapped) or IterableDataset (files:
    streamed, so nothing is copied into the datasets cache)."""
    if source.kind == SAVED:
        return _open_saved(source, flag)
    import datasets

    # The JSON loader logs a parse error before raising it; ours names the file already.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    return datasets.load_dataset(source.kind, data_files=[os.path.abspath(source.path)],
                                 split="train", streaming=True)


def _unreadable(source: Source, flag: str, err: Exception, rows_read: int = 0
                ) -> ArgumentError:
    text = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__
    if source.kind == "json":
        where = json_error_line(source.path, skip_rows=rows_read) or (
            rows_read and json_error_line(source.path))
        if where:
            return ArgumentError(f"{flag} {source.path}: cannot be read as json data (line "
                                 f"{where[0]}: {where[1]})")
        # pyarrow counts rows from the start of each block it parses, not of the file
        reason = re.sub(r" in row \d+", "", reason)
    return ArgumentError(f"{flag} {source.path}: cannot be read as {source.describe()} "
                         f"({reason})")


def json_error_line(path: str, skip_rows: int = 0) -> Optional[Tuple[int, str]]:
    """(1-based line number in the whole file, what is wrong) of the first line of a JSON
    lines file that is not valid JSON; for a file holding one JSON document (it starts
    with '['), where that document breaks. None if no such line is found. Runs only after
    a read failed; the first ``skip_rows`` non-empty lines (read fine already) are only
    counted, not parsed."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
            if head.startswith(b"["):
                fh.seek(0)
                try:
                    json.loads(fh.read())
                except (ValueError, RecursionError) as err:
                    return _decode_error(err)
                return None
            fh.seek(0)
            rows = 0
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                rows += 1
                if rows <= skip_rows:
                    continue
                try:
                    json.loads(line)
                except (ValueError, RecursionError) as err:
                    return number, _decode_error(err)[1]
    except OSError:
        return None
    return None


def _decode_error(err: ValueError) -> Tuple[int, str]:
    if isinstance(err, json.JSONDecodeError):
        return err.lineno, f"{err.msg} at column {err.colno}"
    return 1, str(err).splitlines()[0][:200] if str(err) else type(err).__name__


def read_batches(source: Source, flag: str = "--input",
                 batch_size: int = 512) -> Iterator[Dict[str, list]]:
    """Batches of rows of ``source`` ({column: values}), in file order. A file that cannot
    be read is an ArgumentError naming it (problems of the caller's own are not caught)."""
    rows_read = 0
    if source.kind == "json":
        # before a parser recurses into it: deep nesting exhausts its stack
        check_json_lines(source.path, f"{flag} {source.path}")
    try:
        rows = _open(source, flag).iter(batch_size=batch_size)
        while True:
            try:
                batch = next(rows)
            except StopIteration:
                return
            rows_read += len(next(iter(batch.values()), ()))
            yield batch
    except ArgumentError:
        raise
    except StopIteration:  # raised inside datasets when a file has no record to infer from
        raise ArgumentError(f"{flag} {source.path}: is empty (no rows)") from None
    except Exception as err:  # datasets and pyarrow raise many types for unreadable input
        raise _unreadable(source, flag, err, rows_read) from err


def iter_texts(source: Source, text_key: str, flag: str = "--input",
               batch_size: int = 512) -> Iterator[List[Optional[str]]]:
    """Batches of the ``text_key`` column of ``source``, in file order; None for a missing
    value. Every problem is an ArgumentError naming the file."""
    for batch in read_batches(source, flag, batch_size):
        if text_key not in batch:
            raise _no_column(source, text_key, flag, list(batch))
        texts = batch[text_key]
        for value in texts:
            if value is not None and not isinstance(value, str):
                raise ArgumentError(
                    f"{flag} {source.path}: column '{text_key}' holds "
                    f"{type(value).__name__} values, not text; choose the text column "
                    f"with --text_key")
        yield texts


def _no_column(source: Source, text_key: str, flag: str, columns) -> ArgumentError:
    shown = ", ".join(repr(c) for c in columns) or "none"
    return ArgumentError(f"{flag} {source.path}: no '{text_key}' column (it has {shown}); "
                         f"choose the text column with --text_key")


def probe(source: Source, text_key: str, flag: str = "--input") -> None:
    """Open ``source`` and read its first rows: a missing column, an unreadable or an empty
    file is reported before any work starts rather than after the files before it."""
    first = next(iter_texts(source, text_key, flag, batch_size=8), None)
    if first is None:
        raise ArgumentError(f"{flag} {source.path}: is empty (no rows)")


# ---- identity -----------------------------------------------------------------------------

def _files_of(source: Source) -> List[str]:
    if source.kind != SAVED:
        return [source.path]
    # The cache-*.arrow files `datasets` leaves next to a loaded dataset are not its content.
    return sorted(p for p in glob.glob(os.path.join(source.path, "**", "*"), recursive=True)
                  if os.path.isfile(p) and not os.path.basename(p).startswith("cache-"))


def content_fingerprint(sources: Sequence[Source]) -> str:
    """sha256 over every source's kind and bytes, in order; paths and timestamps play no part,
    so copies and touched files hit the same cache, and any edit misses it. Remembered per
    process while no file changes (size and mtime), so asking twice reads the data once."""
    stamp = tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns)
                  for s in sources for p in _files_of(s))
    return _content_fingerprint(tuple(sources), stamp)


@lru_cache(maxsize=32)
def _content_fingerprint(sources: Tuple[Source, ...], stamp) -> str:
    digest = hashlib.sha256(f"sources v{READER_VERSION}".encode())
    for source in sources:
        digest.update(f"\0{source.kind}\0".encode())
        for path in _files_of(source):
            rel = os.path.relpath(path, source.path) if source.kind == SAVED else ""
            digest.update(f"{rel}\0{os.path.getsize(path)}\0".encode())
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def total_bytes(sources: Sequence[Source]) -> int:
    return sum(os.path.getsize(p) for s in sources for p in _files_of(s))
