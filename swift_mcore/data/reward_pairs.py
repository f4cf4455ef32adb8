"""A reward model's preference pairs: each answer tokenized whole with its prompt, as TRL
1.16's RewardTrainer tokenizes it, and batched chosen-first with the rows' margins.

The rows are data/preference.py's (every format it reads, plus an optional numeric
``margin`` column). A text answer gets the EOS appended; prompt + answer is tokenized as one
text, or as one conversation through the chat template (no generation prompt). A sequence
longer than --max_length (default --seq_length) is refused, counted and named: TRL drops
such rows silently.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ArgumentError
from .preference import (Pair, check_chat_template, preference_fingerprint, read_pairs,
                         rendering, sequence_pad_multiple)
from .sequence_rows import lay_out, packing_note, padding_mask

# Part of the fingerprint: change it whenever tokenizing changes what a pair becomes.
ENCODING_VERSION = 1


def tokenize_reward_pair(pair: Pair, hf) -> Tuple[List[int], List[int]]:
    """(prompt + chosen ids, prompt + rejected ids) as TRL 1.16's RewardTrainer makes them;
    ``hf`` is the Hugging Face tokenizer."""
    check_chat_template(pair, hf, prompt=False)  # prompt + answer is rendered whole
    if pair.conversational:
        def ids(messages):
            return list(hf.apply_chat_template(messages, tools=pair.tools, tokenize=True,
                                               return_dict=True)["input_ids"])

        return ids(pair.prompt + pair.chosen), ids(pair.prompt + pair.rejected)
    eos = hf.eos_token
    chosen = pair.chosen if pair.chosen.endswith(eos) else pair.chosen + eos
    rejected = pair.rejected if pair.rejected.endswith(eos) else pair.rejected + eos
    return (list(hf(text=pair.prompt + chosen)["input_ids"]),
            list(hf(text=pair.prompt + rejected)["input_ids"]))


class RewardPairs(torch.utils.data.Dataset):
    """Tokenized pairs; ``collate`` makes a micro-batch of B pairs into 2B right-padded rows,
    the chosen sequences first (TRL's DataCollatorForPreference), and their margins.

    With ``pack_to`` (--packing) the 2B sequences are laid end to end in rows of at most
    ``pack_to`` positions (data/sequence_rows.py; chosen i is sequence i, rejected i is
    B + i) and ``score_index`` gives each sequence's (row, position) the score is read at:
    its last token that is not the pad token, as in its own padded row. An item is still
    one pair, so the data order and resume are the unpacked run's."""

    def __init__(self, encoded: Sequence[Tuple[np.ndarray, np.ndarray, float]], pad_id: int,
                 fingerprint: str, has_margin: bool, pad_multiple: int = 1,
                 pack_to: Optional[int] = None, pad_to: Optional[int] = None):
        """``pad_to``: every row's width (pipeline stages exchange one fixed shape)."""
        self.encoded = encoded
        self.pad_multiple = pad_multiple
        self.pad_to = pad_to
        self.pad_id = pad_id
        self.fingerprint = fingerprint
        self.has_margin = has_margin
        self.pack_to = pack_to

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int):
        chosen, rejected, margin = self.encoded[index]
        return {"chosen": chosen, "rejected": rejected, "margin": margin}

    def collate(self, items) -> dict:
        seqs = [item["chosen"] for item in items] + [item["rejected"] for item in items]
        if self.pack_to is None:
            width = max(len(s) for s in seqs) if self.pad_to is None else self.pad_to
            width = -(-width // self.pad_multiple) * self.pad_multiple
            tokens = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            for i, ids in enumerate(seqs):
                tokens[i, :len(ids)] = torch.from_numpy(ids.astype(np.int64))
            batch = {"tokens": tokens, "position_ids": torch.arange(width).unsqueeze(0)
                     .expand(len(seqs), width).clone(),
                     "padding_mask": padding_mask([len(s) for s in seqs], width)}
        else:
            batch, places = lay_out(seqs, self.pad_id, shift=False, pack_to=self.pack_to,
                                    pad_multiple=self.pad_multiple)
            batch["score_index"] = torch.tensor(
                [(row, start + last_real(ids, self.pad_id))
                 for ids, (row, start) in zip(seqs, places)], dtype=torch.long)
        batch["margin"] = torch.tensor([float(item["margin"]) for item in items])
        batch["num_tokens"] = torch.tensor(sum(len(s) for s in seqs), dtype=torch.long)
        return batch


def last_real(ids: np.ndarray, pad_id: int) -> int:
    """The position of the last id that is not ``pad_id`` (0 if none): where a padded row's
    score is read (models/value_head.last_token_index)."""
    real = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(real[-1]) if len(real) else 0


def max_length_of(config) -> int:
    r = config.rlhf
    return r.max_length if r.max_length is not None else config.model.seq_length


def encode_reward_pairs(pairs: List[Pair], hf, max_length: int):
    """[(chosen ids, rejected ids, margin)]; ArgumentError for rows over ``max_length``
    (counted, the first named) and for margins given on some rows only."""
    with_margin = [p for p in pairs if p.margin is not None]
    if with_margin and len(with_margin) != len(pairs):
        missing = next(p for p in pairs if p.margin is None)
        raise ArgumentError(f"{missing.where}: no 'margin', while {with_margin[0].where} has "
                            f"one; give every row a margin or none")
    encoded, long_rows = [], []
    for pair in pairs:
        with rendering(pair.where):
            chosen, rejected = tokenize_reward_pair(pair, hf)
        if max(len(chosen), len(rejected)) > max_length:
            long_rows.append(pair.where)
            continue
        encoded.append((np.asarray(chosen, np.int32), np.asarray(rejected, np.int32),
                        pair.margin or 0.0))
    if long_rows:
        raise ArgumentError(
            f"{len(long_rows)} of {len(pairs)} rows have an answer of more than --max_length "
            f"{max_length} tokens with its prompt (first: {long_rows[0]}); a reward model "
            f"scores the whole sequence: raise --max_length (and --seq_length) or shorten "
            f"those rows")
    return encoded, bool(with_margin)


def build_reward_datasets(config, tokenizer, log: Callable[[str], None] = print,
                          on_cache: Callable[[str], None] = lambda event: None):
    """(train, None, None): the --dataset pairs for --rlhf_type rm, tokenized once into the
    rlhf cache (data/rlhf_cache.py) under the data's fingerprint; ``on_cache`` hears
    "built" or "reused"."""
    from ..models.value_head import pad_id_of
    from .rlhf_cache import cached_rows

    max_length = max_length_of(config)
    fingerprint = reward_fingerprint(config, tokenizer)

    def encode():
        pairs = read_pairs(list(config.dataset_sources))
        rows, margins = encode_reward_pairs(pairs, tokenizer.hf, max_length)
        return rows, {"has_margin": margins}

    encoded, meta = cached_rows("rm", fingerprint, ("chosen", "rejected"),
                                {"margin": ("float64", 1)}, encode, tokenizer.vocab_size,
                                on_event=on_cache)
    has_margin = meta["has_margin"]
    train = RewardPairs(encoded, pad_id_of(tokenizer), f"{fingerprint}:train", has_margin,
                        sequence_pad_multiple(config),
                        pack_to=config.model.seq_length if config.rlhf.packing else None,
                        pad_to=(config.model.seq_length
                                if config.world.pipeline_parallel > 1 else None))
    log(f"rlhf data --dataset: {len(encoded)} preference pairs for the reward model"
        + (" with margins" if has_margin else "") + f" (--max_length {max_length})"
        + packing_note(train.pack_to))
    return train, None, None


def reward_fingerprint(config, tokenizer, extra: Optional[dict] = None) -> str:
    """Identity of a reward model's data: the preference data's, its own tokenizing and
    --max_length."""
    identity = {"preference": preference_fingerprint(config, tokenizer), "task": "rm",
                "version": ENCODING_VERSION, "max_length": max_length_of(config),
                **(extra or {})}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
