"""Packing: conversations grouped into --seq_length rows, and the mask that keeps them apart."""

from __future__ import annotations

import bisect
from typing import List, Optional, Sequence

import torch


def pack(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Groups item indices into rows of at most ``capacity`` positions (best fit, longest
    first). A pure function of ``lengths``: the same data always gives the same rows, which
    is what lets a resumed run find its next row by a counter."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: List[List[int]] = []
    free: List[tuple] = []  # (free positions, row index), sorted
    for i in order:
        need = int(lengths[i])
        if need > capacity:
            raise ValueError(f"item {i} has {need} positions, more than a row's {capacity}")
        k = bisect.bisect_left(free, (need, -1))
        if k < len(free):  # the fullest row that still fits it
            room, row = free.pop(k)
            rows[row].append(i)
            if room - need:
                bisect.insort(free, (room - need, row))
        else:
            rows.append([i])
            if capacity - need:
                bisect.insort(free, (capacity - need, len(rows) - 1))
    return [sorted(row) for row in rows]


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool, True where attention is masked (megatron's
    convention): position i sees j only if j <= i and both lie in the same segment."""
    s = segment_ids.shape[1]
    other = segment_ids[:, :, None] != segment_ids[:, None, :]
    future = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).triu(1)
    return (other | future).unsqueeze(1)


def packed_seq_params(segment_ids: torch.Tensor, device: Optional[torch.device] = None):
    """megatron's PackedSeqParams (THD) for one packed row, for Transformer Engine's
    variable-length attention: cumulative segment lengths, padding counted as a segment.

    Computed where ``segment_ids`` are (give the loader's CPU copy: the lengths and the
    longest one are host numbers, so a GPU copy would make the host wait for the GPU every
    micro-batch); ``device``: where the cumulative lengths go, copied without waiting."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if segment_ids.shape[0] != 1:
        raise ValueError("packed sequences with Transformer Engine need --micro_batch_size 1")
    _, counts = torch.unique_consecutive(segment_ids[0], return_counts=True)
    cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=segment_ids.device)
    cu[1:] = torch.cumsum(counts, 0)
    longest = int(counts.max())
    if device is not None and device != cu.device:
        if device.type == "cuda":
            cu = cu.pin_memory()  # an asynchronous copy needs page-locked memory
        cu = cu.to(device, non_blocking=True)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)
