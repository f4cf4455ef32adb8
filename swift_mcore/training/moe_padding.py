"""The padding mask a forward step hands megatron's MoE routers, so that a row's padding is
left out of the load-balancing loss, the z-loss and the token counts behind the expert-bias
update (aux-loss-free balancing), as if the rows had not been padded.

The data marks padding per row (``padding_mask``, True at padding: megatron-core 0.16.1's
convention, whatever its docstrings say; data/sequence_rows.py). megatron's GPTModel passes
the mask down its decoder to each MoE layer and, under sequence parallelism, splits it over
the tensor-parallel ranks as it splits the embedding, but only where it embeds the tokens
itself: a later pipeline stage, or a vision-language model that hands its own embedding
in, gets it split here. Context parallelism splits it with the tokens
(trainer.on_this_cp_rank). megatron's MTP block does not take the mask: each MTP layer
gets its own, rolled as its inputs are (runtime/mcore_adaptation.py
pass_padding_mask_to_mtp_layers). A dense model gets nothing (its layers would ignore the
mask).
"""

from __future__ import annotations

from typing import Dict

import torch


def routing_padding(config, model, batch) -> Dict[str, torch.Tensor]:
    """``{"padding_mask": mask}`` for ``model`` (a model chunk, wrapped or not) to take as
    keyword arguments: the batch's ``padding_mask`` when the model has MoE layers, split over
    the sequence-parallel ranks where megatron would not; ``{}`` otherwise."""
    mask = batch.get("padding_mask")
    if mask is None or config.model.num_experts is None:
        return {}
    gpt = model
    while hasattr(gpt, "module"):  # megatron's DDP and Float16Module wrappers
        gpt = gpt.module
    if gpt.config.sequence_parallel and (not gpt.pre_process or config.model.vision_config):
        from megatron.core import tensor_parallel

        mask = tensor_parallel.scatter_to_sequence_parallel_region(
            mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
    return {"padding_mask": mask}
