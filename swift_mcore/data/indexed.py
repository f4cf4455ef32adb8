"""megatron's .bin/.idx files: written atomically, and checked whole before a run reads them.

Writing goes through megatron's IndexedDatasetBuilder (the pair stays byte-identical to
Megatron-LM's); alongside, PREFIX.hash.json records the sha256 of the .bin, computed while
it is written. The checks (header, sizes, offsets, token range) and the content hash used
by the data fingerprint read the .idx and the .bin without importing megatron.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import struct
from functools import lru_cache
from typing import Iterable, Optional, Tuple

import numpy as np

from ..errors import ArgumentError
from ..input_files import check_regular, open_regular
from ..atomic_write import temp_name, write_atomic

BATCH_DOCUMENTS = 256  # enough per encode_batch call to keep every core busy

# megatron.core.datasets.indexed_dataset's layout (version 1): the header, then the
# sequence lengths (int32), the sequence pointers (int64, byte offsets into the .bin) and
# the document indices (int64). Restated here so a check costs no megatron/torch import.
_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
           7: np.float32, 8: np.uint16}
_INTEGER_CODES = {1, 2, 3, 4, 5, 8}


def token_dtype(vocab_size: int):
    """megatron's choice: uint16 below 65500 token ids, int32 above."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def replaceable(prefix: str, flag: str) -> None:
    """ArgumentError unless writing ``prefix``.bin/.idx replaces nothing but an indexed pair
    (regular files of one link each, the .idx starting with megatron's header): a file of
    another kind, or one reached through a link, is never overwritten."""
    from ..runtime.run_files import what_is_wrong

    names = [prefix + ".bin", prefix + ".idx"]
    present = [name for name in names if os.path.lexists(name)]
    for name in present:
        problem = what_is_wrong(os.lstat(name))
        if problem:
            raise ArgumentError(f"{flag}: {name} {problem}; it would be replaced, so it must be "
                                f"a .bin/.idx file of its own: remove it or choose another {flag}")
    if not present:
        return
    header = b""
    if os.path.exists(names[1]):
        with open_regular(names[1], "rb", f"{flag} {names[1]}") as fh:
            header = fh.read(len(_HEADER))
    if len(present) != 2 or header != _HEADER:
        raise ArgumentError(f"{flag}: {', '.join(present)} exist(s) and are not a megatron "
                            f".bin/.idx pair; writing would replace files this command did not "
                            f"write: remove them or choose another {flag}")


class _HashingFile:
    """The builder's .bin file, hashing exactly the bytes megatron writes to it."""

    def __init__(self, fh):
        self._fh = fh
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)


class IndexedWriter:
    """``with IndexedWriter(prefix, dtype) as w: w.add_documents(...); w.commit()``.

    Both files are written under a temporary prefix and renamed into place, .idx last: the
    .idx is the commit mark, so a crash leaves at worst a lone .bin, which readers treat as
    missing, never a half-written pair. Leaving the block without ``commit()`` (an error, a
    KeyboardInterrupt) removes the temporary files and leaves any old pair untouched. The
    .bin's sha256 is computed as it is written and recorded in PREFIX.hash.json (before the
    .idx is renamed, so a committed pair always has its record).
    """

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = dtype
        self.documents = 0
        self.tokens = 0
        self._tmp = None
        self._builder = None

    def __enter__(self) -> "IndexedWriter":
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
        self._tmp = temp_name(self.prefix)
        self._builder = IndexedDatasetBuilder(self._tmp + ".bin", dtype=self.dtype)
        self._builder.data_file = _HashingFile(self._builder.data_file)
        return self

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given back to back in ``tokens``, one length each; one sequence each."""
        start = 0
        for length in lengths.tolist():
            self._builder.add_document(tokens[start:start + length], [length])
            start += length
        self.documents += len(lengths)
        self.tokens += start

    def commit(self) -> None:
        if self.documents == 0:
            raise ValueError(f"no non-empty documents to write to {self.prefix}")
        self._builder.finalize(self._tmp + ".idx")
        # Uncommit the old pair (and its hash record) before its .bin is replaced.
        for old in (self.prefix + ".idx", self.prefix + HASH_SUFFIX):
            if os.path.exists(old):
                os.remove(old)
        os.replace(self._tmp + ".bin", self.prefix + ".bin")
        write_bin_hash(self.prefix, self._builder.data_file.sha256.hexdigest())
        os.replace(self._tmp + ".idx", self.prefix + ".idx")

    def __exit__(self, *exc) -> None:
        self._builder.data_file.close()
        for leftover in (self._tmp + ".bin", self._tmp + ".idx"):
            if os.path.exists(leftover):
                os.remove(leftover)


def write_indexed(documents: Iterable[str], tokenizer, prefix: str) -> dict:
    """Tokenize ``documents`` (an EOD after each, empty ones skipped) into ``prefix``.bin/.idx
    in this process (the tokenizer's own threads use every core); returns counts."""
    dtype = token_dtype(tokenizer.vocab_size)
    with IndexedWriter(prefix, dtype) as writer:
        docs = iter(documents)
        while batch := list(itertools.islice(docs, BATCH_DOCUMENTS)):
            ids = [row + [tokenizer.eod] for row in tokenizer.encode_batch(batch) if row]
            lengths = np.array([len(row) for row in ids], dtype=np.int64)
            writer.add_documents(np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype,
                                             count=int(lengths.sum())), lengths)
        writer.commit()
    return {"documents": writer.documents, "tokens": writer.tokens}


# ---- what the .bin holds: its recorded sha256, and sampled blocks ------------------------

HASH_SUFFIX = ".hash.json"
# The sampled hash reads SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at fixed offsets (the
# first and the last block, the others evenly spaced between), or the whole file if it is
# no larger: 64 MiB at most, whatever the size of the .bin.
SAMPLE_BLOCK = 1 << 20
SAMPLE_BLOCKS = 64
_SHA256 = re.compile(r"[0-9a-f]{64}")
logger = logging.getLogger("swift_mcore")


def write_bin_hash(prefix: str, sha256: str) -> None:
    """Record ``sha256`` as the content of PREFIX.bin as it is now (its size and mtime)."""
    stat = os.stat(prefix + ".bin")
    write_atomic(prefix + HASH_SUFFIX, json.dumps({
        "file": os.path.basename(prefix) + ".bin", "bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns, "sha256": sha256}, indent=1) + "\n")


def record_bin_hash(prefix: str) -> str:
    """Hash an existing PREFIX.bin in full (one pass) and record it in PREFIX.hash.json: for
    a prefix made by another tool, so that its fingerprint covers every token."""
    path = prefix + ".bin"
    before = os.stat(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            digest.update(chunk)
    after = os.stat(path)
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise ArgumentError(f"{path} changed while it was being hashed; try again")
    write_bin_hash(prefix, digest.hexdigest())
    return digest.hexdigest()


def sampled_bin_hash(path: str, size: int, block: int = SAMPLE_BLOCK,
                     blocks: int = SAMPLE_BLOCKS) -> str:
    """sha256 of the size and of ``blocks`` blocks at fixed offsets (the whole file if it
    fits them). Misses an edit that falls between the blocks of a larger file."""
    digest = hashlib.sha256(f"sampled size={size} block={block} blocks={blocks}\n".encode())
    with open(path, "rb") as fh:
        if size <= block * blocks:
            for chunk in iter(lambda: fh.read(16 << 20), b""):
                digest.update(chunk)
        else:
            for i in range(blocks):
                fh.seek(i * (size - block) // (blocks - 1))
                digest.update(fh.read(block))
    return digest.hexdigest()


def _recorded_sha256(prefix: str, size: int, mtime_ns: int) -> Optional[str]:
    """The sha256 in PREFIX.hash.json if it still describes the .bin (same size and mtime),
    else None: a stale or unreadable record is never trusted."""
    path = prefix + HASH_SUFFIX
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path, "r") as fh:
            record = json.load(fh)
    except (OSError, ValueError, RecursionError) as err:
        _warn(f"{path} cannot be read ({err}); the data fingerprint covers sampled blocks "
              f"of {prefix}.bin only")
        return None
    sha256 = record.get("sha256") if isinstance(record, dict) else None
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        _warn(f"{path} holds no sha256; the data fingerprint covers sampled blocks of "
              f"{prefix}.bin only")
        return None
    if (record.get("bytes"), record.get("mtime_ns")) != (size, mtime_ns):
        _warn(f"{prefix}.bin changed after {path} was written (its size or modification time "
              f"differs), so the recorded sha256 is not used and the data fingerprint covers "
              f"sampled blocks only; re-run `swift-mcore preprocess` (or "
              f"swift_mcore.data.indexed.record_bin_hash) to cover every token again")
        return None
    return sha256


@lru_cache(maxsize=None)
def _warn(message: str) -> None:  # once per message, from the first rank only
    if os.environ.get("RANK", "0") == "0":
        logger.warning("warning: %s", message)


def bin_content(prefix: str) -> Tuple[str, Optional[str]]:
    """(sampled hash of PREFIX.bin, its full sha256 from a valid PREFIX.hash.json or None)."""
    stat = os.stat(prefix + ".bin")
    try:
        record = os.stat(prefix + HASH_SUFFIX)
        record_stamp = (record.st_size, record.st_mtime_ns, record.st_ino)
    except FileNotFoundError:
        record_stamp = None
    return _bin_content(prefix, (stat.st_size, stat.st_mtime_ns, stat.st_ino), record_stamp)


@lru_cache(maxsize=None)
def _bin_content(prefix: str, stamp: tuple, record_stamp) -> Tuple[str, Optional[str]]:
    size, mtime_ns, _ = stamp
    sampled = sampled_bin_hash(prefix + ".bin", size)
    return sampled, _recorded_sha256(prefix, size, mtime_ns) if record_stamp else None


# ---- checks -----------------------------------------------------------------------------

def _bad(flag: str, path: str, what: str) -> ArgumentError:
    return ArgumentError(f"{flag}: {path} {what}")


def check_indexed(prefix: str, flag: str = "--data_path") -> dict:
    """Check a .bin/.idx pair the way megatron will read it, from the .idx and the two file
    sizes (cheap: ~20 bytes per document, the .bin is not read). Returns its counts; raises
    ArgumentError naming the file for a missing, truncated, corrupted or empty pair."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (bin_, idx):
        if os.path.isdir(path):
            raise _bad(flag, path, "is a folder, not a file (each prefix names a .bin and a "
                                   ".idx file, e.g. from `swift-mcore preprocess`)")
        if os.path.exists(path):
            check_regular(path, f"{flag}: {path}")  # a FIFO would block the reader
        else:
            raise _bad(flag, path, "does not exist (each prefix needs a .bin and a .idx file, "
                                   "e.g. from `swift-mcore preprocess`)")
    stat = os.stat(idx)
    return dict(_check_indexed(prefix, flag, (stat.st_size, stat.st_mtime_ns,
                                              os.path.getsize(bin_))))


@lru_cache(maxsize=None)
def _check_indexed(prefix: str, flag: str, stamp: Tuple[int, int, int]) -> tuple:
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    idx_size, _, bin_size = stamp
    with open(idx, "rb") as fh:
        head = fh.read(_HEADER_BYTES)
    if not head.startswith(_HEADER) and not _HEADER.startswith(head):
        raise _bad(flag, idx, "is not a megatron index file (it does not start with the "
                              "MMIDIDX header)")
    if len(head) < _HEADER_BYTES:
        raise _bad(flag, idx, f"is truncated: {idx_size} bytes, shorter than the "
                              f"{_HEADER_BYTES}-byte header")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(_HEADER):])
    if version != 1:
        raise _bad(flag, idx, f"has format version {version}; megatron-core reads version 1")
    if code not in _INTEGER_CODES:
        raise _bad(flag, idx, f"is corrupted: token dtype code {code} is not an integer type "
                              f"of megatron's format")
    expected = _HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size != expected:
        extra = " (multimodal index files are not supported)" if idx_size == expected + n_seq \
            else ""
        raise _bad(flag, idx, f"is truncated or corrupted: {idx_size} bytes, but its header "
                              f"describes {n_seq} sequences ({expected} bytes){extra}")
    if n_seq == 0:
        raise _bad(flag, idx, "holds no documents (an empty data set)")
    lengths = np.fromfile(idx, dtype=np.int32, count=n_seq, offset=_HEADER_BYTES)
    pointers = np.fromfile(idx, dtype=np.int64, count=n_seq, offset=_HEADER_BYTES + 4 * n_seq)
    documents = np.fromfile(idx, dtype=np.int64, count=n_doc, offset=_HEADER_BYTES + 12 * n_seq)
    itemsize = np.dtype(_DTYPES[code]).itemsize
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize
    if (lengths < 0).any() or pointers[0] != 0 or not np.array_equal(pointers[1:], ends[:-1]):
        raise _bad(flag, idx, "is corrupted: its sequence lengths and offsets disagree")
    if n_doc < 2 or documents[0] != 0 or documents[-1] != n_seq or \
            (np.diff(documents) < 0).any():
        raise _bad(flag, idx, "is corrupted: its document boundaries are out of order")
    if bin_size != ends[-1]:
        how = "truncated" if bin_size < ends[-1] else "longer than its index says"
        raise _bad(flag, bin_, f"is {how}: {bin_size} bytes, but {idx} describes {ends[-1]} "
                               f"bytes of tokens (rewrite the pair, e.g. with `swift-mcore "
                               f"preprocess`)")
    return (("documents", int(n_doc - 1)), ("sequences", int(n_seq)),
            ("tokens", int(ends[-1] // itemsize)), ("dtype", np.dtype(_DTYPES[code]).name))


# Reading every token of a large .bin at each start would cost minutes; a spread of windows
# this large catches data tokenized with another vocabulary (its ids are spread everywhere).
TOKEN_CHECK_BYTES = 64 << 20
_WINDOWS = 16


def max_token_id(prefix: str, budget: int = TOKEN_CHECK_BYTES) -> int:
    """The largest token id in the whole .bin if it fits ``budget``, else in _WINDOWS evenly
    spaced windows of it (deterministic)."""
    info = check_indexed(prefix)
    dtype = np.dtype(info["dtype"])
    data = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    try:
        if data.nbytes <= budget:
            return int(data.max())
        window = budget // _WINDOWS // dtype.itemsize
        starts = np.linspace(0, data.size - window, _WINDOWS).astype(np.int64)
        return int(max(data[s:s + window].max() for s in starts))
    finally:
        del data


def check_token_range(prefix: str, vocab_size: int, flag: str = "--data_path") -> None:
    """Refuse data whose token ids do not fit the tokenizer: it was tokenized with another."""
    stat = os.stat(prefix + ".bin")
    top = _max_token_id(prefix, (stat.st_size, stat.st_mtime_ns))
    if top >= vocab_size:
        raise ArgumentError(
            f"{flag}: {prefix}.bin holds token id {top}, but the tokenizer has only "
            f"{vocab_size} tokens: the data was tokenized with another tokenizer; pass that "
            f"one with --tokenizer (or re-run `swift-mcore preprocess` with this one)")


@lru_cache(maxsize=None)
def _max_token_id(prefix: str, stamp: Tuple[int, int]) -> int:
    return max_token_id(prefix)

