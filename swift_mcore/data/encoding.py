"""Raw sources -> one .bin/.idx prefix, tokenized by N worker processes (same bytes for any N).

Read in order, tokenized in this process or in a pool, written atomically by IndexedWriter.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from .indexed import IndexedWriter, token_dtype
from .sources import Source, iter_texts, probe
from .worker_pool import forked_pool, in_order

# A task sent to a worker holds up to this many documents or characters: large enough that
# pickling and queueing cost little next to tokenizing, small enough that a few tasks per
# worker fit in memory and the progress bar moves. Chunking never changes the output.
CHUNK_DOCUMENTS = 512
CHUNK_CHARACTERS = 1 << 20


@dataclass
class EncodeStats:
    documents: int = 0
    empty: int = 0  # documents without text: skipped (an EOD alone is noise, not data)
    tokens: int = 0
    characters: int = 0
    seconds: float = 0.0
    per_source: List[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"documents": self.documents, "empty_skipped": self.empty,
                "tokens": self.tokens, "characters": self.characters,
                "seconds": round(self.seconds, 3)}


# ---- one chunk: runs in the main process or in a worker --------------------------------

_worker_state: dict = {}


def _init_worker(tokenizer, append_eod: bool, dtype) -> None:
    _worker_state.update(tokenizer=tokenizer, append_eod=append_eod, dtype=dtype)


def _encode_chunk(texts: List[Optional[str]], tokenizer=None, append_eod=None, dtype=None
                  ) -> Tuple[np.ndarray, np.ndarray, int, int]:
    """(token ids of the non-empty documents back to back, their lengths, empty count,
    characters). A pure function of its input, so the process it runs in cannot matter."""
    if tokenizer is None:
        tokenizer, append_eod, dtype = (_worker_state["tokenizer"], _worker_state["append_eod"],
                                        _worker_state["dtype"])
    docs = [t for t in texts if t]
    ids = tokenizer.encode_batch(docs) if docs else []
    if append_eod:
        for row in ids:
            row.append(tokenizer.eod)
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype,
                         count=int(lengths.sum()))
    return tokens, lengths, len(texts) - len(docs), sum(len(t) for t in docs)


# ---- the pipeline ---------------------------------------------------------------------

def _chunks(sources: Sequence[Source], text_key: str, flag: str
            ) -> Iterator[Tuple[int, List[Optional[str]]]]:
    """(source number, up to CHUNK_DOCUMENTS texts), in input order."""
    for number, source in enumerate(sources):
        for texts in iter_texts(source, text_key, flag, batch_size=CHUNK_DOCUMENTS):
            start = size = 0
            for i, text in enumerate(texts):
                size += len(text) if text else 0
                if size >= CHUNK_CHARACTERS:
                    yield number, texts[start:i + 1]
                    start, size = i + 1, 0
            if start < len(texts):
                yield number, texts[start:]


@contextlib.contextmanager
def _pool(workers: int, tokenizer, append_eod: bool, dtype):
    if workers <= 1:
        yield None
        return
    with forked_pool(workers, _init_worker, (tokenizer, append_eod, dtype)) as pool:
        yield pool


def _encoded(chunks, pool, workers, tokenizer, append_eod, dtype):
    """(source number, encoded chunk) in input order, from the pool or from this process."""
    if pool is None:
        for number, texts in chunks:
            yield number, _encode_chunk(texts, tokenizer, append_eod, dtype)
        return
    yield from in_order(pool, _encode_chunk, chunks, workers)


def encode_sources(sources: Sequence[Source], text_key: str, tokenizer, prefix: str,
                   workers: int = 1, append_eod: bool = True, flag: str = "--input",
                   on_progress: Optional[Callable[[EncodeStats], None]] = None) -> EncodeStats:
    """Tokenize the ``text_key`` column of ``sources`` (in order, one document per row) into
    ``prefix``.bin/.idx. The old pair at ``prefix``, if any, stays intact unless the whole
    run succeeds. Raises ArgumentError naming the file for unreadable, empty or column-less
    input, checked on every source before tokenizing starts."""
    if append_eod and tokenizer.eod is None:
        raise ArgumentError("the tokenizer has no end-of-document token to append")
    if workers < 1:
        raise ArgumentError(f"--workers must be a positive integer, got {workers}")
    stats = EncodeStats(per_source=[0] * len(sources))
    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    # The pool first: its processes fork before reading starts any pyarrow threads.
    with _pool(workers, tokenizer, append_eod, dtype) as pool:
        for source in sources:
            probe(source, text_key, flag)
        with IndexedWriter(prefix, dtype) as writer:
            _write(sources, text_key, flag, pool, workers, tokenizer, append_eod, writer,
                   stats, start, on_progress)
    stats.seconds = time.perf_counter() - start
    return stats


def _write(sources, text_key, flag, pool, workers, tokenizer, append_eod, writer, stats,
           start, on_progress) -> None:
    chunks = _chunks(sources, text_key, flag)
    for number, (tokens, lengths, empty, chars) in _encoded(
            chunks, pool, workers, tokenizer, append_eod, writer.dtype):
        writer.add_documents(tokens, lengths)
        stats.documents += len(lengths)
        stats.per_source[number] += len(lengths)
        stats.empty += empty
        stats.tokens += int(tokens.size)
        stats.characters += chars
        if on_progress is not None:
            stats.seconds = time.perf_counter() - start
            on_progress(stats)
    for source, count in zip(sources, stats.per_source):
        if count == 0:
            raise ArgumentError(f"{flag} {source.path}: holds no text (every "
                                f"'{text_key}' value is empty)")
    writer.commit()
