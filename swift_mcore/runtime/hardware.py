"""What this machine offers the run: CUDA, Transformer Engine (asked once, by run_config)."""

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
