"""A micro-batch's sequences laid into rows: one right-padded row each, or with --packing end
to end in rows of at most --seq_length positions, each position tagged with its sequence.

Shared by rlhf's datasets (pairs, unpaired KTO rows, a reward model's pairs): the losses
are sums per sequence, so where a sequence sits changes no number, only the padding
computed. Packed rows carry ``segment_ids`` (each position's sequence index, -1 padding),
which keeps the sequences apart in attention (packing.block_causal_mask) and sums each
one's values (training.rlhf_trainer.sequence_sums); position ids restart per sequence.
Every row carries ``padding_mask`` (True past its last real position), which the MoE router
reads to leave padding out of its statistics (training/moe_padding.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


def lay_out(seqs: Sequence[np.ndarray], pad_id: int, masks: Optional[Sequence[np.ndarray]] = None,
            *, shift: bool = True, pack_to: Optional[int] = None, pad_multiple: int = 1,
            pad_to: Optional[int] = None) -> Tuple[Dict[str, torch.Tensor], List[Tuple[int, int]]]:
    """(batch, places): ``seqs`` (token-id arrays) in rows, and each sequence's (row, first
    position).

    ``shift``: a sequence of n tokens takes n - 1 positions, the model reading ids[:-1] and
    predicting ids[1:] (``labels``, and ``loss_mask`` from ``masks[1:]``); without it, n
    positions of ``tokens`` only (a reward model reads whole sequences). ``pack_to``: pack
    best fit (packing.pack) into rows of at most that many positions. ``pad_to``: every
    row's width (pipeline stages exchange one fixed shape); ``pad_multiple``: widths
    rounded up to it."""
    lengths = [len(s) - 1 if shift else len(s) for s in seqs]
    if pack_to is None:
        rows = [[k] for k in range(len(seqs))]
    else:
        from .packing import pack

        rows = pack(lengths, pack_to)
    width = max(sum(lengths[k] for k in row) for row in rows)
    if pad_to is not None:
        width = pad_to
    width = -(-width // pad_multiple) * pad_multiple
    shape = (len(rows), width)
    batch = {"tokens": torch.full(shape, pad_id, dtype=torch.long),
             "position_ids": torch.zeros(shape, dtype=torch.long)}
    if shift:
        batch.update(labels=torch.full(shape, pad_id, dtype=torch.long),
                     loss_mask=torch.zeros(shape, dtype=torch.float),
                     # every real position, prompt included (ORPO's NLL is over all of them)
                     sequence_mask=torch.zeros(shape, dtype=torch.float))
    if pack_to is not None:
        batch["segment_ids"] = torch.full(shape, -1, dtype=torch.long)
    places: List[Tuple[int, int]] = [(0, 0)] * len(seqs)
    for r, row in enumerate(rows):
        start = 0
        for k in row:
            n = lengths[k]
            ids = torch.from_numpy(np.asarray(seqs[k]).astype(np.int64))
            where = (r, slice(start, start + n))
            batch["position_ids"][where] = torch.arange(n)
            if shift:
                batch["tokens"][where] = ids[:-1]
                batch["labels"][where] = ids[1:]
                if masks is not None:
                    batch["loss_mask"][where] = torch.from_numpy(
                        np.asarray(masks[k])[1:].astype(np.float32))
                batch["sequence_mask"][where] = 1.0
            else:
                batch["tokens"][where] = ids
            if pack_to is not None:
                batch["segment_ids"][where] = k
            places[k] = (r, start)
            start += n
    batch["padding_mask"] = padding_mask([sum(lengths[k] for k in row) for row in rows], width)
    return batch, places


def padding_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width] bool, True at the padding of rows right-padded from ``lengths`` (the
    convention of megatron's ``padding_mask``: True is left out of MoE routing statistics)."""
    return torch.arange(width).unsqueeze(0) >= torch.as_tensor(lengths).unsqueeze(1)


def packing_note(pack_to: Optional[int]) -> str:
    """What the data log line says of a dataset's layout (empty when it pads)."""
    if pack_to is None:
        return ""
    return f"; --packing: each micro-batch's sequences end to end in rows of {pack_to} positions"
