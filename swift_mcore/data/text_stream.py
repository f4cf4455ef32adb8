"""pt --streaming: raw text rows read through the seeded shuffle buffer, tokenized and cut into --seq_length rows on the fly, with an exact position.

The rows of --dataset come from streaming.ShuffledRows (the same reading and shuffling as
sft's stream). Each row's --text_key text is tokenized with an end-of-document token
appended, as the cached pt path tokenizes it (token_cache.raw_files_prefix; an empty text
is skipped), and the documents are laid end to end. Training row ``p`` is the next
--seq_length + 1 tokens; the row after it starts at its last token (megatron's GPTDataset
cuts samples so, every token a label once). Tokens, labels, loss mask (pad labels masked)
and position ids are GPTDataset's.

The position is the rows' (reader, shuffle generator, buffer locators) plus the locators
of the documents whose tokens are not all trained yet and how many tokens of the first one
are: a resumed run re-reads and re-tokenizes those few rows and continues with the very
next token. Every rank computes the whole global stream and keeps its own slice
(streaming._RankBatches), so a run resumes on another data-parallel size.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ..errors import ArgumentError, CheckpointError
from .streaming import DATA_CHANGED, ENCODE_ROWS, STREAM_VERSION, Locator, RowStream

WHAT = "pt text"


def no_text_column(where: str, text_key: str, row: dict) -> ArgumentError:
    shown = ", ".join(repr(c) for c in row) or "none"
    return ArgumentError(f"{where}: no '{text_key}' column (it has {shown}); choose the text "
                         f"column with --text_key")


class TextStream(RowStream):
    """The global sequence of pt training rows (arrays of --seq_length + 1 token ids), with
    a position that ``state()`` captures and ``TextStream(..., state)`` continues from."""

    KIND = {"what": WHAT}

    def __init__(self, sources, text_key: str, tokenizer, seq_length: int, buffer_size: int,
                 seed: int, state: Optional[dict] = None, flag: str = "--dataset"):
        if tokenizer.eod is None:
            raise ArgumentError("the tokenizer has no end-of-document token to append")
        self.text_key, self.tokenizer, self.seq_length = text_key, tokenizer, seq_length
        # documents whose tokens are not all trained yet: (locator, digest, token ids)
        self.carry: collections.deque = collections.deque()
        self.start = 0  # tokens of carry[0] trained past
        self.available = 0  # tokens in the carry from ``start`` on
        super().__init__(sources, buffer_size, seed, state, flag)

    def _text(self, loc: Locator, row: dict) -> Optional[str]:
        if self.text_key not in row:
            raise no_text_column(self.reader.where(loc), self.text_key, row)
        text = row[self.text_key]
        if text is None or text == "":
            return None
        if not isinstance(text, str):
            raise ArgumentError(f"{self.reader.where(loc)}: column '{self.text_key}' holds a "
                                f"{type(text).__name__} value, not text; choose the text "
                                f"column with --text_key")
        return text

    def documents(self, drawn: Sequence) -> List[Optional[np.ndarray]]:
        """Each drawn (locator, row) as its document (its text's tokens and an
        end-of-document token; None for an empty text), tokenized in one call."""
        texts = [self._text(loc, row) for loc, row, *_ in drawn]
        present = [t for t in texts if t is not None]
        encoded = iter(self.tokenizer.encode_batch(present) if present else [])
        out = []
        for text in texts:
            ids = next(encoded) if text is not None else None
            out.append(np.asarray(list(ids) + [self.tokenizer.eod], dtype=np.int64)
                       if ids else None)
        return out

    def next_item(self) -> np.ndarray:
        """The next training row: --seq_length + 1 token ids."""
        need = self.seq_length + 1
        while self.available < need:
            # ENCODE_ROWS rows per tokenizer call; every document drawn joins the carry (so
            # the position holds it), in draw order: the rows are those of drawing one by one
            drawn = [self.rows.next_row() for _ in range(ENCODE_ROWS)]
            for (loc, _row, digest), ids in zip(drawn, self.documents(drawn)):
                self._count_row(ids is not None, f"holds no text (every '{self.text_key}' "
                                f"value is empty)")
                if ids is None:
                    continue
                self.carry.append((tuple(loc), digest, ids))
                self.available += len(ids)
        parts, left, offset = [], need, self.start
        for _loc, _digest, ids in self.carry:
            piece = ids[offset:offset + left]
            parts.append(piece)
            left, offset = left - len(piece), 0
            if not left:
                break
        # the next row starts at this row's last token
        advance = self.seq_length
        while advance:
            rest = len(self.carry[0][2]) - self.start
            if rest <= advance:
                self.carry.popleft()
                advance, self.start = advance - rest, 0
            else:
                self.start, advance = self.start + advance, 0
        self.available -= self.seq_length
        self.position += 1
        return np.concatenate(parts)

    # -- the position
    def _held(self):
        return ({"carry": [list(entry[0]) for entry in self.carry], "start": self.start},
                [entry[1] for entry in self.carry])

    def _parse(self, state: dict):
        if state.get("what") != WHAT:
            raise ValueError(f"it is a {state.get('what') or 'sft'} stream's")
        return int(state["start"]), [tuple(int(v) for v in loc) for loc in state["carry"]]

    def _held_locators(self, parsed) -> List[Locator]:
        return parsed[1]

    def _rebuild(self, parsed, rows) -> None:
        self.start, carry = parsed
        self.carry = collections.deque()
        documents = self.documents([(loc, rows[loc][0]) for loc in carry])
        for loc, ids in zip(carry, documents):
            if ids is None:
                raise CheckpointError(DATA_CHANGED)
            self.carry.append((loc, rows[loc][1], ids))
        self.available = sum(len(entry[2]) for entry in self.carry) - self.start
        if self.carry and not 0 <= self.start < len(self.carry[0][2]):
            raise CheckpointError(DATA_CHANGED)


class StreamingTextDataset:
    """pt --streaming's training data: the stream's definition, no length."""

    streaming = True

    def __init__(self, sources, text_key: str, tokenizer, seq_length: int, buffer_size: int,
                 seed: int, fingerprint: str):
        self.sources, self.text_key, self.tokenizer = list(sources), text_key, tokenizer
        self.seq_length, self.buffer_size, self.seed = seq_length, buffer_size, seed
        self.fingerprint = fingerprint
        self.pad = tokenizer.pad  # -1: no pad token apart from the end of document

    def stream(self, state: Optional[dict] = None) -> TextStream:
        return TextStream(self.sources, self.text_key, self.tokenizer, self.seq_length,
                          self.buffer_size, self.seed, state)

    def collate_items(self, items: List[np.ndarray]) -> Dict[str, torch.Tensor]:
        """A micro-batch as megatron's GPTDataset gives its samples (no eod masking, pad
        labels out of the loss, position ids from 0 in every row)."""
        text = torch.from_numpy(np.stack(items)).long()
        tokens, labels = text[:, :-1].clone(), text[:, 1:].clone()
        loss_mask = torch.ones(tokens.shape, dtype=torch.float)
        if self.pad >= 0:
            loss_mask[labels == self.pad] = 0.0
            tokens[tokens == self.pad] = 0
            labels[labels == self.pad] = 0
        position_ids = torch.arange(self.seq_length, dtype=torch.long).expand_as(tokens)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": position_ids.contiguous()}


def text_stream_fingerprint(config, tokenizer) -> str:
    """Identity of a pt stream from its files alone (their sizes and ends:
    streaming.stream_identity), the text column, the tokenizer and the stream's order."""
    from .streaming import check_stream_sources, stream_identity

    check_stream_sources(config.dataset_sources)
    identity = {"what": WHAT, "version": STREAM_VERSION,
                "files": stream_identity(config.dataset_sources),
                "text_key": config.data.text_key, "tokenizer": tokenizer.fingerprint,
                "seed": config.training.seed,
                "shuffle_buffer_size": config.data.shuffle_buffer_size}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def check_first_rows(reader, text_key: str) -> None:
    """Each file's first row has the text column (read here, before any step, rather than
    in the loader worker after the files before it)."""
    for index in range(len(reader.sources)):
        for loc, _after, row in reader.rows(index, 0, 0):
            if loc[0] != index:
                break
            if text_key not in row:
                raise no_text_column(reader.where(loc), text_key, row)
            break


def build_text_stream(config, tokenizer, log=print) -> StreamingTextDataset:
    """pt --streaming's training set (no validation or test split)."""
    from .streaming import RowReader, check_stream_sources

    data = config.data
    sources: Sequence = list(config.dataset_sources)
    check_stream_sources(sources)
    check_first_rows(RowReader(sources), data.text_key)
    log(f"pt data --dataset: '{data.text_key}' streamed from {len(sources)} file(s) through a "
        f"shuffle buffer of {data.shuffle_buffer_size} rows, cut into rows of "
        f"{config.model.seq_length} tokens")
    return StreamingTextDataset(sources, data.text_key, tokenizer, config.model.seq_length,
                                data.shuffle_buffer_size, config.training.seed,
                                text_stream_fingerprint(config, tokenizer))
