"""Gemma 3's layer parts for megatron-core's GPTModel: zero-centred RMSNorm, the norms after
attention and after the MLP, the sliding-window layers' own RoPE base, the scaled embedding.

Gemma 3's decoder layer is megatron's pre-norm layer with two more norms, one on the
attention output and one on the MLP output, each before its residual add. megatron's
TransformerLayer has no slot for them, so they sit at the end of the two row-parallel
projections (``linear_proj`` and ``linear_fc2``), whose output is the whole hidden state
(after the TP all-reduce): ``NormedRowParallelLinear``. Every Gemma norm multiplies by
``1 + weight`` (weights stored around 0), computed in float32 as transformers does
(``ZeroCenteredRMSNorm``; Qwen3-Next's norm is the same function). The local (sliding
window) layers rotate with ``--rotary_base_local``, the global ones with ``--rotary_base``:
GPTModel computes one RoPE table for all layers, and ``Gemma3SelfAttention`` swaps in its
own for a window layer. The embedding is multiplied by sqrt(hidden) in the weights' dtype.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention

MODEL_TYPE = "gemma3"


class ZeroCenteredRMSNorm(torch.nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back to the input's dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # megatron's torch norms carry this mark; its optimizer reads it for weight decay
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class NormedRowParallelLinear(RowParallelLinear):
    """A row-parallel projection whose (all-reduced) output passes a ZeroCenteredRMSNorm."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_norm = ZeroCenteredRMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_):
        output, bias = super().forward(input_)
        return self.post_norm(output), bias


class Gemma3SelfAttention(SelfAttention):
    """Self-attention whose window layers use the local RoPE base (``rotary_base_local``)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.local_rope = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            from megatron.core.models.common.embeddings.rotary_pos_embedding import (
                RotaryEmbedding,
            )

            self.local_rope = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=1.0,
                rotary_base=config.rotary_base_local, use_cpu_initialization=True)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        rope = kwargs.get("rotary_pos_emb")
        if self.local_rope is not None and rope is not None:
            table = rope[0] if isinstance(rope, tuple) else rope
            local = self.local_rope(table.shape[0]).to(table.device, table.dtype)
            kwargs["rotary_pos_emb"] = local
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def adapt_spec(spec):
    """The local layer spec with Gemma 3's norms, projections and attention."""
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = sub.self_attention
    attention.module = Gemma3SelfAttention
    attention.submodules.linear_proj = NormedRowParallelLinear
    attention.submodules.q_layernorm = ZeroCenteredRMSNorm
    attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    sub.mlp.submodules.linear_fc2 = NormedRowParallelLinear
    return spec


def transformer_fields(m) -> dict:
    """TransformerConfig fields of a Gemma 3 model beyond the common ones: the gated
    gelu-tanh MLP."""
    return dict(gated_linear_unit=True, activation_func=gelu_tanh)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def scale_embedding(model, hidden_size: int) -> None:
    """Multiplies the embedding's output by sqrt(hidden_size) in its dtype (first stage)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return

    def scale(module, inputs, output):
        return output * torch.tensor(hidden_size ** 0.5, dtype=output.dtype)

    embedding.register_forward_hook(scale)
