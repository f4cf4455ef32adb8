"""megatron's checkpoint writer on the CPU, copying each view of a tensor only while it is written.

megatron-core 0.16.1's ``FileSystemWriterAsync.prepare_write_data`` (filesystem_async.py
136-166) clones every CPU tensor that is a view into a larger storage, so that ``torch.save``
writes the view's elements and not the whole storage. It does so for every bucket before
the first byte is written: the two halves of each SwiGLU ``linear_fc1`` weight (megatron's
``apply_swiglu_sharded_factory`` saves them as two views) are all copied at once, about half
of a mixture-of-experts model's weights on top of the model at the peak of a save (export
--to_mcore of 1.1 GB of weights: 2.04 GB resident). On a GPU the tensors are on the device
and the copy to the host happens per tensor anyway, so only a run without CUDA needs this.

``LazyCloneWriter`` makes the same buckets in the same order from the views themselves;
each view is cloned (megatron's rule and call) in the writing loop, right before
``torch.save``, and dropped after it: at most two clones per writer process at a time. The
files are megatron's, byte for byte (tests/checkpointing/test_checkpoint_writer.py).
``install()`` makes megatron's torch_dist save strategy use it.
"""

from __future__ import annotations

import functools
import os
from typing import Iterator, List, Tuple

import torch

_INSTALLED = False


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def is_partial_view(tensor: torch.Tensor) -> bool:
    """megatron's test for a clone: a CPU tensor whose storage holds more than its elements
    (``torch.save`` would write the whole storage)."""
    return (tensor.device.type == "cpu"
            and tensor.untyped_storage().size() != tensor.numel() * tensor.itemsize)


class ClonedWhileRead:
    """A bucket's (write item, tensor) pairs; iterating yields each partial view as a fresh
    clone, so only the pair being written holds one."""

    def __init__(self, pairs: List[Tuple[object, torch.Tensor]]):
        self.pairs = pairs
        self.owner = os.getpid()

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator[Tuple[object, torch.Tensor]]:
        if os.getpid() != self.owner:
            # megatron's forked writer process: the parent's OpenMP pool did not survive the
            # fork, and a parallel clone would wait on it forever
            torch.set_num_threads(1)
        for item, tensor in self.pairs:
            yield item, (tensor.clone() if is_partial_view(tensor) else tensor)


@functools.lru_cache(maxsize=None)
def writer_class():
    """The LazyCloneWriter class (made on first use: it subclasses a megatron class)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyCloneWriter(fa.FileSystemWriterAsync):
        """FileSystemWriterAsync whose buckets hold the views, cloned while written."""

        def prepare_write_data(self, plan, planner) -> None:
            if self.separation_hint:
                assert self.thread_count > 1, \
                    "thread_count must be at least 2 if separation_hint is provided"
            bins = self.thread_count // 2 if self.separation_hint is not None \
                else self.thread_count
            grouped = fa._split_by_separation_hint(
                fa._split_by_size_and_type(bins, plan.items), self.separation_hint)
            prefix = plan.storage_data.prefix
            self.write_buckets = []
            for group_name, buckets in grouped.items():
                for bucket in buckets:
                    byte_items = [(item, planner.resolve_data(item)) for item in bucket
                                  if item.type == WriteItemType.BYTE_IO]
                    tensor_items = [(item, _detached(planner.resolve_data(item)))
                                    for item in bucket if item.type != WriteItemType.BYTE_IO]
                    if not byte_items and not tensor_items:
                        continue
                    # the file names megatron gives: one counter over all groups
                    name = f"{group_name}{prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                    self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name,
                                               (byte_items, ClonedWhileRead(tensor_items))))
            assert len(self.write_buckets) <= self.thread_count, \
                (len(self.write_buckets), self.thread_count)
            # through the module, so a caller's replacement of the queue factory holds
            self.results_queue = fa._get_write_results_queue() if self.write_buckets else None

        @staticmethod
        def preload_tensors(write_buckets, non_blocking=True):
            """CPU tensors need no staging; a bucket with a device tensor gets megatron's."""
            staged = []
            for bucket in write_buckets:
                tensors = bucket[2][1]
                if all(t.device.type == "cpu" for _, t in getattr(tensors, "pairs", tensors)):
                    staged.append(bucket)
                else:
                    staged.extend(fa.FileSystemWriterAsync.preload_tensors(
                        [bucket], non_blocking))
            return staged

    return LazyCloneWriter


def install() -> None:
    """megatron's torch_dist save strategy writes through ``LazyCloneWriter`` (its module's
    ``FileSystemWriterAsync`` name; the class itself is unchanged for anyone else)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    torch_strategy.FileSystemWriterAsync = writer_class()
    _INSTALLED = True
