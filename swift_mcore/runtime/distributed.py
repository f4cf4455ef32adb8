"""Process groups: torch.distributed (nccl with CUDA, gloo without) and megatron's parallel_state."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import cpu_compat

# How long a collective waits for the other ranks before torch.distributed gives up.
TIMEOUT = datetime.timedelta(minutes=30)


def initialize(config) -> None:
    """Create the process group and megatron's model-parallel groups (idempotent).

    A single process started without torchrun gets a one-rank group on a free local port,
    so `python -c 'Trainer(args).train()'` works as well as `swift-mcore pt`.
    """
    cpu_compat.activate()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        for name, value in config.environment:  # before this rank's CUDA context exists
            os.environ.setdefault(name, value)
        if config.cuda:  # each rank on its own GPU, whatever the backend
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # A process the launcher did not start is a one-rank group on a local port, given
        # to torch directly: os.environ stays as it was (a later child process started with
        # plain subprocess must not inherit RANK or MASTER_PORT and think it is a rank).
        alone = "RANK" not in os.environ
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT") or str(_free_port()) if alone else None
        where = f"{addr}:{port}" if alone else (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
        try:
            if alone:
                dist.init_process_group(backend=config.backend, timeout=TIMEOUT,
                                        init_method=f"tcp://{addr}:{port}", rank=0,
                                        world_size=1)
            else:
                dist.init_process_group(backend=config.backend, timeout=TIMEOUT)
        except dist.DistNetworkError as err:  # e.g. a MASTER_PORT another process holds
            from ..errors import ArgumentError

            reason = (str(err).strip().splitlines() or [""])[-1][:200]
            raise ArgumentError(f"the process group cannot start on MASTER_ADDR:MASTER_PORT "
                                f"{where} ({reason}); set MASTER_PORT to a free port, or "
                                f"unset it") from None
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.parallel.pipeline_model_parallel_size,
            # MoE: the experts are split over EP ranks carved out of the data-parallel ones
            # (expert tensor parallelism follows TP, megatron's default).
            expert_model_parallel_size=getattr(config.parallel, "expert_model_parallel_size",
                                               1),
        )


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """Ends a script that trained: process groups shut down, output flushed, then the
    process leaves without interpreter teardown.

    gloo's worker threads occasionally abort the process ("terminate called without an
    active exception") while C++ statics are destroyed at exit, after every output is
    written (docs/architecture.md, "Platform facts"). Ending deliberately keeps the real exit code. The CLI ends this
    way; a script on the Python API should too (examples/custom_trainer.py).
    """
    import os
    import sys

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
