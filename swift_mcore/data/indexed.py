"""megatron's .bin/.idx files: written atomically, and checked whole before a run reads them.

Writing goes through megatron's IndexedDatasetBuilder; the checks (header, sizes, offsets,
token range) read the .idx and a sample of the .bin without importing megatron.
"""

from __future__ import annotations

import itertools
import os
import struct
from functools import lru_cache
from typing import Iterable, Optional, Tuple

import numpy as np

from ..errors import ArgumentError
from .cache import temp_name

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


class IndexedWriter:
    """``with IndexedWriter(prefix, dtype) as w: w.add_documents(...); w.commit()``.

    Both files are written under a temporary prefix and renamed into place, .idx last: the
    .idx is the commit mark, so a crash leaves at worst a lone .bin, which readers treat as
    missing, never a half-written pair. Leaving the block without ``commit()`` (an error, a
    KeyboardInterrupt) removes the temporary files and leaves any old pair untouched.
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
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")  # uncommit the old pair before its .bin is replaced
        os.replace(self._tmp + ".bin", self.prefix + ".bin")
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
        if not os.path.isfile(path):
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


def read_documents(prefix: str) -> Optional[list]:
    """Every document's token ids (small data, tests and tools); None if the pair is missing."""
    if not exists(prefix):
        return None
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # held while copying: its arrays are views of its mmap
    return [dataset[i].tolist() for i in range(len(dataset))]
