"""Samples of conversations as token ids and label targets: encoded, counted, fitted to --seq_length.

A conversation is one sample, or one per assistant turn whose history its chat template
re-renders (templates.py). Samples are kept whole (``Tokenized``, what the token cache
stores) and fitted to a sequence length afterwards by moving their bounds only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .templates import CONTEXT, Template

# Part of the fingerprint: change it whenever encoding changes what a conversation becomes.
ENCODING_VERSION = 2


@dataclass
class Encoded:
    """Samples over flat arrays: sample k is ids[starts[k]:ends[k]]; ``targets`` marks the
    tokens trained on (as labels). The arrays may be memory-mapped from the token cache;
    truncating, dropping and splitting change only ``starts`` and ``ends``."""

    ids: np.ndarray
    targets: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def sample(self, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """(ids, targets) of sample k."""
        return self.ids[self.starts[k]:self.ends[k]], self.targets[self.starts[k]:self.ends[k]]

    def positions(self) -> np.ndarray:
        """Training positions per sample: n tokens predict n - 1 labels."""
        return self.ends - self.starts - 1

    def take(self, keep: Sequence[int]) -> "Encoded":
        keep = np.asarray(keep, dtype=np.int64)
        return Encoded(self.ids, self.targets, self.starts[keep], self.ends[keep])


def _flat(parts) -> Encoded:
    lengths = [len(ids) for ids, _ in parts]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    targets = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, bool)
    return Encoded(ids.astype(np.int32), targets.astype(bool), offsets[:-1], offsets[1:])


@dataclass
class EncodingReport:
    conversations: int = 0
    truncated: int = 0  # cut and kept
    dropped_long: int = 0
    dropped_empty: int = 0  # no trained token left after truncation
    samples: int = 0  # a conversation is one sample, or one per rewritten history
    split: int = 0  # conversations rendered as several samples

    def describe(self, strategy: str, seq_length: int) -> str:
        kept = self.samples - self.dropped_long - self.dropped_empty
        text = f"{kept} of {self.conversations} conversations kept"
        if self.split:
            text = (f"{kept} of {self.samples} samples kept from {self.conversations} "
                    f"conversations ({self.split} split into one sample per assistant turn "
                    f"whose history the template re-renders)")
        if self.truncated:
            text += f"; {self.truncated} cut on the {strategy} to --seq_length {seq_length}"
        if self.dropped_long:
            text += (f"; {self.dropped_long} dropped as longer than --seq_length {seq_length} "
                     f"(--truncation_strategy drop)")
        if self.dropped_empty:
            text += f"; {self.dropped_empty} dropped with no answer token left after the cut"
        return text


@dataclass
class Tokenized:
    """Every sample of some conversations, whole (before --seq_length decides any cut):
    ``encoded`` and, per sample, how many of its tokens after the first are trained."""

    encoded: Encoded
    answers: np.ndarray
    conversations: int
    split: int

    def fit(self, seq_length: int, truncation: str,
            report: Optional[EncodingReport] = None) -> Encoded:
        """The samples fitted to ``seq_length`` training positions (``seq_length + 1``
        tokens): longer ones dropped or cut, those left without a trained token dropped,
        each counted in ``report``. Only the sample bounds change (no token is copied)."""
        report = report if report is not None else EncodingReport()
        e = self.encoded
        report.conversations += self.conversations
        report.split += self.split
        report.samples += len(e)
        starts, ends = e.starts.copy(), e.ends.copy()
        cut = (ends - starts) > seq_length + 1
        keep = self.answers > 0
        if truncation == "drop":
            report.dropped_long += int(cut.sum())
            keep &= ~cut
            report.dropped_empty += int((~cut & (self.answers == 0)).sum())
        else:
            report.dropped_empty += int((~cut & (self.answers == 0)).sum())
            for k in np.flatnonzero(cut):
                if truncation == "right":
                    ends[k] = starts[k] + seq_length + 1
                else:
                    starts[k] = ends[k] - seq_length - 1
                # The first token is never a label: it has no token before it.
                trained = bool(e.targets[starts[k] + 1:ends[k]].any())
                keep[k] = trained
                # Counted once: a cut sample left with no answer counts as dropped only.
                report.truncated += trained
                report.dropped_empty += not trained
        kept = np.flatnonzero(keep)
        return Encoded(e.ids, e.targets, starts[kept], ends[kept])


def _kept_samples(samples, loss_on: str):
    """(ids, trained, answer tokens) of one conversation's encoded samples that train:
    all of them, or with last_turn only the sample of its last answer."""
    last = max(int(turns.max()) for _, turns in samples)
    kept = []
    for sample_ids, turns in samples:
        # last_turn: a split conversation trains only the sample of its last answer
        if loss_on == "last_turn" and turns.max() < last:
            continue
        trained = turns == last if loss_on == "last_turn" else turns != CONTEXT
        kept.append((sample_ids, trained, int(trained[1:].sum())))
    return kept


def encode_chunk(conversations, template: Template, loss_on: str):
    """(ids, targets, lengths, answers, split) of the samples of some conversations, back to
    back: a pure function of its input, so the process it runs in cannot matter."""
    ids, targets, lengths, answers = [], [], [], []
    split = 0
    for samples in template.encode_many(conversations):
        split += len(samples) > 1
        for sample_ids, trained, answer in _kept_samples(samples, loss_on):
            ids.append(sample_ids)
            targets.append(trained)
            lengths.append(len(sample_ids))
            answers.append(answer)
    cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts
           else np.zeros(0, dtype))
    return (cat(ids, np.int32), cat(targets, bool), np.asarray(lengths, np.int64),
            np.asarray(answers, np.int64), split)


def encode_each(conversations, template: Template, loss_on: str) -> List[Tokenized]:
    """Per conversation, its samples whole (what ``encode_chunk`` gives for it alone), all
    tokenized in one call: a stream encodes the rows it draws so."""
    out = []
    for samples in template.encode_many(conversations):
        kept = _kept_samples(samples, loss_on)
        out.append(Tokenized(_flat([(ids, trained) for ids, trained, _ in kept]),
                             np.asarray([answer for *_, answer in kept], np.int64), 1,
                             int(len(samples) > 1)))
    return out


def tokenize_conversations(conversations, template: Template, loss_on: str,
                           chunk: int = 1024) -> Tokenized:
    """Every sample of ``conversations``, in memory (the token cache writes the same
    chunks to disk: token_cache.cached_sft_tokens)."""
    parts = [encode_chunk(conversations[i:i + chunk], template, loss_on)
             for i in range(0, len(conversations), chunk)]
    lengths = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    encoded = Encoded(
        np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32),
        np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, bool),
        offsets[:-1], offsets[1:])
    answers = np.concatenate([p[3] for p in parts]) if parts else np.zeros(0, np.int64)
    return Tokenized(encoded, answers, len(conversations), sum(p[4] for p in parts))


def encode_conversations(conversations, template: Template, seq_length: int,
                         truncation: str, loss_on: str,
                         report: Optional[EncodingReport] = None,
                         chunk: int = 1024) -> Encoded:
    """Token ids and label targets of each conversation, fitted to ``seq_length`` training
    positions (``seq_length + 1`` tokens). Dropped conversations are left out and counted."""
    return tokenize_conversations(conversations, template, loss_on, chunk).fit(
        seq_length, truncation, report)
