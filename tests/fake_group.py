"""A process group seen from one of its ranks, for tests that play several ranks in one process."""

from __future__ import annotations


class GroupRank:
    """What megatron asks of a group here: its size and this rank's place in it."""

    def __init__(self, rank: int, size: int = 2):
        self.r, self.n = rank, size

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r
