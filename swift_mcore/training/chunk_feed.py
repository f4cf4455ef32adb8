"""The interleaved pipeline's micro-batches: each model chunk of a rank reads the same
micro-batches in the same order, from one data iterator read once per micro-batch."""

from __future__ import annotations

from typing import Callable, List


class ChunkFeed:
    """What megatron's interleaved schedule hands one model chunk as its data iterator
    (``data_iterator[chunk]``). The chunks run the iteration's micro-batches in an
    interleaved order, each in order 0, 1, ...; the first chunk to need micro-batch k reads
    it (through the trainer's ``get_batch``, so the sample audit sees it once) and the others
    take the same batch."""

    def __init__(self, source, shared: list):
        self.source, self.shared, self.taken = source, shared, 0

    @classmethod
    def for_chunks(cls, source, chunks: int) -> List["ChunkFeed"]:
        shared: list = []  # this forward-backward call's micro-batches, in order
        return [cls(source, shared) for _ in range(chunks)]

    def next_batch(self, get_batch: Callable):
        if self.taken == len(self.shared):
            self.shared.append(get_batch(self.source))
        batch = self.shared[self.taken]
        self.taken += 1
        return batch
