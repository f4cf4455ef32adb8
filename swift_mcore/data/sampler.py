"""The global sample order: position -> dataset index, and which rank reads which.

Iteration ``i`` consumes the global positions ``[i*GBS, (i+1)*GBS)``. Two orders
(``--data_order``):

- ``resumable`` (the default, ``GlobalOrder``): position ``p`` lies in epoch ``p // len`` and
  maps to ``perm_epoch[p % len]``, a permutation that depends only on (seed, epoch), over a
  one-epoch dataset. Data-parallel rank ``r`` reads the ``r``-th contiguous slice of each
  global batch. Nothing depends on --train_iters.
- ``megatron`` (``SequentialOrder``): Megatron-LM's. Its GPTDataset is built for
  ``train_iters x GBS`` samples and already shuffled (over all its epochs); its
  MegatronPretrainingSampler reads it in sequence from ``consumed_samples``, in chunks of
  ``MBS x DP`` of which rank ``r`` takes the ``r``-th micro-batch. Position ``p`` is sample
  ``p``; no permutation is added.

Either way the samples of a global batch do not depend on the number of ranks, and
resuming from ``consumed_samples`` is a jump, not a replay of skipped batches.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, List

import numpy as np


class GlobalOrder:
    """Global position -> dataset index, over an unbounded number of epochs."""

    _KEEP_EPOCHS = 2  # a global batch can straddle an epoch boundary; older ones are not revisited

    def __init__(self, dataset_len: int, seed: int):
        if dataset_len <= 0:
            raise ValueError(f"cannot order an empty dataset (length {dataset_len})")
        self.dataset_len = int(dataset_len)
        self.seed = int(seed)
        self._perms: "OrderedDict[int, np.ndarray]" = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            # A fresh generator per (seed, epoch): epoch e never depends on having drawn e-1.
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len)
            if self.dataset_len <= np.iinfo(np.uint32).max:
                perm = perm.astype(np.uint32)  # half the memory of int64
            self._perms[epoch] = perm
            while len(self._perms) > self._KEEP_EPOCHS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def __getitem__(self, position: int) -> int:
        if position < 0:
            raise IndexError(f"global positions start at 0, got {position}")
        epoch, offset = divmod(int(position), self.dataset_len)
        return int(self.permutation(epoch)[offset])

    def __getstate__(self):
        # DataLoader workers rebuild the permutations they need rather than receive copies.
        return {"dataset_len": self.dataset_len, "seed": self.seed}

    def __setstate__(self, state):
        self.__init__(state["dataset_len"], state["seed"])


class SequentialOrder:
    """Megatron-LM's order: position ``p`` is sample ``p`` of a dataset that megatron already
    shuffled. Past its end (Megatron-LM's sampler would stop) the positions wrap around."""

    def __init__(self, dataset_len: int):
        if dataset_len <= 0:
            raise ValueError(f"cannot order an empty dataset (length {dataset_len})")
        self.dataset_len = int(dataset_len)

    def __getitem__(self, position: int) -> int:
        if position < 0:
            raise IndexError(f"global positions start at 0, got {position}")
        return int(position) % self.dataset_len


def micro_batches(consumed_samples: int, micro_batch_size: int, global_batch_size: int,
                  dp_rank: int = 0, dp_size: int = 1, interleaved: bool = False
                  ) -> Iterator[List[int]]:
    """Global positions of this rank's micro-batches, forever, from ``consumed_samples`` on.

    Global batch ``k`` (counting from the start of training) covers ``[k*GBS, (k+1)*GBS)``;
    rank ``r`` takes ``[k*GBS + r*GBS/dp, k*GBS + (r+1)*GBS/dp)`` in micro-batches of MBS.
    ``interleaved`` (``--data_order megatron``): MegatronPretrainingSampler's layout instead,
    micro-batch ``m`` of rank ``r`` is ``[k*GBS + (m*dp + r)*MBS, ... + MBS)``.
    The arguments are checked at the call, not at the first ``next``.
    """
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("global_batch_size", global_batch_size), ("dp_size", dp_size)):
        if int(value) <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"global_batch_size ({global_batch_size}) must be a multiple of "
                         f"micro_batch_size ({micro_batch_size}) x dp_size ({dp_size})")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    if consumed_samples < 0 or consumed_samples % global_batch_size:
        raise ValueError(f"consumed_samples ({consumed_samples}) must be a non-negative multiple "
                         f"of global_batch_size ({global_batch_size}): a run resumes only at "
                         f"an iteration boundary")
    if interleaved:
        return _interleaved(consumed_samples, micro_batch_size, dp_rank, dp_size)
    return _positions(consumed_samples, micro_batch_size, global_batch_size // dp_size,
                      global_batch_size, dp_rank)


def _interleaved(consumed_samples, micro_batch_size, dp_rank, dp_size):
    # Each chunk of MBS x DP consecutive positions is one micro-batch per rank (a global
    # batch is a whole number of chunks, so batch boundaries stay where they are).
    start = consumed_samples + dp_rank * micro_batch_size
    while True:
        yield list(range(start, start + micro_batch_size))
        start += micro_batch_size * dp_size


def _positions(batch_start, micro_batch_size, per_rank, global_batch_size, dp_rank):
    while True:
        first = batch_start + dp_rank * per_rank
        for start in range(first, first + per_rank, micro_batch_size):
            yield list(range(start, start + micro_batch_size))
        batch_start += global_batch_size
