"""Core attention through torch's scaled_dot_product_attention, for megatron's local layer spec.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, sq, sk] scores
(baddbmm, masked_fill, softmax, bmm) and keeps them for the backward pass. On CPU that is
most of the attention time at seq 512+ and a large share of activation memory.
``SdpaAttention`` computes the same softmax(Q K^T * scale + causal mask) V with
``torch.nn.functional.scaled_dot_product_attention``, whose kernels (flash attention on CPU
and GPU) never store the scores. ``--attention_backend auto`` selects it without CUDA,
``--attention_backend sdpa`` anywhere (``run_config.choose_attention``,
``models/gpt.py:layer_spec``); ``tests/test_sdpa_attention.py`` holds outputs and
gradients to within 1e-5 of the local module and of the whole model.

It subclasses ``DotProductAttention`` for the constructor, the attributes megatron reads
and ``sharded_state_dict`` (no parameters: checkpoints are interchangeable with the local
spec). One difference by construction: masked scores are -inf here and -10000 in megatron,
which is the same after softmax unless a row is masked entirely (padding masks only; a
causal row always sees itself). Sliding windows (``--window_size``) are masks built here on
the row's device, combined with a packed row's block-causal mask. Attention sinks
(``--softmax_type learnable``, gpt-oss) are megatron's own ``softmax_offset`` parameter,
applied in the same SDPA call (``with_sinks``); ``tests/test_sdpa_attention.py`` holds them
to megatron's ``SoftmaxOne``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    """DotProductAttention's interface (query [sq, b, np, hn], key/value [sk, b, ng, hn]
    -> context [sq, b, np * hn]) on ``F.scaled_dot_product_attention``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None, pg_collection=None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        # k_channels/v_channels: multi-latent attention's head sizes, which SDPA reads off
        # the tensors (megatron's own DotProductAttention does not take them)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if self.config.softmax_type not in ("vanilla", "learnable"):
            raise ValueError(f"SdpaAttention supports softmax_type 'vanilla' and 'learnable', "
                             f"not {self.config.softmax_type!r}")
        # (left, right) of this layer's sliding window, or None (DotProductAttention chose it
        # from window_size and window_attn_skip_freq by the layer number).
        self.window = self.scale_mask_softmax.window_size
        # DotProductAttention divides its scale by the layer number under
        # apply_query_key_layer_scaling and multiplies it back inside the softmax; SDPA
        # takes the product in one go.
        coeff = self.scale_mask_softmax.scale
        self.sdpa_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)
        self.dropout_p = self.attention_dropout.p

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("SdpaAttention does not take packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("SdpaAttention does not take an attention bias")
        sq, b, heads, head_dim = query.shape
        sk, groups = key.shape[0], key.shape[2]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type

        mask, is_causal = None, False
        if attention_mask is not None:
            # megatron's mask marks the positions to hide; SDPA's boolean mask the ones to keep.
            mask = ~attention_mask
        if self.window is not None:
            # A packed row's block-causal mask narrowed to the window, or the window alone
            # (which is causal: right is 0).
            window = window_mask(sq, sk, self.window, query.device)
            mask = window if mask is None else mask & window
        elif mask is None and mask_type == AttnMaskType.causal and sq > 1:
            # As megatron's softmax (fused_softmax.py, "causal mask is only for self
            # attention"): SDPA's is_causal aligns the triangle top-left, which is only the
            # causal mask when sq == sk.
            if sq != sk:
                raise ValueError(f"causal attention needs sq == sk, got {sq} and {sk}")
            is_causal = True

        sinks = self.softmax_offset
        if sinks is not None:
            # megatron's learnable softmax offset (gpt-oss's attention sinks)
            if mask is None:
                mask = is_causal_mask(sq, sk, mask_type, query.device)
                is_causal = False
            mask, key, value = with_sinks(mask, key, value, sinks, query.dtype)

        if value.untyped_storage().data_ptr() != query.untyped_storage().data_ptr():
            # RoPE gave q and k storages of their own, so v is the one view left of the
            # [s, b, q + k + v] output of linear_qkv: SDPA keeps it for the backward pass,
            # and with it that whole output. A copy of v keeps only v (the same values).
            value = value.contiguous()
        # [s, b, n, h] -> [b, n, s, h]: SDPA's layout, a view for q, k and v alike.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.sdpa_scale, enable_gqa=groups != heads)

        if dropout_p and not self.config.sequence_parallel:
            # The same RNG stream as megatron's attention dropout (the TP-rank-specific one).
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, n, sq, h] -> [sq, b, n * h]; h is the value's (MLA's differs from q's)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])


def window_mask(sq: int, sk: int, window, device) -> torch.Tensor:
    """[sq, sk] True where query i may see key j: the last sq queries of sk positions, key
    j from i - left to i + right (megatron's get_sliding_window_causal_mask, kept not
    hidden, on any device)."""
    left, right = window
    q = torch.arange(sk - sq, sk, device=device)[:, None]
    k = torch.arange(sk, device=device)[None, :]
    keep = k >= q - left if left >= 0 else torch.ones(sq, sk, dtype=torch.bool, device=device)
    return keep & (k <= q + right) if right >= 0 else keep


def is_causal_mask(sq: int, sk: int, mask_type, device) -> torch.Tensor:
    """[sq, sk] True where query i may see key j: causal for the last sq of sk positions
    (all True without a causal mask type)."""
    if mask_type != AttnMaskType.causal or sq == 1:
        return torch.ones(sq, sk, dtype=torch.bool, device=device)
    return window_mask(sq, sk, (-1, 0), device)


def with_sinks(keep: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               sinks: torch.Tensor, dtype: torch.dtype):
    """(additive mask, key, value) that give softmax(scores + sink column)[..., :-1] V, the
    learnable softmax offset of megatron's SoftmaxOne, in one SDPA call: one more key
    position of zeros, whose score q . 0 = 0 plus the mask's column, the head's sink
    (the softmax's extra term in the denominator); its value of zeros adds nothing. The
    sink's gradient flows through the mask.

    keep: the boolean mask (True: attend), [sq, sk] or [b, 1|heads, sq, sk]; key and
    value [sk, b, groups, hn]; sinks [heads]."""
    heads = sinks.shape[0]
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(
        ~keep, float("-inf"))
    rows, sq = additive.shape[0], additive.shape[2]
    additive = additive.expand(rows, heads, sq, additive.shape[3])
    column = sinks.to(dtype).reshape(1, heads, 1, 1).expand(rows, heads, sq, 1)
    mask = torch.cat([additive, column], dim=-1)
    pad = key.new_zeros((1, *key.shape[1:]))
    return mask, torch.cat([key, pad]), torch.cat([value, value.new_zeros((1, *value.shape[1:]))])
