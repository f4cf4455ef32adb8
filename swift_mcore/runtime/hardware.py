"""What this machine offers the run: CUDA, Transformer Engine, apex (asked once, by run_config)."""

from __future__ import annotations

import os
from functools import lru_cache


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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


def eager_fusions_without_cuda() -> None:
    """Without CUDA, megatron-core's torch.compile'd elementwise fusions become plain
    functions: TORCHDYNAMO_DISABLE=1 unless the environment sets it. megatron decorates them
    with torch.compile when its modules are imported, and on CPU that decoration alone costs
    every process about 2 s (inductor's import) for functions the CPU path runs eagerly
    anyway (the losses are bit-identical either way). Must run before megatron is imported;
    the ranks a launcher starts inherit it."""
    if "TORCHDYNAMO_DISABLE" not in os.environ and not cuda_available():
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
