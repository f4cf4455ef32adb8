"""Adapts megatron-core 0.16.1 to run on CPU (gloo); the only place that does so.

megatron-core hard-codes CUDA in a handful of spots (PATCHED_MODULES lists each with its
file:line; docs/architecture.md, "megatron-core on CPU"): factory calls with ``device='cuda'`` or ``device=torch.cuda.current_device()``,
``torch.cuda.synchronize()``/streams, and one ``'torch.cuda.FloatTensor'`` assert. Rather
than copying megatron functions, each affected megatron module gets a private ``torch``
name that points to a thin proxy: identical to ``torch`` except that CUDA devices become
the CPU and CUDA-only calls become no-ops. Everything else in torch is untouched.

``activate()`` is a no-op when CUDA is available, and refuses a megatron-core version this
module was not tested against (unless SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from .mcore_adaptation import ModuleProxy, require_tested_version


# module -> why it needs the proxy (file:line in megatron-core 0.16.1)
PATCHED_MODULES = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "RoPE moves inv_freq to torch.cuda.current_device() (160-162)",
    "megatron.core.utils": "GlobalMemoryBuffer allocates on the CUDA device (631)",
    "megatron.core.distributed.param_and_grad_buffer":
        "grad/param buffers on the CUDA device, streams (417-806)",
    "megatron.core.distributed.distributed_data_parallel": "communication stream (230)",
    "megatron.core.optimizer.optimizer": "FP32Optimizer._scale on 'cuda' (907)",
    "megatron.core.optimizer.clip_grads": "norm buffers on 'cuda' (90-207)",
    "megatron.core.pipeline_parallel.schedules": "token counter on 'cuda' (596, 983, 2138)",
    "megatron.core.pipeline_parallel.p2p_communication":
        "receive buffers on the CUDA device, synchronize (313, 398)",
    "megatron.core.tensor_parallel.mappings": "all-gather buffers on the CUDA device (181)",
    "megatron.core.transformer.utils": "default causal mask built on 'cuda' (35)",
    "megatron.core.tensor_parallel.layers": "weight-grad buffers on the CUDA device (552)",
    "megatron.core.tensor_parallel.random": "CUDA RNG seeding in the tracker",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "synchronize (230)",
    "megatron.core.dist_checkpointing.strategies.async_utils":
        "--async_save: synchronize before the fork (212), the done/finalize counters on the "
        "CUDA device (165, 604)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "synchronize (252)",
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
        return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "factory")
    return call


class _NoStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return None


class _CpuCuda:
    """torch.cuda as seen by a patched megatron module on a machine without CUDA."""

    Stream = _NoStream

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


class _CpuTorch(ModuleProxy):
    """A ``torch`` look-alike whose CUDA devices are the CPU."""

    MODULE = torch
    cuda = _CpuCuda()

    def __init__(self):
        for name in _FACTORIES:
            setattr(self, name, _redirect(getattr(torch, name)))


_ACTIVE = False


def needed() -> bool:
    return not torch.cuda.is_available()


def check_version() -> str:
    return require_tested_version(
        "CPU adaptation", "run on a CUDA machine, or set SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1 "
        "to try anyway.")


def activate() -> bool:
    """Install the CPU adaptation if there is no CUDA. Returns True when it is active."""
    global _ACTIVE
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
    _ACTIVE = True
    return True


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

