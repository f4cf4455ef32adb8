"""What this machine offers the run: CUDA and its GPU memory, Transformer Engine, apex (asked by run_config)."""

from __future__ import annotations

import os
from functools import lru_cache


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU: the one place that asks (RunConfig.cuda carries the
    answer to everything else; tests hand resolve(cuda=...) their own)."""
    import torch

    return torch.cuda.is_available()


def gpu_memory() -> int:
    """Bytes of memory of this rank's GPU (LOCAL_RANK's), or 0 without a usable one (as
    where resolve(cuda=True) simulates a GPU in tests)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return 0
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return int(torch.cuda.get_device_properties(index).total_memory)
    except Exception:  # a GPU that cannot be asked: no refusal from its memory
        return 0


@lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """Transformer Engine's PyTorch layers are importable, as megatron-core decides it
    (its HAVE_TE needs ``transformer_engine.pytorch``, not the bare package), and CUDA is
    there to run them."""
    return _usable_with_cuda("transformer_engine.pytorch")


@lru_cache(maxsize=None)
def apex_available() -> bool:
    """apex is importable, as megatron-core decides it (its HAVE_APEX, gpt_layer_specs.py):
    then the local spec's LayerNorm is apex's FusedLayerNorm, which supports sequence
    parallelism."""
    return _usable_with_cuda("apex", "megatron.core.fusions.fused_layer_norm")


@lru_cache(maxsize=None)
def flash_linear_attention_available() -> bool:
    """flash-linear-attention's kernels that megatron's GatedDeltaNet imports are there (its
    HAVE_FLA, gated_delta_net.py:39-47), and CUDA to run them. Without CUDA the CPU port
    gives the layer its own (runtime/cpu/gated_delta_rule.py)."""
    return _usable_with_cuda("fla.modules.l2norm", "fla.ops.gated_delta_rule")


def _usable_with_cuda(*modules: str) -> bool:
    """CUDA is there and every one of ``modules`` imports (any error: not usable)."""
    if not cuda_available():
        return False
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:
        return False
    return True
