"""Qwen3-Next's layers for megatron-core's GPTModel: megatron's gated delta-net (linear
attention) layers among its gated full-attention layers, with zero-centred norms.

``--linear_attention_freq`` says which layers are delta-net layers (megatron's
``linear_attention_freq``); in them megatron's ``GatedDeltaNet`` takes the self-attention
slot, with the local spec's column- and row-parallel linears and torch's RMSNorm as the
per-head output norm (plain weight, as transformers' gated norm). With TP each rank
normalises only its value heads, so that norm's weight gradient is a partial sum: it is
marked ``sequence_parallel`` (sequence_parallel_norm.py) and megatron sums it over the TP
ranks, which it does under --sequence_parallel only (arguments/run.py requires the flag). The other layers keep the
local spec's attention, with ``--attention_output_gate`` (megatron's
``attention_output_gate``: the query projection also computes a per-head sigmoid gate on the
attention output). megatron's own hybrid block spec
(``get_transformer_block_with_experimental_attention_variant_spec``) is Transformer Engine's
only; this is the same layer list from the local spec. Every other Qwen3-Next norm (before
attention, before the MLP, on queries and keys, the final one) multiplies by ``1 + weight``
(gemma3_layers.ZeroCenteredRMSNorm).

megatron's GatedDeltaNet ignores the attention mask, so in a packed row (sft --packing: the
block-causal mask of data/packing.py) its conv and its recurrence would run from one
document into the next. ``DocumentGatedDeltaNet`` reads the documents off that mask (a
position that may not see the one before it starts a document; the mask covers the whole
row on every rank) and runs megatron's layer between its two projections on each document
on its own: the same output as the document alone. The projections run once on the whole
row, so under --sequence_parallel ``in_proj`` first gathers the row's pieces from the TP
ranks and ``out_proj`` scatters the result back: the documents are cut out of the whole
row, never out of one rank's piece of it.
"""

from __future__ import annotations

import copy
from typing import List

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet


def transformer_fields(m) -> dict:
    """TransformerConfig fields of the delta-net layers and the gated attention."""
    from ..arguments.model import linear_attention_pattern

    fields = dict(attention_output_gate=bool(m.attention_output_gate))
    pattern = linear_attention_pattern(m)
    if pattern:
        fields.update(experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=pattern,
                      linear_conv_kernel_dim=m.linear_conv_kernel_dim,
                      linear_key_head_dim=m.linear_key_head_dim,
                      linear_value_head_dim=m.linear_value_head_dim,
                      linear_num_key_heads=m.linear_num_key_heads,
                      linear_num_value_heads=m.linear_num_value_heads)
    return fields


def adapt_spec(spec, qk_layernorm: bool):
    """The local layer spec with Qwen3-Next's zero-centred norms (on q and k with
    --qk_layernorm)."""
    from .gemma3_layers import ZeroCenteredRMSNorm

    sub = spec.submodules
    sub.input_layernorm = ZeroCenteredRMSNorm
    sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
    if qk_layernorm:
        attention = sub.self_attention.submodules
        attention.q_layernorm = ZeroCenteredRMSNorm
        attention.k_layernorm = ZeroCenteredRMSNorm
    return spec


class DocumentGatedDeltaNet(GatedDeltaNet):
    """megatron's GatedDeltaNet, one document of a packed row at a time."""

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        starts = document_starts(attention_mask, hidden_states.shape[1])
        if starts is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        projected, _ = self.in_proj(hidden_states)  # [whole row, batch, this rank's heads]
        pieces = []
        for row, row_starts in enumerate(starts):
            bounds = row_starts + [projected.shape[0]]
            pieces.append(torch.cat([self._between_projections(
                projected[start:stop, row:row + 1], *args, **kwargs)
                for start, stop in zip(bounds[:-1], bounds[1:])], dim=0))
        return self.out_proj(torch.cat(pieces, dim=1))

    def _between_projections(self, projected, *args, **kwargs):
        """megatron's forward from the in_proj output of one whole document to the input of
        out_proj: its conv, delta rule and gated norm, on this rank's heads."""
        modules = self._modules
        in_proj, out_proj, sp_size = modules["in_proj"], modules["out_proj"], self.sp_size
        modules["in_proj"] = modules["out_proj"] = _PassOn()
        self.sp_size = 1  # the document is whole here, not this rank's piece of it
        try:
            return super().forward(projected, None, *args, **kwargs)[0]
        finally:
            modules["in_proj"], modules["out_proj"], self.sp_size = in_proj, out_proj, sp_size

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
        """megatron's, also with a LoRA adapter on in_proj (models/lora_layer.py): megatron
        splits the base weight's rows into query, key, value, z, beta and alpha (so a
        checkpoint reshards over TP); the adapter's B is split alike, A as the LoRA layer
        saves it."""
        from megatron.core.ssm import gated_delta_net

        adapted = self.in_proj
        base = getattr(adapted, "base_layer", None)
        if base is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata, tp_group)
        self._modules["in_proj"] = base
        try:
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata, tp_group)
        finally:
            self._modules["in_proj"] = adapted
        own = prefix + "in_proj."
        out = {(own + "base_layer." + k[len(own):] if k.startswith(own) else k): v
               for k, v in state.items()}
        tp = self.tp_size
        parts = [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp, self.v_dim // tp,
                 self.num_value_heads // tp, self.num_value_heads // tp]
        for key, value in adapted.sharded_state_dict(own, sharded_offsets, metadata).items():
            if ".lora_B." in key and key.endswith(".weight"):
                value = gated_delta_net._split_tensor_factory(
                    value, parts, ["query", "key", "value", "z", "beta", "alpha"], 0)
            if ".lora_" in key:
                out[key] = value
        return out


class _PassOn(torch.nn.Module):
    """A linear layer's (output, bias) that is its input: megatron's delta-net forward without
    its projections."""

    def forward(self, x):
        return x, None


def document_starts(mask, batch: int):
    """The first position of each document of each row, from a [b or 1, 1, s, s] mask (True:
    hidden); None when no row holds more than one document (or there is no mask)."""
    if mask is None or mask.dim() != 4 or mask.shape[-1] < 2:
        return None
    # position i starts a document when it may not see position i - 1
    breaks = torch.diagonal(mask[:, 0], offset=-1, dim1=-2, dim2=-1)
    if not bool(breaks.any()):
        return None
    breaks = breaks.expand(batch, -1)
    return [[0] + [int(i) + 1 for i in torch.nonzero(row).flatten()] for row in breaks]


def delta_net_spec(spec):
    """``spec`` (a local-spec layer) with megatron's GatedDeltaNet as its token mixer."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .sequence_parallel_norm import SequenceParallelNorm

    layer = copy.deepcopy(spec)
    layer.submodules.self_attention = ModuleSpec(
        module=DocumentGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                           out_norm=SequenceParallelNorm,
                                           out_proj=RowParallelLinear))
    return layer


def with_delta_net(specs: List, pattern: List[int]) -> List:
    """This stage's layer specs with the delta-net layers of ``pattern`` (its slice of
    --linear_attention_freq, 1: delta net) swapped in."""
    return [delta_net_spec(spec) if linear else spec for spec, linear in zip(specs, pattern)]
