"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's language model under
``text_config`` with interleaved multimodal RoPE, and the deepstack vision tower of
``vision_config`` (models/vision.py builds both as one model)."""

from .qwen2_5_vl import Qwen2_5VLFamily

FAMILY = Qwen2_5VLFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    architecture="Qwen3VLForConditionalGeneration",
    defaults={},
    known_keys=frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                          "vision_start_token_id", "vision_end_token_id"}),
    text_family="qwen3",
    text_type="qwen3_vl_text",
    mrope_keys={"mrope_interleaved": True},
)
