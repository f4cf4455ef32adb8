"""megatron's AdamW on CPU as torch's fused kernel: the same update in one pass per tensor,
with the gradient clipping inside that pass.

Without CUDA (no TE/apex FusedAdam) megatron-core falls back to ``torch.optim.AdamW`` with
default flags, which torch runs as a per-parameter loop of a dozen element-wise ops on CPU
tensors (foreach and fused are only defaulted on for CUDA). The fused CPU kernel is the same
update in one pass (what it saves: benchmarks/optimizer_step.py;
benchmarks/README.md#the-optimizer-step).
Results agree to float rounding. A checkpoint keeps the flag in its param groups, so a run
resumed from an older checkpoint keeps its original loop.

Clipping by the global norm (megatron's ``clip_grad_by_total_norm_fp32``, on CPU
cpu_compat's) multiplies every gradient by max_norm / norm in a pass of its own over all
gradients, right before the optimizer reads them again. For an optimizer whose groups all
run the fused kernel, ``clip_in_step`` hands that factor to the kernel instead, as the
``grad_scale`` it divides each gradient by (the attribute torch's AMP grad scaler sets for
fused optimizers): one pass less over every gradient. Dividing by 1 / factor can differ
from multiplying by the factor in the last bit of a gradient, so the update equals
megatron's to float rounding (tests/test_optimizer_fused.py). The scale holds for the one
step that follows (a post-step hook drops it) and is set anew at every clip. Each group
says so in its ``clip_in_step`` key, which a checkpoint keeps with its param groups: a run
resumed from a checkpoint written before (its groups without the key) clips in a pass of
its own, as the run that wrote it did, and so continues bit for bit.
"""

from __future__ import annotations

import weakref
from typing import List

import torch

_FUSED = weakref.WeakSet()  # the inner optimizers whose groups all run the fused kernel
CLIP_IN_STEP = "clip_in_step"  # a param group's key: its kernel applies the clipping factor


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
                group[CLIP_IN_STEP] = True
                switched += 1
        if inner.param_groups and all(g["fused"] for g in inner.param_groups) \
                and inner not in _FUSED:
            _FUSED.add(inner)
            inner.register_step_post_hook(_drop_grad_scale)
    return switched


def _drop_grad_scale(inner, args, kwargs) -> None:
    inner.grad_scale = None


def clip_in_step(parameters, coeff: float) -> List[torch.Tensor]:
    """Clipping by ``coeff`` (below 1, or 1 for none) for the fused optimizers whose
    parameters are all among ``parameters``: their next step divides the gradients by
    1 / coeff. Returns the parameters left for the caller to scale itself."""
    if not _FUSED:
        return list(parameters)
    given = list(parameters)
    ids = {id(p) for p in given}
    taken = set()
    for inner in list(_FUSED):
        if not all(g["fused"] and g.get(CLIP_IN_STEP) for g in inner.param_groups):
            continue  # a loaded checkpoint's param groups: the kernel off, or clipped apart
        mine = {id(p) for g in inner.param_groups for p in g["params"]}
        if not mine or not mine <= ids:
            continue
        inner.grad_scale = (torch.full((), 1.0 / coeff, dtype=torch.float32)
                            if coeff < 1.0 else None)
        taken |= mine
    return [p for p in given if id(p) not in taken]
