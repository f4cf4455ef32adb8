"""Mistral (``MistralForCausalLM``): Llama's layout; sliding-window attention when set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .base import Family


@dataclass(frozen=True)
class MistralFamily(Family):
    """A ``sliding_window`` shorter than --seq_length becomes --window_size on every layer
    (SDPA's window mask, exact); one that covers the sequence changes nothing and is left
    out, so the attention backend stays free."""

    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        values = super().model_values(config, model_args)
        window = config.get("sliding_window")
        if window and model_args is not None and window < model_args.seq_length:
            values["window_size"] = int(window)
        return values

    def representation_problems(self, m: Any) -> List[str]:
        own = "--window_size "
        problems = [p for p in super().representation_problems(m) if not p.startswith(own)]
        if m.window_attn_skip_freq is not None:
            problems.append(f"--window_attn_skip_freq {m.window_attn_skip_freq} (a mistral "
                            f"model has one window on every layer)")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        config = super().hf_config(m, vocab_size, base)
        if m.window_size:
            config["sliding_window"] = m.window_size
        return config


FAMILY = MistralFamily(
    name="mistral",
    model_types=("mistral",),
    architecture="MistralForCausalLM",
    # transformers' MistralConfig defaults for keys a config.json may omit
    defaults={"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    known_keys=frozenset({"sliding_window"}),
)
