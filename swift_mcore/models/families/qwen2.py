"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): a bias on the q/k/v projections."""

from .base import Family, sliding_window_check

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architecture="Qwen2ForCausalLM",
    # transformers' Qwen2Config defaults for keys a config.json may omit
    defaults={"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    fixed={"add_qkv_bias": True},
    known_keys=frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                          "layer_types"}),
    checks=sliding_window_check("sliding_window", enabled_key="use_sliding_window"),
)
