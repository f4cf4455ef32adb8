"""Adapts megatron-core 0.16.1's CUDA-only spots to run on CPU (gloo).

megatron-core hard-codes CUDA in a handful of spots (PATCHED_MODULES lists each with its
file:line; docs/cpu.md): factory calls with ``device='cuda'`` or ``device=torch.cuda.current_device()``,
``torch.cuda.synchronize()``/streams, and one ``'torch.cuda.FloatTensor'`` assert. Rather
than copying megatron functions, each affected megatron module gets a private ``torch``
name that points to a thin proxy: identical to ``torch`` except that CUDA devices become
the CPU and CUDA-only calls become no-ops. Everything else in torch is untouched.

``activate()`` is a no-op when CUDA is available (the CPU port's ``install`` calls it only
for a run without CUDA), and refuses a megatron-core version this
module was not tested against (unless SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from . import distributed_optimizer, gated_delta_rule
from ..mcore_adaptation import (
    ModuleProxy,
    fix_router_padding_mask,
    patch_mla_without_te,
    patch_router_gemm_without_te,
    require_tested_version,
)


# module -> why it needs the proxy (file:line in megatron-core 0.16.1)
PATCHED_MODULES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "RoPE moves inv_freq to torch.cuda.current_device() (160-162)",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding":
        "YaRN RoPE (multi-latent attention) moves its frequencies to the CUDA device (120-126)",
    "megatron.core.models.common.embeddings.rope_utils":
        "--context_parallel_size: the index of this rank's RoPE chunks, pinned (62-64)",
    "megatron.core.utils": "GlobalMemoryBuffer allocates on the CUDA device (631)",
    "megatron.core.distributed.param_and_grad_buffer":
        "grad/param buffers on the CUDA device, streams (417-806)",
    "megatron.core.distributed.distributed_data_parallel": "communication stream (230)",
    "megatron.core.optimizer.optimizer": "FP32Optimizer._scale on 'cuda' (907)",
    "megatron.core.optimizer.distrib_optimizer":
        "--use_distributed_optimizer: state shards allocated on the CUDA device when loading "
        "(791), the gather of the state for a checkpoint (1077-1106)",
    "megatron.core.optimizer.clip_grads": "norm buffers on 'cuda' (90-207)",
    "megatron.core.pipeline_parallel.schedules": "token counter on 'cuda' (596, 983, 2138)",
    "megatron.core.pipeline_parallel.p2p_communication":
        "receive buffers on the CUDA device, synchronize (313, 398)",
    "megatron.core.tensor_parallel.mappings":
        "all-gather buffers on the CUDA device (181); uneven all_gather/reduce_scatter of the "
        "MoE dispatchers with TP (150, 193), which gloo refuses",
    "megatron.core.transformer.utils": "default causal mask built on 'cuda' (35)",
    "megatron.core.transformer.dot_product_attention":
        "the learnable softmax offset (attention sinks) created on the CUDA device (121-135)",
    "megatron.core.tensor_parallel.layers":
        "weight-grad buffers on the CUDA device (552); the placeholder weight gradients of "
        "gradient_accumulation_fusion (589-606)",
    "megatron.core.tensor_parallel.random":
        "CUDA RNG seeding in the tracker; activation recompute saves the CUDA RNG state (55)",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize (230)",
    "megatron.core.dist_checkpointing.strategies.async_utils":
        "--async_save: synchronize before the fork (212), the done/finalize counters on the "
        "CUDA device (165, 604)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "synchronize (252)",
    # mixture of experts (--num_experts)
    "megatron.core.transformer.moe.token_dispatcher":
        "the all-to-all dispatcher's device-to-host copy stream (445)",
    "megatron.core.transformer.moe.router":
        "router weight moved to torch.cuda.current_device(), expert-bias buffers (90, 169-198)",
    "megatron.core.transformer.moe.moe_utils":
        "aux-loss tracker values on 'cuda' (998), ReduceOp.AVG that gloo lacks (946)",
    "megatron.core.transformer.moe.shared_experts": "the overlapped shared expert's stream (123)",
    # multi-token prediction (--mtp_num_layers)
    "megatron.core.transformer.multi_token_prediction":
        "MTP loss tracker values on torch.cuda.current_device() (337), ReduceOp.AVG over the "
        "data-parallel ranks that gloo lacks (359)",
}

_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor",
)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _redirect(fn):
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        # pinned memory needs an accelerator's allocator: without one torch refuses it
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "factory")
    return call


class _NoEvent:
    """Stands in for a recorded torch.cuda.Event (the MoE all-to-all dispatcher waits on
    one, token_dispatcher.py:899)."""

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _NoStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NoEvent()


class _CpuCudaRandom:
    """torch.cuda.random without CUDA: there is no CUDA generator, so its state is empty.
    Activation recompute (megatron's CheckpointFunction) saves it next to the CPU state;
    dropout on CPU draws from torch's CPU generator, whose state it saves and restores
    itself, so the recomputed forward draws the same masks."""

    def __getattr__(self, name):
        return getattr(torch.cuda.random, name)

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.empty(0, dtype=torch.uint8)


class _CpuCuda:
    """torch.cuda as seen by a patched megatron module on a machine without CUDA."""

    Stream = _NoStream
    random = _CpuCudaRandom()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args, **kwargs):
        return _NoStream()

    @staticmethod
    def default_stream(*args, **kwargs):
        return _NoStream()

    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def manual_seed(seed):
        # The default CPU generator is seeded by runtime.seed; megatron's call is redundant.
        pass


class _GlooDistributed(ModuleProxy):
    """torch.distributed for a patched module: gloo has no ReduceOp.AVG (the MoE aux-loss
    tracker averages over the data-parallel ranks with it, moe_utils.py:946), so AVG is
    a SUM divided by the group's size. gloo's all_gather and reduce_scatter also need
    every rank's piece to have one size; with TP and sequence parallelism megatron's MoE
    token dispatchers gather and reduce-scatter the routed tokens, a different number per
    rank (mappings.py:150 and 193, from token_dispatcher.py). Those pieces are padded to
    the longest, exchanged, and cut back: the same values."""

    MODULE = torch.distributed

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list}) <= 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group,
                                                async_op=async_op)
        gathered = [torch.empty_like(t) for t in _padded(tensor_list)]
        torch.distributed.all_gather(gathered, _padded([tensor], gathered[0].shape[0])[0],
                                     group=group)
        for out, piece in zip(tensor_list, gathered):
            out.copy_(piece[: out.shape[0]])
        return _NoEvent() if async_op else None

    @staticmethod
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None,
                       async_op=False):
        if len({t.shape for t in input_list}) <= 1:
            return torch.distributed.reduce_scatter(output, input_list, op=op, group=group,
                                                    async_op=async_op)
        pieces = _padded(input_list)
        reduced = torch.empty_like(pieces[0])
        torch.distributed.reduce_scatter(reduced, pieces, op=op, group=group)
        output.copy_(reduced[: output.shape[0]])
        return _NoEvent() if async_op else None

    @staticmethod
    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if op == torch.distributed.ReduceOp.AVG:
            torch.distributed.all_reduce(tensor, group=group)
            tensor.div_(torch.distributed.get_world_size(group))
            return _NoEvent() if async_op else None  # done already: wait() has nothing to do
        return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _padded(tensors, length=None):
    """Each tensor zero-padded along dim 0 to ``length`` (default: the longest)."""
    length = max(t.shape[0] for t in tensors) if length is None else length
    out = []
    for t in tensors:
        piece = t.new_zeros((length, *t.shape[1:]))
        piece[: t.shape[0]] = t
        out.append(piece)
    return out


class _CpuTorch(ModuleProxy):
    """A ``torch`` look-alike whose CUDA devices are the CPU."""

    MODULE = torch
    cuda = _CpuCuda()
    distributed = _GlooDistributed()

    def __init__(self):
        for name in _FACTORIES:
            setattr(self, name, _redirect(getattr(torch, name)))


_ACTIVE = False


def needed() -> bool:
    from .. import hardware

    return not hardware.cuda_available()


def check_version() -> str:
    return require_tested_version(
        "CPU adaptation", "run on a CUDA machine, or set SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1 "
        "to try anyway.")


def activate() -> bool:
    """Install the CPU adaptation if there is no CUDA. Returns True when it is active."""
    global _ACTIVE
    patch_router_gemm_without_te()  # a GPU without Transformer Engine needs it too
    patch_mla_without_te()
    fix_router_padding_mask()
    if not needed():
        return False
    if _ACTIVE:
        return True
    check_version()
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = proxy
    _patch_clip_grads()
    _patch_shared_embedding_setup()
    _patch_split_sizes_to_host()
    _patch_cuda_rng_restore()
    _patch_checkpoint_without_output()
    _install_weight_gradient_accumulation()
    _install_eager_rope()
    _patch_cp_rope_index()
    _install_eager_cross_entropy()
    _install_onednn_linear()
    gated_delta_rule.install(proxy)
    distributed_optimizer.install()
    _ACTIVE = True
    return True


def active() -> bool:
    """Whether activate() installed the adaptation in this process."""
    return _ACTIVE


def _install_eager_rope():
    """RoPE without TE runs megatron's unfused ``_apply_rotary_pos_emb_bshd`` (rope_utils.py
    92-126), looked up by name on each call from ``apply_rotary_pos_emb``: on CPU it becomes
    eager_rope.py's, which gives the same values without the copies."""
    from megatron.core.models.common.embeddings import rope_utils

    from .eager_rope import make_apply_rotary_bshd

    original = rope_utils._apply_rotary_pos_emb_bshd
    if not hasattr(original, "_swift_mcore_original"):
        rope_utils._apply_rotary_pos_emb_bshd = make_apply_rotary_bshd(original)


def _patch_cp_rope_index():
    """Under --context_parallel_size RoPE keeps this rank's two chunks of its table with
    ``rope_utils.get_pos_emb_on_this_cp_rank``, whose chunk index is moved to the GPU with
    ``.cuda()`` (rope_utils.py:62-64; the module's torch is the proxy, which makes its pinned
    tensor a plain one): that call leaves it on the CPU, where the table is. YaRN's module
    (multi-latent attention) holds its own reference to the function."""
    from megatron.core.models.common.embeddings import (
        rope_utils,
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    from .distributed_optimizer import _within, cuda_moves_stay_on_cpu

    original = rope_utils.get_pos_emb_on_this_cp_rank
    if hasattr(original, "_swift_mcore_original"):
        return
    wrapped = _within(cuda_moves_stay_on_cpu, original)
    rope_utils.get_pos_emb_on_this_cp_rank = wrapped
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = wrapped
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = wrapped


def _install_eager_cross_entropy():
    """The language-model loss is ``tensor_parallel.vocab_parallel_cross_entropy``, looked
    up on the package at each call (language_module.py:167): on CPU it becomes
    eager_cross_entropy.py's, which with one TP rank takes fewer passes over the
    logits and hands every other case to megatron's."""
    from megatron.core import tensor_parallel

    from .eager_cross_entropy import make_cross_entropy

    original = tensor_parallel.vocab_parallel_cross_entropy
    if not hasattr(original, "_swift_mcore_original"):
        tensor_parallel.vocab_parallel_cross_entropy = make_cross_entropy(original)


def _install_onednn_linear():
    """megatron's linears apply ``LinearWithGradAccumulationAndAsyncCommunication`` and,
    for a frozen weight, ``LinearWithFrozenWeight``, both looked up in layers.py at each call
    (745, 440): on CPU they become onednn_linear.py's, which multiply on oneDNN when
    --cpu_matmul chose it (distributed.initialize) and hand every call to megatron's class
    otherwise."""
    from megatron.core.tensor_parallel import layers

    from .onednn_linear import make_frozen_linear, make_linear

    if not hasattr(layers.LinearWithGradAccumulationAndAsyncCommunication,
                   "_swift_mcore_original"):
        layers.LinearWithGradAccumulationAndAsyncCommunication = make_linear(
            layers.LinearWithGradAccumulationAndAsyncCommunication)
    if not hasattr(layers.LinearWithFrozenWeight, "_swift_mcore_original"):
        layers.LinearWithFrozenWeight = make_frozen_linear(layers.LinearWithFrozenWeight)


def _patch_split_sizes_to_host():
    """The all-to-all dispatcher hands its split sizes to all_to_all_single after
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` (token_dispatcher.py:879), which turns
    only CUDA tensors into numpy: a CPU tensor stays a tensor, and torch's all_to_all_single
    refuses it as split sizes. On CPU the same call returns the numpy array it means."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_swift_mcore_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._swift_mcore_cpu = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Scales gradients in place by max_norm / total_norm when that is below 1.

    megatron's version asserts ``grad.type() == 'torch.cuda.FloatTensor'``; the arithmetic
    is the same.
    """
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            grad.detach().mul_(coeff)


def _patch_clip_grads():
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu


def _patch_shared_embedding_setup():
    """Tied embeddings with pipeline stages: megatron moves the last stage's copy of the
    embedding with ``weight.data.cuda()`` before all-reducing it over the first and last
    stage (language_module.py:244), a tensor method the module proxy cannot reach. During
    that one call, ``Tensor.cuda`` returns the CPU tensor itself."""
    from megatron.core.models.common.language_module import language_module

    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer
    if getattr(original, "_swift_mcore_cpu", False):
        return

    def setup_embeddings_and_output_layer(self):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = saved

    setup_embeddings_and_output_layer._swift_mcore_cpu = True
    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _drop_cuda_rng_call(callable, **kwargs):
    """Without CUDA there is no CUDA generator to set: the callback is dropped. torch's
    ``_lazy_call`` would instead queue it (with a formatted stack) until CUDA starts, which
    on CPU is never: one entry per recomputed layer and micro-batch, kept forever."""


def _patch_cuda_rng_restore():
    """Activation recompute restores the CUDA RNG state with megatron's
    ``_set_cuda_rng_state`` (random.py:72-111), which hands the setter to
    ``torch.cuda._lazy_call`` (imported by name, out of the module proxy's reach)."""
    from megatron.core.tensor_parallel import random

    random._lazy_call = _drop_cuda_rng_call


def _patch_checkpoint_without_output():
    """Selective recompute of the norms (--recompute_modules layernorm) builds megatron's
    ``CheckpointWithoutOutput()``, whose default ``fp8=False`` still takes the FP8 path
    (random.py:636 reads ``fp8 is not None``) and calls Transformer Engine, which a CPU
    machine does not have. Without CUDA there is no FP8: ``False`` is passed as ``None``."""
    from megatron.core.tensor_parallel import random

    cls = random.CheckpointWithoutOutput
    original = cls.__init__
    if getattr(original, "_swift_mcore_cpu", False):
        return

    def __init__(self, fp8=None):
        original(self, fp8=None if fp8 is False else fp8)

    __init__._swift_mcore_cpu = True
    cls.__init__ = __init__


class _WeightGradientAccumulation:
    """Stands in for apex's CUDA extension ``fused_weight_gradient_mlp_cuda``: megatron's
    linears with ``gradient_accumulation_fusion`` hand it the weight-gradient GEMM
    (layers.py:569-575), which then adds ``grad_output^T @ input`` into the DDP buffer's
    ``main_grad`` in one BLAS call (beta = 1), instead of a separate weight-sized gradient
    tensor that DDP's hook then adds and frees (distributed_data_parallel.py:440): one
    weight-sized allocation, a write and a read of it fewer per linear and micro-batch.
    Mixed dtypes (bf16 activations into fp32 main grads) multiply in the activations' dtype
    and add, as the unfused path does."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        if total_input.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            main_grad.add_(grad_output.t().matmul(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _install_weight_gradient_accumulation():
    """Makes ``gradient_accumulation_fusion`` usable on CPU (layers.py:44-48 sets
    ``_grad_accum_fusion_available`` from the extension's import, and ColumnParallelLinear
    refuses the flag without it, 924). ``accumulate_weight_gradients_in_place`` turns the flag
    on once DDP has given every trainable weight its ``main_grad``: megatron's fused path
    needs one."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = _WeightGradientAccumulation
    layers._grad_accum_fusion_available = True


def accumulate_weight_gradients_in_place(chunk) -> int:
    """megatron's linears of a DDP-wrapped chunk add their weight gradients straight into
    DDP's ``main_grad`` (``_WeightGradientAccumulation``, the stand-in for apex's fused
    kernel), as Megatron-LM's GPU default does with apex. Only after DDP: the fused path
    reads ``weight.main_grad``, which a bare model lacks. Returns how many linears (none
    where the adaptation is not active)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not active():
        return 0
    linears = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear,
                                                             RowParallelLinear))]
    for linear in linears:
        linear.gradient_accumulation_fusion = True
    return len(linears)
