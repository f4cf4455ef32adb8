"""Qwen3 (``Qwen3ForCausalLM``): RMSNorm on each query and key head, explicit head_dim."""

from .base import Family, all_of, require, sliding_window_check

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architecture="Qwen3ForCausalLM",
    # transformers' Qwen3Config defaults for keys a config.json may omit
    defaults={"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    fixed={"qk_layernorm": True},
    known_keys=frozenset({"attention_bias", "use_sliding_window", "sliding_window",
                          "max_window_layers", "layer_types"}),
    checks=all_of(require(attention_bias=False),
                  sliding_window_check("sliding_window", enabled_key="use_sliding_window")),
)
