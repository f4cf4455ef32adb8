"""The CPU port of megatron-core: the calls the general code makes, each a no-op on CUDA.

Everything swift-mcore does because a run has no GPU lives in this folder, and the rest of
the package reaches it only through the functions below (tests/test_architecture.py holds
that). Each takes the run's decision about CUDA (``RunConfig.cuda``, or the bool) and does
nothing when it is True. docs/cpu.md says what the port changes and why.

The order a run calls them in:

* ``before_import()``: before megatron is imported (cli.main): its compiled fusions stay
  plain functions.
* ``choose(flags, cuda)``: inside run_config.resolve: the CPU-only decisions, as values the
  RunConfig keeps.
* ``install(config)``: distributed.initialize, before the first process group: megatron's
  CUDA-only spots made to run on the CPU, the eager kernels, the shared gloo device.
* ``after_ddp(chunks, config)``: once DDP has wrapped the model (runtime/ddp.py); the MoE
  layers' dispatchers are switched here too.
* ``after_optimizer(optimizer, config)``: once megatron has built the optimizer.
* ``wrap_forward_step(forward_step, config)``: the trainer's forward step per micro-batch.
* ``context_parallel_attention(config)``: the layer spec's core attention under
  --context_parallel_size (models/gpt.py).
* ``expert_module(config)``: the MoE layer spec's routed experts (models/gpt.py).
* ``after_weights_read(config)``: once a Hugging Face folder's weights are in the model
  (models/hf_load.py).

A new CPU adaptation (another megatron module, kernel or collective) is a module here,
installed by ``install`` or one of the others; the general code does not change.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional


def before_import(cuda: Optional[bool] = None) -> None:
    """Without CUDA, megatron's torch.compile'd fusions become plain functions (eager_fusions.py).
    Runs before megatron is imported, so before any RunConfig exists: ``cuda`` defaults to
    the hardware module's answer. A user's own TORCHDYNAMO_DISABLE is kept either way."""
    from .. import hardware
    from .eager_fusions import eager_fusions_without_cuda

    eager_fusions_without_cuda(hardware.cuda_available() if cuda is None else cuda)


def choose(flags, cuda: bool) -> Dict[str, Any]:
    """The CPU-only decisions of run_config.resolve, as RunConfig fields: ``cpu_matmul``
    (--cpu_matmul resolved: onednn | mkl) and ``trim_host_memory`` (--trim_host_memory where
    the C library can). Empty on CUDA (the fields keep their defaults, None and False).
    Raises ArgumentError naming the flag."""
    if cuda:
        return {}
    from . import host_memory, onednn_linear

    t = flags.training
    return {"cpu_matmul": onednn_linear.choose(t.cpu_matmul),
            "trim_host_memory": bool(t.trim_host_memory and host_memory.available())}


def install(config) -> bool:
    """megatron-core adapted to the CPU (cpu_compat.py), with the linears on the GEMM that
    ``config.cpu_matmul`` chose and checkpoints written without copying every view first
    (checkpoint_writer.py); then, unless a process group exists already, every gloo
    group of this process on one transport device (gloo_device.py). True when the CPU
    adaptation is active."""
    if config.cuda:
        return False
    import torch.distributed as dist

    from . import checkpoint_writer, cpu_compat, gloo_device, onednn_linear

    active = cpu_compat.activate()
    if active:
        onednn_linear.enable(config.cpu_matmul == "onednn")
        checkpoint_writer.install()  # views cloned one at a time while a save writes them
    if not dist.is_initialized():  # before any group: megatron's twenty then share it
        gloo_device.install()
    return active


def after_ddp(chunks, config) -> int:
    """The linears of each DDP-wrapped chunk add their weight gradients straight into DDP's
    ``main_grad`` (cpu_compat.accumulate_weight_gradients_in_place), and its MoE layers'
    alltoall dispatchers skip the cross-rank steps while all experts are local
    (local_dispatch.py). Returns how many linears."""
    if config.cuda:
        return 0
    from .cpu_compat import accumulate_weight_gradients_in_place
    from .local_dispatch import use_local_dispatch

    for chunk in chunks:
        use_local_dispatch(chunk)
    return sum(accumulate_weight_gradients_in_place(chunk) for chunk in chunks)


def after_optimizer(optimizer, config) -> int:
    """megatron's AdamW on torch's fused CPU kernel (fused_adamw.py). Returns the number of
    parameter groups switched."""
    if config.cuda:
        return 0
    from .fused_adamw import use_fused_adamw

    return use_fused_adamw(optimizer)


def context_parallel_attention(config):
    """The core attention of a CPU run with --context_parallel_size > 1: keys and values
    all-gathered over the context-parallel group (all_gather_attention.py), where
    Transformer Engine's ring attention cannot run. None on CUDA or without CP."""
    if config.cuda or config.parallel.context_parallel_size == 1:
        return None
    from .all_gather_attention import GatheredKVAttention

    return GatheredKVAttention


def expert_module(config):
    """The routed experts of a CPU run's MoE layers: megatron's SequentialMLP with every local
    expert in one autograd function (grouped_experts.py; same parameters and checkpoints).
    None on CUDA, where the spec's own experts stay."""
    if config.cuda:
        return None
    from .grouped_experts import GroupedExperts

    return GroupedExperts


def wrap_forward_step(forward_step: Callable, config) -> Callable:
    """``forward_step``, releasing the free heap before each micro-batch where
    ``config.trim_host_memory`` asks for it (host_memory.py); else ``forward_step`` itself."""
    if config.cuda or not config.trim_host_memory:
        return forward_step
    from .host_memory import trimming

    return trimming(forward_step)


def after_weights_read(config) -> bool:
    """Without CUDA the model's weights sit on the host heap among the freed buffers they
    were read through, whose pages glibc keeps resident (a conversion's peak memory is set
    after the read: benchmarks/README.md, "Conversion memory"); those pages are handed back
    (host_memory.py). True if any were."""
    if config.cuda:
        return False
    from .host_memory import release_free_heap

    return release_free_heap()
