"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``): Qwen3-MoE's language model (its
experts stored as two stacked tensors per layer, its top-k weights always renormalised)
under ``text_config``, with Qwen3-VL's interleaved multimodal RoPE and deepstack tower."""

import dataclasses

from .qwen2_5_vl import Qwen2_5VLFamily
from .qwen3_moe import FAMILY as QWEN3_MOE

# transformers' Qwen3VLMoeTextTopKRouter divides the top-k weights by their sum, with no
# norm_topk_prob key
TEXT = dataclasses.replace(QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, norm_topk=None))

FAMILY = Qwen2_5VLFamily(
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    architecture="Qwen3VLMoeForConditionalGeneration",
    defaults={},
    known_keys=frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                          "vision_start_token_id", "vision_end_token_id"}),
    text_family=TEXT,
    text_type="qwen3_vl_moe_text",
    mrope_keys={"mrope_interleaved": True},
)
