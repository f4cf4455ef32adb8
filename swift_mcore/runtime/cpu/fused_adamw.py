"""megatron's AdamW on CPU as torch's fused kernel: the same update in one pass per tensor.

Without CUDA (no TE/apex FusedAdam) megatron-core falls back to ``torch.optim.AdamW`` with
default flags, which torch runs as a per-parameter loop of a dozen element-wise ops on CPU
tensors (foreach and fused are only defaulted on for CUDA). The fused CPU kernel is the same
update in one pass (what it saves: benchmarks/optimizer_step.py;
benchmarks/README.md#the-optimizer-step).
Results agree to float rounding. A checkpoint keeps the flag in its param groups, so a run
resumed from an older checkpoint keeps its original loop.
"""

from __future__ import annotations

import torch


def use_fused_adamw(optimizer) -> int:
    """Switches megatron's torch AdamW (fp32 CPU parameter groups) to torch's fused kernel;
    returns the number of parameter groups switched."""
    switched = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if all(p.dtype == torch.float32 and p.device.type == "cpu"
                   for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched
