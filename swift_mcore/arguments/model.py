"""Model shape and architecture flags (a Llama-style GPT by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import FRACTION, NONZERO_FRACTION, POSITIVE, flag


@dataclass
class ModelArguments:
    model: Optional[str] = flag(
        None, "Hugging Face model folder to start from: its config.json sets the model flags "
        "(an explicit flag that disagrees is an error), its tokenizer and safetensors weights "
        "are loaded.")
    model_type: Optional[str] = flag(
        None, "Model family for Hugging Face import/export (llama, qwen2, qwen3, mistral; "
        "docs/models.md); set from --model's config.json; default: the family that fits the "
        "flags.")
    num_layers: int = flag(4, "Number of transformer layers.")
    hidden_size: int = flag(256, "Hidden size.")
    ffn_hidden_size: Optional[int] = flag(
        None, "MLP inner size; default: the Llama rule (8/3 * hidden, rounded up to 64).")
    num_attention_heads: int = flag(8, "Number of attention heads.")
    num_query_groups: Optional[int] = flag(
        4, "Key/value heads for grouped-query attention; equal to heads or none for MHA.")
    kv_channels: Optional[int] = flag(None, "Per-head size; default hidden_size / heads.")
    seq_length: int = flag(256, "Tokens per training sample.")
    max_position_embeddings: Optional[int] = flag(
        None, "Longest sequence the position embedding supports; default seq_length.")
    vocab_size: Optional[int] = flag(
        None, "Vocabulary size; default: the tokenizer's (the default tokenizer trains to 4096).")
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the model vocabulary to a multiple of this times the TP size.")
    normalization: str = flag("RMSNorm", "Normalization layer.", choices=("RMSNorm", "LayerNorm"))
    norm_epsilon: float = flag(1e-5, "Epsilon of the normalization layers.", range=POSITIVE)
    swiglu: bool = flag(True, "Gated SiLU MLP (SwiGLU) instead of a plain GeLU MLP.")
    position_embedding_type: str = flag(
        "rope", "Position embedding.", choices=("rope", "learned_absolute", "none"))
    rotary_base: int = flag(10000, "RoPE base (theta).")
    rotary_percent: float = flag(1.0, "Fraction of each head's channels that RoPE rotates.",
                                 range=NONZERO_FRACTION)
    use_rope_scaling: bool = flag(
        False, "Llama-3 RoPE frequency scaling (low/high frequency factors 1 and 4 over 8192 "
        "original positions).")
    rope_scaling_factor: float = flag(8.0, "Factor of the Llama-3 RoPE scaling.",
                                      range=POSITIVE)
    untie_embeddings_and_output_weights: bool = flag(
        True, "Separate input embedding and output layer weights.")
    add_bias_linear: bool = flag(False, "Bias in the linear layers.")
    add_qkv_bias: bool = flag(False, "Bias in the query/key/value projection only (Qwen2).")
    qk_layernorm: bool = flag(False, "Normalize queries and keys per head (Qwen3).")
    hidden_dropout: float = flag(0.0, "Dropout after attention and MLP.", range=FRACTION)
    attention_dropout: float = flag(0.0, "Dropout on the attention probabilities.",
                                    range=FRACTION)
    init_method_std: float = flag(0.02, "Standard deviation of the weight initialization.",
                                  range=POSITIVE)
    attention_backend: str = flag(
        "auto", "Core attention: transformer_engine = Transformer Engine's layer spec and fused "
        "attention (CUDA); local = megatron's local spec with its DotProductAttention; sdpa = "
        "the local spec with torch's scaled_dot_product_attention (the same result within "
        "1e-5, faster, less memory; benchmarks/README.md); auto = transformer_engine with CUDA "
        "and Transformer Engine installed, sdpa without CUDA, local on CUDA without Transformer "
        "Engine. The start-up line says what runs.",
        choices=("auto", "local", "sdpa", "transformer_engine"))
