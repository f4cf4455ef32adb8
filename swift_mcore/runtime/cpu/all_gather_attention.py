"""Attention over the context-parallel group on CPU: keys and values all-gathered, queries local.

Under ``--context_parallel_size N`` megatron cuts every sequence into 2N equal chunks and
gives CP rank r chunks r and 2N-1-r (``megatron.core.utils.get_batch_on_this_cp_rank``, the
causal load balance); RoPE picks the same chunks of its table (rotary_pos_embedding.py,
``get_pos_emb_on_this_cp_rank``). The attention must then see the keys and values of the
whole sequence, which megatron leaves to Transformer Engine (ring or all-to-all exchanges
on CUDA); megatron's local ``DotProductAttention`` refuses CP. ``GatheredKVAttention`` is
the all-gather variant: each layer all-gathers K and V over the group with megatron's own
autograd collective (``gather_from_sequence_parallel_region``: all-gather forward,
reduce-scatter of the gradients backward), puts the 2N chunks back in sequence order, and
attends the local queries to them (blocked_attention.py: keys in blocks, each block's mask
built from the queries' global positions, never a dense mask over the whole sequence:
causal, a sliding window, or the packed rows' block-causal mask, whose query rows
megatron's split already cut and whose key columns stay in sequence order).
Memory per rank is the whole sequence's K and V for one layer at a time; the point is
that the whole CP path (data split, positions, loss, gradients, checkpoints) runs on every
CPU test run, against the one-rank path (tests/test_context_parallel.py).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from .blocked_attention import Visibility, blocked_attention


def chunk_order(cp: int) -> torch.Tensor:
    """Where each of the 2*cp sequence chunks lies among the all-gathered ones (rank j's
    two chunks, j and 2cp-1-j, at 2j and 2j+1): index c of the result is the gathered
    position of sequence chunk c."""
    where = [0] * (2 * cp)
    for rank in range(cp):
        where[rank], where[2 * cp - 1 - rank] = 2 * rank, 2 * rank + 1
    return torch.tensor(where, dtype=torch.long)


def local_positions(cp: int, rank: int, local_len: int) -> torch.Tensor:
    """The sequence positions of this rank's ``local_len`` queries (two chunks)."""
    half = local_len // 2
    first = torch.arange(rank * half, (rank + 1) * half)
    return torch.cat([first, first + (2 * cp - 1 - 2 * rank) * half])


class GatheredKVAttention(DotProductAttention):
    """DotProductAttention's interface (query [sq, b, np, hn], key/value [sk, b, ng, hn]
    -> context [sq, b, np * hn], sq = sk = this rank's two chunks) over the whole
    sequence of the context-parallel group."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None, pg_collection=None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        # k_channels/v_channels: multi-latent attention's head sizes (the shared RoPE key's
        # channels included in k), read off the tensors here as in SdpaAttention.
        # megatron's constructor asserts CP == 1 (only TE's attention takes CP); everything
        # else it sets up (scale, window, dropout, head counts) is what this class uses.
        single = copy.copy(config)
        single.context_parallel_size = 1
        super().__init__(single, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        if config.softmax_type != "vanilla":
            raise ValueError(f"context-parallel attention on CPU supports softmax_type "
                             f"'vanilla' only, not {config.softmax_type!r}")
        self.window = self.scale_mask_softmax.window_size
        coeff = self.scale_mask_softmax.scale
        self.sdpa_scale = self.softmax_scale * (coeff if coeff is not None else 1.0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("context-parallel attention on CPU takes no THD rows")
        if attention_bias is not None:
            raise NotImplementedError("context-parallel attention on CPU takes no bias")
        group = parallel_state.get_context_parallel_group()
        cp, rank = group.size(), group.rank()
        sq, b, heads, head_dim = query.shape
        key, value = (self.whole_sequence(t, group, cp) for t in (key, value))

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        visibility = Visibility(local_positions(cp, rank, sq).to(query.device),
                                causal=mask_type == AttnMaskType.causal, window=self.window,
                                hidden=attention_mask)  # hides: [b|1, 1, sq, seq]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0

        def attend():
            return blocked_attention(q, k, v, visibility, self.sdpa_scale, dropout_p)

        if dropout_p and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])

    @staticmethod
    def whole_sequence(local: torch.Tensor, group, cp: int) -> torch.Tensor:
        """[s_local, ...] -> [s_local * cp, ...] in sequence order: all-gathered over the
        group (gradients reduce-scattered back), the 2*cp chunks reordered."""
        gathered = tensor_parallel.gather_from_sequence_parallel_region(
            local.contiguous(), tensor_parallel_output_grad=True, group=group)
        half = local.shape[0] // 2
        chunks = gathered.view(2 * cp, half, *local.shape[1:])
        ordered = chunks.index_select(0, chunk_order(cp).to(local.device))
        return ordered.view(2 * cp * half, *local.shape[1:])
