"""Wraps model chunks in megatron's bucketed DistributedDataParallel, and finds the model
inside such wrappers again."""

from __future__ import annotations

import contextlib
import math
from typing import List

import torch

from . import cpu


def bucket_size_for(config, models) -> int | None:
    """--bucket_size if given, else ceil(trainable parameters / --num_buckets), else None
    (megatron's default)."""
    p = config.parallel
    if p.bucket_size is not None:
        return p.bucket_size
    if p.num_buckets is None:
        return None
    trainable = sum(q.numel() for m in models for q in m.parameters() if q.requires_grad)
    return math.ceil(trainable / p.num_buckets)


def wrap_model(config, models: List[torch.nn.Module], wrap_with_ddp: bool = True) -> list:
    """Returns the list of model chunks, DDP-wrapped unless ``wrap_with_ddp`` is False.

    Bucketing applies to the first chunk only (megatron itself turns it off on pipeline
    stages after the first), so later chunks reduce their gradients in one piece.
    """
    if not isinstance(models, (list, tuple)):
        models = [models]
    models = list(models)
    if not wrap_with_ddp:
        return models

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    p = config.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.training.bf16 or config.training.fp16,
        overlap_grad_reduce=p.overlap_grad_reduce,
        # the weights' all-gather in the next forward's pre-hooks (sync_weights before a
        # save), aligned over the pipeline stages by the trainer's param_sync_func
        overlap_param_gather=p.overlap_param_gather,
        align_param_gather=p.align_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=bucket_size_for(config, models),
        fp8_param_gather=config.training.fp8_param_gather,
    )
    cuda = config.cuda
    # On GPU, DDP is built on a side stream (as Megatron-LM does) so that its buffer
    # allocations do not serialize with work queued on the default stream.
    stream = torch.cuda.Stream() if cuda else None
    context = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
    if cuda:
        stream.wait_stream(torch.cuda.current_stream())
    with context:
        wrapped = [
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(models)
        ]
    if cuda:
        torch.cuda.current_stream().wait_stream(stream)
    cpu.after_ddp(wrapped, config)
    return wrapped


def sync_weights(config, chunks) -> None:
    """Under --overlap_param_gather the distributed optimizer's step updates only this
    rank's shard of the weights, and the next forward pass all-gathers the rest: before
    anything reads the weights outside a forward pass (a checkpoint) they are all-gathered
    now (megatron's forced param sync; the next forward then gathers nothing again)."""
    if not config.parallel.overlap_param_gather:
        return
    for chunk in chunks:
        chunk.start_param_sync(force_sync=True)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside megatron's DDP / Float16Module wrappers (megatron-LM stores the
    unwrapped keys: ``decoder.layers...``, not ``module.decoder...``)."""
    while type(chunk).__name__ in ("DistributedDataParallel", "Float16Module",
                                   "FullyShardedDataParallel") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

