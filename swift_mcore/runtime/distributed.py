"""Process groups: torch.distributed (nccl with CUDA, gloo without) and megatron's parallel_state."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import cpu, mcore_adaptation

# How long a collective waits for the other ranks before torch.distributed gives up
# (--distributed_timeout_minutes; this default where no RunConfig is at hand).
TIMEOUT = datetime.timedelta(minutes=30)


def timeout_of(config) -> datetime.timedelta:
    """--distributed_timeout_minutes as a timedelta."""
    return datetime.timedelta(minutes=config.parallel.distributed_timeout_minutes)


def initialize(config) -> None:
    """Create the process group and megatron's model-parallel groups (idempotent).

    A single process started without torchrun gets a one-rank group on a free local port,
    so `python -c 'Trainer(args).train()'` works as well as `swift-mcore pt`.
    """
    mcore_adaptation.patch_router_gemm_without_te()
    mcore_adaptation.patch_mla_without_te()
    mcore_adaptation.fix_router_padding_mask()
    if config.model.mtp_num_layers and config.model.num_experts:
        # only where an MTP layer routes: with the wrapper installed, an MoE model without
        # MTP ran 10-15% slower on 2 CPU threads (benchmarks/README.md, MoE section)
        mcore_adaptation.pass_padding_mask_to_mtp_layers()
    mcore_adaptation.place_reshardable_optimizer_state_by_bucket()
    cpu.install(config)  # before any process group
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
        timeout = timeout_of(config)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        # Without MASTER_PORT the store binds port 0, a free port the kernel picks: no
        # window in which another process can take it (two runs at once on one machine).
        port = os.environ.get("MASTER_PORT") or "0" if alone else None
        where = f"{addr}:{port}" if alone else (
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
        if alone and not (port.isdigit() and int(port) < 65536):
            from ..errors import ArgumentError

            raise ArgumentError(f"MASTER_PORT={port!r}: a port number (0 to 65535), or unset it")
        try:
            if alone:
                store = dist.TCPStore(addr, int(port), world_size=1, is_master=True,
                                      timeout=timeout, wait_for_workers=False)
                dist.init_process_group(backend=config.backend, timeout=timeout, store=store,
                                        rank=0, world_size=1)
            elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                dist.init_process_group(backend=config.backend, timeout=timeout,
                                        store=attempt_store(rank, world, timeout),
                                        rank=rank, world_size=world)
            else:
                dist.init_process_group(backend=config.backend, timeout=timeout)
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
            # ranks that share each sequence; the data-parallel ones are what remains
            context_parallel_size=config.parallel.context_parallel_size,
            # the interleaved schedule's model chunks per pipeline rank (None: plain PP)
            virtual_pipeline_model_parallel_size=config.args.virtual_stages(),
            # MoE: the experts are split over EP ranks carved out of the data-parallel ones,
            # and each over --expert_tensor_parallel_size ranks (None: TP's, megatron's
            # default)
            expert_model_parallel_size=config.parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=config.parallel.expert_tensor_parallel_size,
            # megatron's groups wait as long as the default one (timedelta(minutes=...)
            # takes the fraction as it is).
            distributed_timeout_minutes=config.parallel.distributed_timeout_minutes,
        )


# In torchrun's store: "host port token" of the store of the running attempt.
STORE_KEY = "swift_mcore/attempt_store"


def attempt_store(rank: int, world: int, timeout: datetime.timedelta):
    """A store of this attempt's own for the process group, hosted by rank 0.

    torchrun's c10d rendezvous hands every attempt of a restarted group the same store, its
    agent's (TORCHELASTIC_USE_AGENT_STORE=True, one MASTER_PORT for all attempts), and the
    keys the dead attempt's process group left there stay: gloo then reads a dead rank's
    address and fails with "connectFullMesh ... Connection refused" (torch issue #135712;
    TORCHELASTIC_RESTART_COUNT cannot tell the attempts apart, as the agents of several
    nodes count differently). Rank 0 therefore starts a fresh store on a free port and
    publishes it, with a random token, in the agent's store. A rank that reads a previous
    attempt's entry cannot reach it (torchrun ends every worker of an attempt before it
    starts the next one) or finds another token, and reads again.
    """
    import time
    import uuid

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(addr, port, world_size=world, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(addr, 0, world_size=world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set("token", token)
        agent.set(STORE_KEY, f"{addr} {store.port} {token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, store_port, token = agent.get(STORE_KEY).decode().split()
        try:
            store = dist.TCPStore(host, int(store_port), world_size=world, is_master=False,
                                  timeout=datetime.timedelta(seconds=2))
            if store.get("token").decode() == token:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, dist.DistError):  # a previous attempt's store: gone
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0's process-group store never appeared "
                               f"in torchrun's store {addr}:{port}")
        time.sleep(0.2)


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
    written (docs/cpu.md, "Platform facts"). Ending deliberately keeps the real exit code. The CLI ends this
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
