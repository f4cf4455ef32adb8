"""What Gemma 3 and Qwen3-Next (Qwen3.5) share: a family that reads keys of its own
(``own_keys``, hidden from base.Family's common reader) and whose config.json may be a
multimodal folder's, its language model under text_config (models/text_part.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Tuple

from .base import REQUIRED_KEYS, Family, UnsupportedConfig


@dataclass(frozen=True)
class TextModelFamily(Family):
    """base.Family plus ``own_keys``; a subclass reads a text model's config.json in
    ``text_model_values`` and the common keys through ``common_values``."""

    own_keys: ClassVar[Tuple[str, ...]] = ()

    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        from .. import text_part

        if text_part.is_multimodal(config):  # the language model, trained on text alone
            return text_part.language_model_values(config, model_args, self.model_values)
        # the Hub's Gemma 3 text_config leaves out even the head count and vocabulary
        # (gemma-3-4b-it's): transformers' defaults, as its config class fills them
        filled = {key: self.defaults[key] for key in REQUIRED_KEYS
                  if config.get(key) is None and self.defaults.get(key) is not None}
        return self.text_model_values({**config, **filled}, model_args)

    def text_model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        raise NotImplementedError

    def common_values(self, core: Dict[str, Any], model_args: Any,
                      problems: List[str]) -> Dict[str, Any]:
        """base.Family's values of ``core`` (config.json less own_keys); with ``problems``
        (the family's own) or a refusal of the common reader, one UnsupportedConfig naming
        them all, the common reader's first."""
        try:
            values = super().model_values(core, model_args)
        except UnsupportedConfig as err:
            problems.insert(0, str(err))
        if problems:
            raise UnsupportedConfig("; ".join(problems))
        return values

    def read_keys(self) -> frozenset:
        return super().read_keys() | frozenset(self.own_keys)

    def unknown_keys(self, config: Dict[str, Any]) -> List[str]:
        from .. import text_part

        if text_part.is_multimodal(config):
            return text_part.unknown_keys(self, config)
        return super().unknown_keys(config)
