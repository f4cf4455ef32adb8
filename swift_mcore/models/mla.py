"""Multi-latent attention (DeepSeek-V2/V3): megatron's MLATransformerConfig fields from the
model flags, and the weight layout between Hugging Face's MLA projections and megatron's.

Hugging Face (DeepseekV3Attention)      megatron (MLASelfAttention, local spec)
  q_proj            (no q LoRA)          linear_q_proj
  q_a_proj, q_a_layernorm, q_b_proj      linear_q_down_proj, q_layernorm, linear_q_up_proj
  kv_a_proj_with_mqa, kv_a_layernorm     linear_kv_down_proj, kv_layernorm
  kv_b_proj, o_proj                      linear_kv_up_proj, linear_proj

Both keep each head's channels as [no-RoPE part; RoPE part] (queries, keys) and [key;
value] (kv up projection) and the down projection's rows as [latent; shared RoPE key], so
every tensor is copied as it is. Both read the RoPE channels as interleaved pairs
(transformers' rope_interleave, megatron's MLA RoPE), which is why a config without
rope_interleave is refused by the family.

Tensor parallelism splits the heads: the up projections (and the direct query projection)
are column-parallel and keep whole heads per rank, the output projection is row-parallel.
The local spec's down projections are column-parallel too (megatron gathers their outputs
again before the norms; ``attention_class`` corrects the key/value one's backward pass).
Transformer Engine's spec (duplicated down projections) runs at TP 1 only for now
(run_config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


def attention_class():
    """megatron's MLASelfAttention whose column-parallel key/value down projection (the
    local spec at TP > 1) passes back the whole gradient of the shared RoPE key.

    megatron-core 0.16.1 (multi_latent_attention.py, 604-615) all-gathers that projection's
    output over the TP ranks and splits off the RoPE key, which every head uses: each rank's
    heads give it only their part of the key's gradient, and the all-gather's backward keeps
    each rank's own columns of it, so the RoPE rows of the projection (held by the last
    rank) and the hidden states' gradient through them miss the other ranks' heads. Here a
    hook gathers the projection's output itself (with its LoRA adapter's, models/lora.py),
    which megatron then reads as a whole projection's (its other branch): with
    --sequence_parallel megatron all-gathers the RoPE key over the sequence shards, whose
    backward sums the ranks' parts; without it, the RoPE key passes through ``_SumGradient``,
    whose backward sums them. The forward pass computes the same numbers as megatron's."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class LatentAttention(MLASelfAttention):
        def get_query_key_value_tensors(self, *args, **kwargs):
            if self.linear_kv_down_proj.weight.shape[0] == (
                    self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim):
                return super().get_query_key_value_tensors(*args, **kwargs)  # whole
            # the module there now (peft's LoRA layer may have replaced the linear)
            hook = self.linear_kv_down_proj.register_forward_hook(self._gather_latent)
            try:
                return super().get_query_key_value_tensors(*args, **kwargs)
            finally:
                hook.remove()

        def _gather_latent(self, module, inputs, output):
            from megatron.core.tensor_parallel import mappings

            shard, bias = output
            whole = mappings.gather_from_tensor_model_parallel_region(shard,
                                                                      group=self.tp_group)
            if self.config.sequence_parallel:
                return mappings.scatter_to_sequence_parallel_region(
                    whole, group=self.tp_group), bias
            latent, rope = whole.split([self.config.kv_lora_rank,
                                        self.config.qk_pos_emb_head_dim], dim=-1)
            return torch.cat([latent, _SumGradient.apply(rope, self.tp_group)], dim=-1), bias

    return LatentAttention


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group``. megatron's
    copy_to_tensor_model_parallel_region would all-reduce a contiguous copy of a
    non-contiguous gradient (the RoPE key's, a slice of the last dimension: mappings.py,
    31) and return the unreduced original."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def mla_config(m) -> tuple:
    """(MLATransformerConfig, its MLA and RoPE fields) for ModelArguments ``m``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig, dict(
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        rope_type=m.rope_type, rotary_base=m.rotary_base, rotary_percent=1.0,
        rotary_scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.original_max_position_embeddings,
        beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim)


@dataclass(frozen=True)
class Mla:
    """The MLA shapes of one model (every layer has the same)."""

    heads: int
    hidden: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int

    @classmethod
    def from_model_args(cls, m) -> "Mla":
        return cls(heads=m.num_attention_heads, hidden=m.hidden_size, q_lora_rank=m.q_lora_rank,
                   kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
                   rope_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim)

    def names(self) -> Dict[str, str]:
        """megatron per-layer suffix -> HF per-layer suffix."""
        out = {"self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
               "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
               "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
               "self_attention.linear_proj.weight": "self_attn.o_proj.weight"}
        if self.q_lora_rank is None:
            out["self_attention.linear_q_proj.weight"] = "self_attn.q_proj.weight"
        else:
            out.update({
                "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
                "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
                "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight"})
        return out

    def hf_tensors(self, prefix: str) -> List[Tuple[str, Tuple[int, ...]]]:
        """The attention tensors of one layer, with their shapes, in transformers' order."""
        h, n = self.hidden, self.heads
        q_width = n * (self.qk_head_dim + self.rope_dim)
        if self.q_lora_rank is None:
            out = [("self_attn.q_proj.weight", (q_width, h))]
        else:
            out = [("self_attn.q_a_proj.weight", (self.q_lora_rank, h)),
                   ("self_attn.q_a_layernorm.weight", (self.q_lora_rank,)),
                   ("self_attn.q_b_proj.weight", (q_width, self.q_lora_rank))]
        out += [("self_attn.kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.rope_dim, h)),
                ("self_attn.kv_a_layernorm.weight", (self.kv_lora_rank,)),
                ("self_attn.kv_b_proj.weight",
                 (n * (self.qk_head_dim + self.v_head_dim), self.kv_lora_rank)),
                ("self_attn.o_proj.weight", (h, n * self.v_head_dim))]
        return [(prefix + name, shape) for name, shape in out]

    def to_mcore(self, suffix: str, prefix: str, read, tp_rank: int, tp_size: int):
        """Rank ``tp_rank``'s shard of megatron attention tensor ``suffix`` of the layer
        whose HF prefix is ``prefix`` (``read(name, rows=None, cols=None)``)."""
        name = prefix + self.names()[suffix]
        if suffix.endswith("layernorm.weight"):
            return read(name)
        if suffix == "self_attention.linear_proj.weight":
            return read(name, cols=_part(self.heads * self.v_head_dim, tp_rank, tp_size))
        rows = {"self_attention.linear_q_down_proj.weight": self.q_lora_rank,
                "self_attention.linear_kv_down_proj.weight": self.kv_lora_rank + self.rope_dim,
                "self_attention.linear_kv_up_proj.weight":
                    self.heads * (self.qk_head_dim + self.v_head_dim)}.get(
            suffix, self.heads * (self.qk_head_dim + self.rope_dim))  # q_proj, q_up_proj
        return read(name, rows=_part(rows, tp_rank, tp_size))

    def hf_name(self, suffix: str) -> Optional[str]:
        """The HF suffix of megatron attention suffix ``suffix`` (None: not MLA's)."""
        return self.names().get(suffix)

    def mcore_name(self, hf_suffix: str) -> Optional[str]:
        return {hf: mc for mc, hf in self.names().items()}.get(hf_suffix)


def _part(size: int, rank: int, parts: int) -> slice:
    step = size // parts
    return slice(rank * step, (rank + 1) * step)
