"""What this machine offers the run: CUDA, Transformer Engine, apex (asked once, by run_config)."""

from __future__ import annotations

from functools import lru_cache


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU: the one place that asks (RunConfig.cuda carries the
    answer to everything else; tests hand resolve(cuda=...) their own)."""
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
