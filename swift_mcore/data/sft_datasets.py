"""Finetuning datasets: conversations encoded, truncated, split, packed, and batched.

A training item is a row: one conversation (padded per micro-batch) or, with --packing,
several conversations laid end to end in --seq_length positions. A conversation is one
sample, or one per assistant turn whose history its chat template re-renders
(templates.py); below, "conversation" means such a sample. Rows are fixed by the data
and the flags alone; the sampler (sampler.py) orders them per (seed, epoch), so a resumed
run finds its next row from the consumed-samples counter, as in pretraining.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..errors import ArgumentError
# Encoding lives in sft_samples; its names are this module's API too.
from .sft_samples import (ENCODING_VERSION, Encoded, EncodingReport, Tokenized,  # noqa: F401
                          _flat, encode_chunk, encode_conversations, tokenize_conversations)
from .sequence_rows import padding_mask
from .templates import Template


class SftDataset(torch.utils.data.Dataset):
    """Rows of conversations; ``collate`` pads a micro-batch of rows."""

    def __init__(self, encoded: Encoded, rows, seq_length: int, pad_id: int,
                 packed: bool, pad_to_seq_length: bool, fingerprint: str,
                 pad_multiple: int = 1):
        """``rows``: the samples of each row, as lists, or as (members, row_offsets) arrays
        (row r holds members[row_offsets[r]:row_offsets[r + 1]])."""
        self.encoded = encoded
        if isinstance(rows, tuple):
            self.members, self.row_offsets = rows
        else:
            self.row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            self.row_offsets[1:] = np.cumsum([len(r) for r in rows])
            self.members = np.asarray([k for row in rows for k in row], dtype=np.int64)
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.packed = packed
        # Pipeline stages exchange activations of one fixed shape.
        self.pad_to_seq_length = pad_to_seq_length
        # Sequence parallelism splits the sequence over the tensor-parallel ranks.
        self.pad_multiple = pad_multiple
        self.fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def conversations(self, row: int) -> np.ndarray:
        return self.members[self.row_offsets[row]:self.row_offsets[row + 1]]

    def __getitem__(self, row: int) -> Dict[str, np.ndarray]:
        e = self.encoded
        tokens, labels, mask, positions, segments = [], [], [], [], []
        for segment, k in enumerate(self.conversations(row)):
            ids, targets = e.sample(k)
            tokens.append(ids[:-1])
            labels.append(ids[1:])
            mask.append(targets[1:])
            positions.append(np.arange(len(ids) - 1))
            segments.append(np.full(len(ids) - 1, segment))
        return {"tokens": np.concatenate(tokens), "labels": np.concatenate(labels),
                "loss_mask": np.concatenate(mask), "position_ids": np.concatenate(positions),
                "segment_ids": np.concatenate(segments)}

    def collate(self, rows: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
        """Right-pads to the longest row (to --seq_length under pipeline parallelism).
        Padding is masked from the loss, and forms its own segment when packed, so no real
        token attends to it; ``padding_mask`` marks it (True), for the MoE router."""
        lengths = [len(r["tokens"]) for r in rows]
        width = self.seq_length if self.pad_to_seq_length else max(lengths)
        width = -(-width // self.pad_multiple) * self.pad_multiple
        batch = {
            "tokens": torch.full((len(rows), width), self.pad_id, dtype=torch.long),
            "labels": torch.full((len(rows), width), self.pad_id, dtype=torch.long),
            "loss_mask": torch.zeros(len(rows), width, dtype=torch.float),
            "position_ids": torch.zeros(len(rows), width, dtype=torch.long),
        }
        if self.packed:
            batch["segment_ids"] = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            for name in batch:
                batch[name][i, :n] = torch.from_numpy(row[name].astype(np.int64)
                                                      if name != "loss_mask"
                                                      else row[name].astype(np.float32))
        batch["padding_mask"] = padding_mask(lengths, width)
        batch["num_tokens"] = torch.tensor(sum(lengths), dtype=torch.long)
        return batch


def build_sft_datasets(config, tokenizer, log: Callable[[str], None] = print,
                       on_cache: Callable[[str], None] = lambda event: None):
    """(train, valid, None) SftDatasets from --dataset (and --val_dataset or
    --split_dataset_ratio); ``config`` is a RunConfig. Conversations are tokenized once into
    the token cache (token_cache.cached_sft_tokens; ``on_cache`` hears "built" or "reused"
    per file set, and "packing built", "packing reused" or "packing stored" per packing
    plan). Raises ArgumentError naming the file, row and flag."""
    from ..arguments.sft import column_map
    from .token_cache import cached_sft_tokens, pack_plan
    s, seq = config.sft, config.model.seq_length
    template = Template(s.template, tokenizer, system=s.system,
                        train_separator=s.train_separator,
                        ignore_empty_think=s.ignore_empty_think)
    columns = column_map(s.columns)
    train_sources, val_sources = list(config.dataset_sources), list(config.val_dataset_sources)

    def encode(sources, flag):
        report = EncodingReport()
        tokenized = cached_sft_tokens(sources, columns, flag, template, s.loss_on,
                                      s.dataset_num_proc, on_event=on_cache)
        encoded = tokenized.fit(seq, s.truncation_strategy, report)
        log(f"sft data {flag}: {report.describe(s.truncation_strategy, seq)} "
            f"(template: {template.describe()})")
        if len(encoded) == 0:
            raise ArgumentError(f"{flag}: no conversation is left to train on; raise "
                                f"--seq_length or use --truncation_strategy left|right")
        return encoded

    if config.data.streaming:
        return _streaming(config, tokenizer, template, columns, log, encode)
    if s.cached_dataset:
        from .token_cache import load_sft_dataset

        report = EncodingReport()
        tokenized, _ = load_sft_dataset(s.cached_dataset, template, s.loss_on, columns)
        train = tokenized.fit(seq, s.truncation_strategy, report)
        log(f"sft data --cached_dataset {s.cached_dataset}: "
            f"{report.describe(s.truncation_strategy, seq)} (template: {template.describe()})")
        if len(train) == 0:
            raise ArgumentError(f"--cached_dataset {s.cached_dataset}: no conversation is "
                                f"left to train on at --seq_length {seq}; raise --seq_length "
                                f"or use --truncation_strategy left|right")
    else:
        train = encode(train_sources, "--dataset")
    valid = encode(val_sources, "--val_dataset") if val_sources else None
    if s.split_dataset_ratio:
        train, valid = split(train, s.split_dataset_ratio, config.training.seed)

    fingerprint = sft_fingerprint(config, tokenizer, template)
    pad_id = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
    pad_fixed = config.parallel.pipeline_model_parallel_size > 1
    # rows split over TP ranks (--sequence_parallel) and into 2 x CP chunks
    # (--context_parallel_size) pad to a multiple of both
    cp = config.parallel.context_parallel_size
    pad_multiple = (config.parallel.tensor_model_parallel_size
                    if config.parallel.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)

    def dataset(encoded, name):
        if encoded is None:
            return None
        positions = encoded.positions()
        if s.packing:
            # a --cached_dataset folder's stored plan, when it has one for these samples
            rows = pack_plan(positions, seq, s.cached_dataset if name == "train" else None,
                             on_event=lambda event: on_cache(f"packing {event}"))
            count = len(rows[1]) - 1
            fill = positions.sum() / (count * seq)
            log(f"sft data {name}: {len(encoded)} conversations packed into {count} rows "
                f"of {seq} positions ({fill:.1%} filled)")
        else:
            n = len(encoded)
            rows = (np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64))
        return SftDataset(encoded, rows, seq, pad_id, s.packing, pad_fixed,
                          f"{fingerprint}:{name}", pad_multiple)

    return dataset(train, "train"), dataset(valid, "valid"), None


def _collator(config, tokenizer, name: str) -> SftDataset:
    """An SftDataset without rows: its ``collate`` batches rows the same way for any data."""
    pad_id = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
    pad_multiple = (config.parallel.tensor_model_parallel_size
                    if config.parallel.sequence_parallel else 1)
    return SftDataset(None, [], config.model.seq_length, pad_id, config.sft.packing,
                      config.parallel.pipeline_model_parallel_size > 1, name, pad_multiple)


def _streaming(config, tokenizer, template, columns, log, encode):
    """--streaming: (the stream, the validation set read whole, None)."""
    from .streaming import StreamingSftDataset, check_renamed_columns, check_stream_sources

    s = config.sft
    sources = list(config.dataset_sources)
    check_stream_sources(sources)
    check_renamed_columns(sources, columns)
    fingerprint = sft_fingerprint(config, tokenizer, template)
    train = StreamingSftDataset(
        sources, columns, template, s.loss_on, config.model.seq_length,
        s.truncation_strategy, s.packing, config.data.shuffle_buffer_size,
        config.training.seed,
        _collator(config, tokenizer, f"{fingerprint}:train"), f"{fingerprint}:train")
    log(f"sft data --dataset: streamed from {len(sources)} file(s) through a shuffle buffer "
        f"of {config.data.shuffle_buffer_size} rows{', packed' if s.packing else ''} "
        f"(template: {template.describe()})")
    valid = None
    if config.val_dataset_sources:
        encoded = encode(list(config.val_dataset_sources), "--val_dataset")
        if s.packing:
            from .token_cache import cached_pack_plan

            rows = cached_pack_plan(encoded.positions(), config.model.seq_length)
        else:
            n = len(encoded)
            rows = (np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64))
        collator = _collator(config, tokenizer, f"{fingerprint}:valid")
        valid = SftDataset(encoded, rows, collator.seq_length, collator.pad_id, s.packing,
                           collator.pad_to_seq_length, collator.fingerprint,
                           collator.pad_multiple)
    return train, valid, None


def sft_fingerprint(config, tokenizer, template: Optional[Template] = None) -> str:
    """Identity of a run's finetuning data, from the files alone (no encoding): their
    content, the tokenizer, the chat template and the flags that change the rows."""
    from .sources import content_fingerprint

    s = config.sft
    template = template or Template(s.template, tokenizer, system=s.system,
                                    train_separator=s.train_separator,
                                    ignore_empty_think=s.ignore_empty_think)
    if s.cached_dataset:
        # The files the folder was prepared from, as a raw-file run names them: the same
        # data trained either way has one fingerprint, and resumes from either.
        from ..arguments.sft import column_map
        from .token_cache import load_sft_dataset

        if config.model.vision_config:  # image rows (data/image_cache.py)
            from .image_cache import image_encoder, load_image_sft_dataset

            train = load_image_sft_dataset(s.cached_dataset, image_encoder(config, tokenizer),
                                           column_map(s.columns), images=False)[1]["sources"]
        else:
            train = load_sft_dataset(s.cached_dataset, template, s.loss_on,
                                     column_map(s.columns))[1]["sources"]
    elif config.data.streaming:
        # A stream's files are too large to hash whole at every start: their sizes and
        # ends here, the rows a resumed stream re-reads checked on top (streaming.py).
        from .streaming import check_stream_sources, stream_identity

        check_stream_sources(config.dataset_sources)
        train = stream_identity(config.dataset_sources)
    else:
        train = content_fingerprint(config.dataset_sources)
    identity = {
        "version": ENCODING_VERSION,
        "train": train,
        "valid": (content_fingerprint(config.val_dataset_sources)
                  if config.val_dataset_sources else None),
        "tokenizer": tokenizer.fingerprint,
        "sft": {k: _plain(getattr(s, k)) for k in (
            "template", "system", "train_separator", "loss_on", "truncation_strategy",
            "packing", "columns", "split_dataset_ratio")},
        "template": template.name,
        # the Jinja text decides the tokens; the tokenizer's fingerprint covers its vocabulary
        "chat_template": tokenizer.chat_template if template.name == "tokenizer" else None,
    }
    # Named only when on, so checkpoints of runs that trained empty reasoning blocks (before
    # the flag, or with it off) keep their fingerprint.
    if s.ignore_empty_think:
        identity["ignore_empty_think"] = True
    for key in ("max_pixels", "min_pixels"):  # images' sizes (data/multimodal.py), when set
        if getattr(s, key, None) is not None:
            identity[key] = getattr(s, key)
    if config.data.streaming:  # another order of the same rows: resumes only so
        from .streaming import OPEN_ROWS, STREAM_VERSION

        identity["streaming"] = {"version": STREAM_VERSION, "seed": config.training.seed,
                                 "shuffle_buffer_size": config.data.shuffle_buffer_size,
                                 "open_rows": OPEN_ROWS}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def split(encoded: Encoded, ratio: float, seed: int) -> Tuple[Encoded, Encoded]:
    """A fixed draw of ``ratio`` of the conversations (at least one) for validation."""
    n = len(encoded)
    held = max(1, int(round(ratio * n)))
    if held >= n:
        raise ArgumentError(f"--split_dataset_ratio {ratio} leaves no training conversation "
                            f"of {n}")
    order = np.random.default_rng([seed, 0x5F7]).permutation(n)
    valid = np.sort(order[:held])
    train = np.sort(order[held:])
    return encoded.take(train), encoded.take(valid)
