"""MXFP4 expert weights (gpt-oss's Hub checkpoints) dequantized as they are read.

Such a folder stores each fused expert tensor ``X`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) as ``X_blocks`` [experts, out, groups, 16] (uint8, two FP4 E2M1
values a byte, the low nibble first) and ``X_scales`` [experts, out, groups] (uint8, a
power of two with bias 127 shared by each group of 32 values along the input). The value
is ``FP4[nibble] * 2 ** (scale - 127)``, laid out [experts, in, out] as the unquantized
tensor is (input side first). Every such product is exact in float32 and bfloat16, so the
dequantized weights are transformers' own (Mxfp4Config(dequantize=True)) bit for bit;
tests/models/test_gpt_oss.py holds them to it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# the 16 values of an E2M1 nibble: sign bit, two exponent bits, one mantissa bit
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[e, out, groups, 16] blocks and [e, out, groups] scales -> [e, groups * 32, out]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype} (uint8 [e, out, groups, 16] "
                         f"and [e, out, groups])")
    table = torch.tensor(FP4, dtype=dtype)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # [e, out, groups, 32]: low nibble, high nibble, ...
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(dtype))
    return out.flatten(-2).transpose(1, 2).contiguous()


def is_mxfp4(config: Dict) -> bool:
    """Whether config.json says the experts are stored as MXFP4 (gpt-oss's Hub folders)."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def quantized_shapes(found: Dict[str, Tuple[Tuple[int, ...], str]]
                     ) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """``found`` (name -> (shape, file)) with each pair X_blocks / X_scales replaced by X and
    the shape its dequantization has; a lone half, or a pair beside an unquantized X, stays
    as it is (reported unused)."""
    out = dict(found)
    for name, (shape, path) in found.items():
        if not name.endswith(BLOCKS):
            continue
        base = name[: -len(BLOCKS)]
        scales = found.get(base + SCALES)
        if scales is None or base in found or len(shape) != 4 \
                or tuple(scales[0]) != tuple(shape[:3]):
            continue
        experts, rows, groups, _ = shape
        out.pop(name)
        out.pop(base + SCALES)
        out[base] = ((experts, groups * GROUP, rows), path)
    return out


def read_dequantized(read, name: str, rows: Optional[slice]) -> torch.Tensor:
    """Tensor ``name`` (rows ``rows`` of its first dimension: the experts) from its MXFP4
    blocks and scales, through ``read(name, rows)``."""
    return dequantize(read(name + BLOCKS, rows), read(name + SCALES, rows))
