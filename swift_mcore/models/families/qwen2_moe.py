"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v bias), routed experts with a
sigmoid-gated shared expert, dense layers chosen by decoder_sparse_step / mlp_only_layers."""

from .base import Family, MoeKeys, sliding_window_check

FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    architecture="Qwen2MoeForCausalLM",
    # transformers' Qwen2MoeConfig defaults for keys a config.json may omit
    defaults={"num_experts_per_tok": 4, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "hidden_act": "silu",
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False},
    fixed={"add_qkv_bias": True},
    known_keys=frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                          "layer_types", "qkv_bias"}),
    checks=sliding_window_check("sliding_window", enabled_key="use_sliding_window"),
    moe=MoeKeys(experts=("num_experts",), expert_ffn="moe_intermediate_size",
                shared_ffn="shared_expert_intermediate_size", norm_topk=False),
)
