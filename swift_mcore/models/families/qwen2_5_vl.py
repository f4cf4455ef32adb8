"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's language model under
``text_config`` with multimodal RoPE, and the vision tower of ``vision_config``
(models/vision.py builds both as one model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .base import IGNORED_KEYS, Family, InvalidConfig, UnsupportedConfig, value_problems


@dataclass(frozen=True)
class Qwen2_5VLFamily(Family):
    """The language model is read and written by the text family (qwen2 for Qwen2.5-VL);
    this adds the rest."""

    text_family: Any = "qwen2"  # a registered family's name, or a Family of its own
    text_type: str = "qwen2_5_vl_text"   # text_config's model_type
    mrope_keys: Dict[str, Any] = field(default_factory=dict)  # written into rope_parameters

    def text(self) -> Family:
        """The family that reads and writes the language model (text_config)."""
        from . import by_name

        if isinstance(self.text_family, Family):
            return self.text_family
        return by_name(self.text_family)

    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        from ..vision import VisionLanguage, language_config

        invalid = value_problems(config, self.read_keys())
        if invalid:
            raise InvalidConfig("; ".join(invalid))
        text = language_config(config)
        try:
            values = self.text().model_values(text, model_args)
        except UnsupportedConfig as err:  # InvalidConfig too: its class is kept
            raise type(err)(f"text_config: {err}") from None
        vl = VisionLanguage.from_hf_config(config)
        values.update(model_type=self.name, position_embedding_type="mrope", **vl.flags())
        return values

    def unknown_keys(self, config: Dict[str, Any]) -> List[str]:
        from ..vision import language_config

        top = sorted(k for k in config if k not in IGNORED_KEYS | self.read_keys())
        text = self.text().unknown_keys(language_config(config)) \
            if isinstance(config.get("text_config"), dict) else []
        return top + [f"text_config.{k}" for k in text]

    def representation_problems(self, m: Any) -> List[str]:
        if not m.vision_config:
            return [f"--vision_config unset (a {self.name} model has a vision tower)"]
        return [p for p in self.text().representation_problems(m)
                if not p.startswith("--position_embedding_type ")]

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        from ..vision import VisionLanguage

        vl = VisionLanguage.from_model_args(m)
        base = dict(base or {})
        text = self.text().hf_config(m, vocab_size, base.get("text_config"))
        text.pop("architectures", None)
        tied = text.pop("tie_word_embeddings")
        text["model_type"] = self.text_type
        text["rope_parameters"] = {**text["rope_parameters"],
                                   "mrope_section": list(vl.mrope_section), **self.mrope_keys}
        config = {k: v for k, v in base.items()
                  if k not in ("text_config", "architectures", "model_type", "dtype",
                               "torch_dtype", "transformers_version")}
        config.update(architectures=[self.architecture], text_config=text,
                      tie_word_embeddings=tied, **vl.hf_keys())
        return config


FAMILY = Qwen2_5VLFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    architecture="Qwen2_5_VLForConditionalGeneration",
    defaults={},
    known_keys=frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                          "vision_start_token_id", "vision_end_token_id"}),
)
