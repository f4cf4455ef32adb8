"""Llama 2 and 3 (``LlamaForCausalLM``): GQA, optional Llama-3 RoPE scaling, no biases."""

from .base import Family, require

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    # transformers' LlamaConfig defaults for keys a config.json may omit
    defaults={"hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    known_keys=frozenset({"attention_bias", "mlp_bias", "pretraining_tp"}),
    # megatron can put a bias on q/k/v alone, or on every linear layer; Llama's
    # attention_bias (q, k, v and o) and mlp_bias are neither.
    checks=require(attention_bias=False, mlp_bias=False, pretraining_tp=1),
)
