"""Gemma 3's layer parts for megatron-core's GPTModel: zero-centred RMSNorm, the norms after
attention and after the MLP, the sliding-window layers' own RoPE base, the scaled embedding.

Gemma 3's decoder layer is megatron's pre-norm layer with two more norms, one on the
attention output and one on the MLP output, each before its residual add. megatron's
TransformerLayer has no norm slot there; its bias-dropout-add slots take the sublayer's
whole output (after the TP all-reduce) and the residual, so the norms sit in them:
``PostNormBiasDropoutAdd``. Every Gemma norm multiplies by
``1 + weight`` (weights stored around 0), computed in float32 as transformers does
(``ZeroCenteredRMSNorm``; Qwen3-Next's norm is the same function). The local (sliding
window) layers rotate with ``--rotary_base_local``, the global ones with ``--rotary_base``:
GPTModel computes one RoPE table for all layers, and ``Gemma3SelfAttention`` swaps in its
own for a window layer. The embedding is multiplied by sqrt(hidden) in the weights' dtype.
"""

from __future__ import annotations

import torch
from types import SimpleNamespace

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
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


class PostNormBiasDropoutAdd(torch.nn.Module):
    """megatron's bias-dropout-add with a ZeroCenteredRMSNorm on the sublayer's output first:
    residual + dropout(norm(output)). In the bda slot, not in the projection, the norm sees
    the projection's whole output, a LoRA adapter's delta included. Under
    ``sequence_parallel`` that output is this rank's slice of the sequence (the row-parallel
    projection reduce-scatters it), so the norm's weight gradient is a partial sum: its
    weight carries megatron's ``sequence_parallel`` mark, and megatron's finalize_model_grads
    sums it over the TP ranks as it does the layer's other norms'."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 sequence_parallel: bool = False):
        super().__init__()
        self.post_norm = ZeroCenteredRMSNorm(SimpleNamespace(params_dtype=dtype,
                                                             sequence_parallel=sequence_parallel),
                                             hidden_size, eps=eps)

    def forward(self, training: bool, fused: bool):
        add = get_bias_dropout_add(training, False)

        def bias_dropout_add(x_with_bias, residual, prob):
            output, bias = x_with_bias
            return add((self.post_norm(output), bias), residual, prob)

        return bias_dropout_add


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
            # under --context_parallel_size the global table holds this rank's two of the
            # 2 x CP chunks; the local one is built for the whole sequence and cut the same
            # way inside RotaryEmbedding (its CP group is megatron's)
            group = self.local_rope.cp_group
            whole = table.shape[0] * (group.size() if group is not None else 1)
            local = self.local_rope(whole).to(table.device, table.dtype)
            kwargs["rotary_pos_emb"] = local
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def adapt_spec(spec, config):
    """The local layer spec (of RunConfig ``config``) with Gemma 3's norms and attention."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    m = config.model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision,
                                                                 torch.float32)
    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    post_norm = ModuleSpec(module=PostNormBiasDropoutAdd,
                           params=dict(hidden_size=m.hidden_size, eps=m.norm_epsilon,
                                       dtype=dtype,
                                       sequence_parallel=config.parallel.sequence_parallel))
    sub.self_attn_bda = post_norm
    sub.mlp_bda = post_norm
    attention = sub.self_attention
    attention.module = Gemma3SelfAttention
    attention.submodules.q_layernorm = ZeroCenteredRMSNorm
    attention.submodules.k_layernorm = ZeroCenteredRMSNorm
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
