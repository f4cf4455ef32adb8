"""What this machine offers the run: CUDA, Transformer Engine, apex (asked once, by run_config)."""

from __future__ import annotations

from functools import lru_cache


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """Transformer Engine's PyTorch layers are importable, as megatron-core decides it
    (its HAVE_TE needs ``transformer_engine.pytorch``, not the bare package), and CUDA is
    there to run them."""
    if not cuda_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


@lru_cache(maxsize=None)
def apex_available() -> bool:
    """apex is importable, as megatron-core decides it (its HAVE_APEX, gpt_layer_specs.py):
    then the local spec's LayerNorm is apex's FusedLayerNorm, which supports sequence
    parallelism."""
    if not cuda_available():
        return False
    try:
        import apex  # noqa: F401
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm  # noqa: F401
    except Exception:
        return False
    return True
