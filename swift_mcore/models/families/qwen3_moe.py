"""Qwen3-MoE (``Qwen3MoeForCausalLM``, Qwen3-30B-A3B and its siblings): Qwen3's attention
(per-head q/k norm) with routed experts, top-k normalised when norm_topk_prob is set."""

from .base import Family, MoeKeys, all_of, require, sliding_window_check

FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM",
    # transformers' Qwen3MoeConfig defaults for keys a config.json may omit
    defaults={"num_experts_per_tok": 8, "moe_intermediate_size": 768, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    fixed={"qk_layernorm": True},
    known_keys=frozenset({"attention_bias", "use_sliding_window", "sliding_window",
                          "max_window_layers", "layer_types"}),
    checks=all_of(require(attention_bias=False),
                  sliding_window_check("sliding_window", enabled_key="use_sliding_window")),
    # the Hub's configs say num_experts; transformers 5 writes num_local_experts
    moe=MoeKeys(experts=("num_experts", "num_local_experts"),
                expert_ffn="moe_intermediate_size", norm_topk=False),
)
