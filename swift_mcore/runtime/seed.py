"""Seeds python, numpy, torch and megatron's tensor-parallel RNG tracker for a rank."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch


def set_seed(seed: int, cuda: Optional[bool] = None) -> None:
    """Megatron's convention: the seed differs per pipeline stage, not per TP or DP rank.
    ``cuda``: the run's RunConfig.cuda (a caller without a config: the hardware's answer).

    Tensor-parallel shards are created from the full weight on every rank
    (use_cpu_initialization), so all TP ranks draw the same numbers; the TP tracker gives
    dropout inside tensor-parallel regions its own stream.
    """
    from megatron.core import parallel_state, tensor_parallel

    if cuda is None:
        from . import hardware

        cuda = hardware.cuda_available()

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Without CUDA there is no CUDA generator to fork: megatron's inference tracker (a
    # no-op fork) is its documented way out, and dropout then draws from torch's CPU RNG.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not cuda, force_reset_rng=True)
