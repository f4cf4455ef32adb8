"""Builds megatron-core's GPTModel from a RunConfig (the layer spec and attention it chose)."""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F


def transformer_config(config, initialize: bool = True):
    """The megatron TransformerConfig of a RunConfig (dtypes, parallel layout, shape).
    ``initialize=False`` leaves the weights unset, for a caller that loads every one."""
    from megatron.core.transformer import TransformerConfig

    m, p = config.model, config.parallel
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision, torch.float32)
    cuda = config.cuda
    te = config.layer_spec == "transformer_engine"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=config.precision == "bf16",
        fp16=config.precision == "fp16",
        # On CPU the full weight is created and sliced, so the initial weights do not depend
        # on the TP layout (megatron requires it without CUDA anyway). On CUDA each rank
        # creates its own shard on its GPU, as Megatron-LM does (run_config.choose_gpu_defaults).
        use_cpu_initialization=config.cpu_initialization,
        perform_initialization=initialize,
        # The fused kernels are CUDA-only; on GPU megatron picks them when TE is present.
        bias_activation_fusion=cuda and m.swiglu and te,
        # The local spec's SwiGLU is our activation module (layer_spec below): megatron's MLP
        # calls a spec-given activation module only under this flag.
        use_te_activation_func=m.swiglu and not te,
        bias_dropout_fusion=False,
        # Transformer Engine's fused RoPE on CUDA (run_config decides: it needs TE).
        apply_rope_fusion=config.rope_fusion,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Losses are summed over tokens and divided by the token count of the whole global
        # batch (all micro-batches and DP ranks), not averaged per micro-batch.
        calculate_per_token_loss=True,
        # p2p without torch.cuda.synchronize (megatron p2p_communication.py:398).
        batch_p2p_sync=cuda,
    )


def layer_spec(config):
    """The layer spec and core attention ``config`` chose (run_config.choose_attention);
    the local spec's SwiGLU keeps less for the backward pass (models/swiglu.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if config.layer_spec == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.model.qk_layernorm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=config.model.qk_layernorm, normalization=config.model.normalization)
    if config.attention == "sdpa":
        from .sdpa_attention import SdpaAttention

        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    if config.model.swiglu:
        from .swiglu import SwiGLU

        # Keeps one fewer [tokens, ffn] tensor than Hugging Face's Llama for the backward
        # pass, two fewer than megatron's unfused glu, with the same gradients (swiglu.py).
        spec.submodules.mlp.submodules.activation_func = SwiGLU
    return spec


def block_spec(config, transformer_config):
    """The decoder block of this rank's layers. With the local spec the final norm is the
    spec's own (megatron's torch or apex norm): megatron would make it Transformer Engine's
    whenever TE is importable, so a local-spec model on a machine with TE (a conversion
    child on the CPU, --attention_backend sdpa on a GPU) would hold one TE module."""
    spec = layer_spec(config)
    if config.layer_spec == "transformer_engine":
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(transformer_config)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers,
                                      layer_norm=spec.submodules.input_layernorm)


def build_model(config, initialize: bool = True) -> List[torch.nn.Module]:
    """One GPTModel chunk per rank holding this rank's pipeline stage and TP shard.

    ``initialize=False`` skips the random initialization, for a one-process model whose
    weights are all loaded next (export, infer). Not for training with TP > 1: megatron then
    leaves out the ``tensor_model_parallel`` marks of the sharded weights, and the gradient
    norm silently counts only TP rank 0's shards."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    m = config.model
    tc = transformer_config(config, initialize)
    model = GPTModel(
        config=tc,
        transformer_layer_spec=block_spec(config, tc),
        vocab_size=config.padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
    )
    if config.cuda:
        model.cuda(torch.cuda.current_device())
    return [model]


def count_parameters(chunks) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
