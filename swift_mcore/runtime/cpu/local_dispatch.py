"""The MoE token dispatcher of a CPU run whose experts all sit on this rank (EP = TP = 1).

megatron-core 0.16.1's alltoall dispatcher (token_dispatcher.py:348) keeps, with one
expert-parallel and one tensor-parallel rank, every step it takes across ranks: the
all-to-alls of tokens and probabilities (identity autograd nodes on a group of one), the
"sort by local expert" of both (sort_chunks_by_idxs: a split and a cat that copy every
routed row into the same order, forward and backward, since every expert is local), the
device-to-host bookkeeping, and its unpermute adds the expert rows back with
``scatter_add_`` over an index expanded to every element. ``LocalTokenDispatcher`` is that
dispatcher with those steps left out where they do nothing, and the rows added back with
``index_add_`` (megatron's own choice under deterministic algorithms, moe_utils.py:453):
the same tokens in the same order to the same experts, the same output (each token's top-k
rows summed in megatron's order) and gradients. It changes the class of a built
dispatcher, not its state; with EP or TP above 1, dropping or padding tokens, or
megatron's fused permutation, every method is megatron's own.
tests/test_local_dispatch.py holds the MoE layer equal to megatron's dispatcher, forward
and backward.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's alltoall dispatcher without its cross-rank steps when EP = TP = 1."""

    def _local(self) -> bool:
        c = self.config
        return (self.ep_size == 1 and self.tp_size == 1 and not self.drop_and_pad
                and c.moe_expert_capacity_factor is None
                and not c.moe_router_padding_for_quantization and not c.moe_permute_fusion
                and self.shared_experts is None)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self._local():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        assert probs.dim() == 2 and routing_map.dim() == 2 and routing_map.dtype == torch.bool
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_states.shape
        tokens, experts = routing_map.shape
        # megatron's permute (moe_utils.py:363): rows grouped by expert, token order within
        by_expert = routing_map.T.contiguous()
        self.tokens_per_expert = by_expert.sum(dim=1)
        indices = torch.arange(tokens).unsqueeze(0).expand(experts, -1).masked_select(by_expert)
        self.reversed_local_input_permutation_mapping = indices
        self.num_out_tokens = tokens * self.config.moe_router_topk
        permuted_probs = probs.T.contiguous().masked_select(by_expert)
        return hidden_states.index_select(0, indices), permuted_probs

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if not self._local():
            return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        return permutated_local_input_tokens, permuted_probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if not self._local():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        # every expert is local: megatron's sort by local expert keeps the order
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if not self._local():
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        if not self._local():
            return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens):
        if not self._local():
            return super().combine_postprocess(permutated_local_input_tokens)
        rows = permutated_local_input_tokens
        output = rows.new_zeros(self.hidden_shape_before_permute).index_add_(
            0, self.reversed_local_input_permutation_mapping, rows)
        return output.view(self.hidden_shape)


def use_local_dispatch(model) -> int:
    """Every MoE layer of ``model`` whose dispatcher is megatron's alltoall one gets
    ``LocalTokenDispatcher`` (the same object and state; it falls back to megatron's
    methods wherever experts span ranks). Returns how many."""
    count = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if type(dispatcher) is MoEAlltoAllTokenDispatcher:
            dispatcher.__class__ = LocalTokenDispatcher
            count += 1
    return count
