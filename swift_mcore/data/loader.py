"""Micro-batch iterators over a dataset, positioned by the consumed-samples counter."""

from __future__ import annotations

import atexit
import weakref
from typing import Dict, Iterator, List, Optional

import torch

from .sampler import GlobalOrder, SequentialOrder, micro_batches

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


class _PositionedSamples(torch.utils.data.Dataset):
    """Map-style view keyed by global position; the dataset index comes from the order.

    Each item is a pure function of its position, so the number of workers (and which
    worker reads what) cannot change a batch.
    """

    def __init__(self, dataset, order):
        self.dataset = dataset
        self.order = order

    def __getitem__(self, position: int):
        return self.dataset[self.order[position]], position


class _Collate:
    """Stacks fixed-length pretraining samples, or hands rows to the dataset's own
    ``collate`` (finetuning rows differ in length); adds the global positions."""

    def __init__(self, dataset):
        self.collate = getattr(dataset, "collate", None)

    def __call__(self, items) -> Dict[str, torch.Tensor]:
        samples = [sample for sample, _ in items]
        if self.collate is not None:
            batch = self.collate(samples)
        else:
            batch = {name: torch.stack([torch.as_tensor(s[name]) for s in samples])
                     for name in FIELDS}
            for name in ("tokens", "labels", "position_ids"):
                batch[name] = batch[name].long()
            batch["loss_mask"] = batch["loss_mask"].float()
        batch["sample_ids"] = torch.tensor([position for _, position in items],
                                           dtype=torch.int64)
        return batch


class _BatchPositions:
    """The batch_sampler: an iterable over this rank's micro-batches of global positions."""

    def __init__(self, *args):
        micro_batches(*args)  # checks the arguments here, in the main process
        self.args = args

    def __iter__(self) -> Iterator[List[int]]:
        return micro_batches(*self.args)


def ignore_stop_signals(_worker_id: int) -> None:
    """In a loader worker: SIGTERM and SIGINT are the trainer's to handle. A stop signal sent
    to the whole process group (Slurm, torchrun, Ctrl-C in a terminal) would otherwise end
    the workers first, and the trainer's next batch would raise instead of the run saving
    and stopping; the workers end with the trainer (or when it dies, on their own)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_data_iterator(dataset, consumed_samples: int, config, dp_rank: int = 0,
                        dp_size: int = 1, seed_offset: int = 0) -> Optional[Iterator[dict]]:
    """An endless iterator of micro-batch dicts, starting at ``consumed_samples``.

    Each dict: ``tokens``, ``labels``, ``position_ids`` [mbs, seq] int64, ``loss_mask``
    [mbs, seq] float32 and ``sample_ids`` [mbs] int64, the global positions (for audit logs).
    Returns None for a missing or empty dataset (e.g. a split of size 0).
    ``seed_offset`` gives another stream its own order (e.g. validation). With
    ``--data_order megatron`` the dataset's own order is read in sequence (sampler.py).
    """
    if dataset is None or len(dataset) == 0:
        return None
    megatron_order = config.data.data_order == "megatron"
    order = (SequentialOrder(len(dataset)) if megatron_order
             else GlobalOrder(len(dataset), config.training.seed + seed_offset))
    workers = int(config.data.num_workers)
    loader = torch.utils.data.DataLoader(
        _PositionedSamples(dataset, order),
        batch_sampler=_BatchPositions(consumed_samples, config.training.micro_batch_size,
                                      config.training.global_batch_size, dp_rank, dp_size,
                                      megatron_order),
        collate_fn=_Collate(dataset),
        num_workers=workers,
        persistent_workers=workers > 0,
        worker_init_fn=ignore_stop_signals if workers > 0 else None,
        prefetch_factor=2 if workers > 0 else None,
        pin_memory=config.cuda,
        # Its own generator: iter() draws the workers' base seed from it, not from the global
        # torch RNG, which a resumed run has just restored (the dropout stream).
        generator=torch.Generator().manual_seed(config.training.seed + seed_offset),
    )
    iterator = iter(loader)
    if workers > 0:
        close_workers_at_exit(iterator)
    return iterator


def close_workers_at_exit(iterator) -> None:
    """Ends ``iterator``'s workers when the interpreter exits, before multiprocessing joins
    its children.

    At exit, multiprocessing stops daemonic children with SIGTERM and then joins them. Our
    workers ignore SIGTERM (``ignore_stop_signals``), so a process that leaves through
    interpreter teardown while an iterator is alive would wait on them forever. That
    happens after an uncaught exception in the CLI, or when an API script returns without
    ``exit_process``; the trainer's own SIGTERM handler then keeps ``kill`` from ending it
    too. torch's shutdown hands each worker its end-of-work sentinel, which the worker
    obeys whatever its signal handlers. Registered after torch's and multiprocessing's own
    exit hooks, so it runs before them.
    """
    ref = weakref.ref(iterator)

    def close() -> None:
        alive = ref()
        shutdown = getattr(alive, "_shutdown_workers", None)  # torch's, also run by __del__
        if shutdown is not None:
            shutdown()

    atexit.register(close)

