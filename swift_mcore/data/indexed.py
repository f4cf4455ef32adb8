"""Tokenized documents on disk in megatron's .bin/.idx format, written atomically and cached."""

from __future__ import annotations

import csv
import glob
import hashlib
import itertools
import json
import os
from typing import Iterable, Iterator, List, Sequence

import numpy as np

from ..arguments import ArgumentError
from . import corpus
from .cache import cache_dir, locked, temp_name, write_atomic

BATCH_DOCUMENTS = 256  # enough per encode_batch call to keep every core busy


def write_indexed(documents: Iterable[str], tokenizer, prefix: str) -> dict:
    """Tokenize ``documents`` (an EOD after each) into ``prefix``.bin/.idx; returns counts.

    Both files are written under a temporary prefix and renamed into place, .idx last: the
    .idx is the commit mark, so a crash leaves at worst a lone .bin, which readers treat as
    missing, never a half-written pair.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    folder = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(folder, exist_ok=True)
    tmp = temp_name(prefix)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    eod = np.array([tokenizer.eod], dtype=dtype)
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    try:
        docs = iter(documents)
        while batch := list(itertools.islice(docs, BATCH_DOCUMENTS)):
            for ids in tokenizer.encode_batch(batch):
                if not ids:  # an empty document would be a lone EOD: noise, not data
                    continue
                tokens = np.concatenate([np.asarray(ids, dtype=dtype), eod])
                builder.add_document(tokens, [tokens.size])
                n_docs += 1
                n_tokens += tokens.size
        builder.finalize(tmp + ".idx")
        if os.path.exists(prefix + ".idx"):
            os.remove(prefix + ".idx")  # uncommit the old pair before its .bin is replaced
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        builder.data_file.close()
        for leftover in (tmp + ".bin", tmp + ".idx"):
            if os.path.exists(leftover):
                os.remove(leftover)
    if n_docs == 0:
        raise ValueError(f"no non-empty documents to write to {prefix}")
    return {"documents": n_docs, "tokens": n_tokens}


def exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _cached_prefix(kind: str, key: str, name: str, documents, tokenizer) -> str:
    """Tokenize once per key; concurrent callers wait on a lock and then find the files."""
    folder = cache_dir(kind, hashlib.sha256(key.encode()).hexdigest()[:20])
    prefix = os.path.join(folder, name)
    if not exists(prefix):
        with locked(folder):
            if not exists(prefix):
                stats = write_indexed(documents(), tokenizer, prefix)
                write_atomic(os.path.join(folder, "info.json"),
                             json.dumps({"key": key, **stats}, indent=1))
    return prefix


def default_corpus_prefix(tokenizer) -> str:
    """The embedded corpus tokenized with ``tokenizer``, cached by (corpus, tokenizer)."""
    key = f"stdlib corpus={corpus.fingerprint()} tokenizer={tokenizer.fingerprint}"
    return _cached_prefix("corpus", key, "stdlib", corpus.iter_documents, tokenizer)


# ---- raw files (--dataset) --------------------------------------------------------------

RAW_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")


def expand_raw_files(patterns: Sequence[str]) -> List[str]:
    """Files named by --dataset: paths, folders (their supported files) or glob patterns."""
    files: List[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            matches = sorted(p for p in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                             if p.endswith(RAW_SUFFIXES))
        else:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else (
                [pattern] if os.path.isfile(pattern) else [])
        if not matches:
            raise ArgumentError(f"--dataset {pattern}: no such file (accepted: "
                                f"{' '.join(RAW_SUFFIXES)} files, folders or glob patterns)")
        for path in matches:
            if not path.endswith(RAW_SUFFIXES):
                raise ArgumentError(f"--dataset {path}: unsupported file type; accepted: "
                                    f"{' '.join(RAW_SUFFIXES)}")
        files.extend(matches)
    return files


def read_raw_documents(path: str, text_key: str = "text") -> Iterator[str]:
    """The text of each record: a line of .txt, a row of .csv/.parquet, an object of .json(l)."""
    def text_of(record, where):
        if not isinstance(record, dict) or text_key not in record:
            raise ArgumentError(f"--dataset {path} ({where}): no '{text_key}' field; choose the "
                                f"column with --text_key")
        return str(record[text_key] or "")

    if path.endswith(".txt"):
        with open(path, encoding="utf-8", errors="replace") as fh:
            yield from (line.rstrip("\n") for line in fh)
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ArgumentError(f"--dataset {path} line {number}: not JSON ({err})")
                    yield text_of(record, f"line {number}")
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as err:
                raise ArgumentError(f"--dataset {path}: not JSON ({err})") from None
        for number, record in enumerate(data if isinstance(data, list) else [data]):
            yield text_of(record, f"record {number}")
    elif path.endswith(".csv"):
        with open(path, encoding="utf-8", newline="") as fh:
            for number, row in enumerate(csv.DictReader(fh), 2):
                yield text_of(row, f"line {number}")
    else:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if text_key not in table.schema_arrow.names:
            raise ArgumentError(f"--dataset {path}: no '{text_key}' column; choose it with "
                                f"--text_key")
        for batch in table.iter_batches(columns=[text_key]):
            yield from (str(t or "") for t in batch.column(0).to_pylist())


def raw_files_prefix(patterns: Sequence[str], text_key: str, tokenizer) -> str:
    """--dataset files tokenized into one cached prefix, keyed by the files' identity."""
    files = expand_raw_files(patterns)
    stamps = [(os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns) for p in files]
    key = f"raw files={stamps} text_key={text_key} tokenizer={tokenizer.fingerprint}"

    def documents():
        for path in files:
            yield from read_raw_documents(path, text_key)

    return _cached_prefix("datasets", key, "data", documents, tokenizer)
