"""Transformer Engine's linears as LoRA bases: which of megatron's TE classes, their full
sizes, and the normalised input of the linear that fuses its norm.

The only Transformer Engine-specific part of LoRA: the LoRA layer (models/lora_layer.py)
is the same for megatron's own parallel linears and for TE's; it asks this module what a
TE base is. megatron's TE wrappers (megatron/core/extensions/transformer_engine.py) return
megatron's (output, bias) pair like its own linears, but keep TE's attributes: this rank's
``in_features`` of a row-parallel layer and ``out_features`` of a column-parallel one, the
TP size as ``tp_size``. ``TELayerNormColumnParallelLinear`` normalises its input before
the matmul (the layer's own norm module is an identity on the TE spec), so its adapter
must see the normalised input: computed here in torch from the module's
``layer_norm_weight``/``layer_norm_bias``/``normalization``/``eps``/``zero_centered_gamma``,
as TE computes it. Without Transformer Engine there are no such classes (megatron then
defines them as mocks) and nothing here is reached.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

COLUMN, ROW, NORM_COLUMN = "column", "row", "layernorm_column"


def linear_kinds() -> Dict[type, str]:
    """megatron's TE linear classes -> their kind; {} when Transformer Engine is absent."""
    from megatron.core.extensions import transformer_engine as te

    if not te.HAVE_TE:
        return {}
    return {te.TELayerNormColumnParallelLinear: NORM_COLUMN,
            te.TEColumnParallelLinear: COLUMN, te.TERowParallelLinear: ROW}


def kind(module) -> Optional[str]:
    for cls, name in linear_kinds().items():
        if isinstance(module, cls):
            return name
    return None


def full_features(module, which: str) -> Tuple[int, int]:
    """(in, out) of the whole layer: TE divides the sharded dimension by ``tp_size``."""
    if which == ROW:
        return module.in_features * module.tp_size, module.out_features
    return module.in_features, module.out_features * module.tp_size


def normed_input(module, x: torch.Tensor) -> torch.Tensor:
    """What a ``TELayerNormColumnParallelLinear`` multiplies by its weight: its fused norm
    of ``x`` (LayerNorm or RMSNorm; with zero-centred gamma the scale is 1 + weight)."""
    weight = module.layer_norm_weight.to(x.dtype)
    if module.zero_centered_gamma:
        weight = weight + 1
    shape = (x.shape[-1],)
    if module.normalization == "RMSNorm":
        return F.rms_norm(x, shape, weight, module.eps)
    bias = module.layer_norm_bias
    return F.layer_norm(x, shape, weight, None if bias is None else bias.to(x.dtype),
                        module.eps)
