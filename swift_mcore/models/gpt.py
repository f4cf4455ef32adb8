"""Builds megatron-core's GPTModel from a RunConfig (the layer spec and attention it chose)."""

from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.nn.functional as F


def transformer_config(config, initialize: bool = True):
    """The megatron TransformerConfig of a RunConfig (dtypes, parallel layout, shape).
    ``initialize=False`` leaves the weights unset, for a caller that loads every one."""
    from megatron.core.transformer import TransformerConfig

    m, p, t = config.model, config.parallel, config.training
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision, torch.float32)
    cuda = config.cuda
    te = config.layer_spec == "transformer_engine"
    config_class, attention = TransformerConfig, {}
    if m.multi_latent_attention:
        from .mla import mla_config

        config_class, attention = mla_config(m)
    fields = dict(
        **attention,
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
        # gpt-oss's attention sinks: megatron's learnable softmax offset per head
        softmax_type=m.softmax_type,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        # None: TP's (megatron's default)
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.args.virtual_stages(),
        # uneven first/last stages (checked in arguments/run.py pipeline_stage_layers)
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        # The interleaved schedule's p2p: with 2 stages each rank's previous and next stage are
        # the same rank, and megatron's batched ops would pair an activation with a gradient
        # of the same shape (both ways in one batch, one tag); its overlapped ops order
        # the directions by rank parity (Megatron-LM's default with virtual stages).
        overlap_p2p_comm=bool(config.args.virtual_stages()),
        batch_p2p_comm=not config.args.virtual_stages(),
        sequence_parallel=p.sequence_parallel,
        # context parallelism: Transformer Engine's attention exchanges keys and values over
        # the group as --cp_comm_type says; on CPU the CPU port's attention (layer_spec)
        context_parallel_size=p.context_parallel_size,
        cp_comm_type=p.cp_comm_type if p.context_parallel_size > 1 else None,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=config.precision == "bf16",
        fp16=config.precision == "fp16",
        # FP8 GEMMs through Transformer Engine (run_config.check_fp8: CUDA and TE's spec only)
        fp8=t.fp8_format,
        fp8_recipe=t.fp8_recipe,
        fp8_param=t.fp8_param_gather,
        # On CPU the full weight is created and sliced, so the initial weights do not depend
        # on the TP layout (megatron requires it without CUDA anyway). On CUDA each rank
        # creates its own shard on its GPU, as Megatron-LM does (run_config.choose_gpu_defaults).
        use_cpu_initialization=config.cpu_initialization,
        perform_initialization=initialize,
        # The fused kernels are CUDA-only; on GPU megatron picks them when TE is present.
        bias_activation_fusion=cuda and m.swiglu and te,
        # The local spec's SwiGLU is our activation module (layer_spec below): megatron's MLP
        # calls a spec-given activation module only under this flag.
        use_te_activation_func=swiglu_module(config),
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
        expert_model_parallel_size=p.expert_model_parallel_size,
        **moe_config(m, p.tensor_model_parallel_size, p.context_parallel_size),
        # Activation recompute, megatron's own (checked in arguments.check_recompute).
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        recompute_modules=(list(t.recompute_modules) if t.recompute_granularity == "selective"
                           else None),
        **window_config(m),
        # multi-token prediction (mtp_block_spec below); 0 is none, as unset
        mtp_num_layers=m.mtp_num_layers or None,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
    )
    if m.model_type == "gemma3":
        from . import gemma3_layers

        fields.update(gemma3_layers.transformer_fields(m))
    if m.model_type == "gpt_oss":
        from . import gpt_oss_layers

        fields.update(gpt_oss_layers.transformer_fields(m))
    if m.linear_attention_freq is not None or m.attention_output_gate:
        from . import hybrid_layers

        fields.update(hybrid_layers.transformer_fields(m))
    tc = config_class(**fields)
    # read by gemma3_layers.Gemma3SelfAttention (TransformerConfig has no such field)
    tc.rotary_base_local = m.rotary_base_local or m.rotary_base
    if position_embedding(m) == "yarn":
        # megatron's GPTModel and attention read YaRN from these attributes
        # (gpt_model.py:172-190, attention.py:1102); TransformerConfig declares none
        for name, value in yarn_attributes(m).items():
            setattr(tc, name, value)
    return tc


def position_embedding(m) -> str:
    """GPTModel's position_embedding_type: 'yarn' for YaRN RoPE outside multi-latent
    attention (which builds its own)."""
    if m.rope_type == "yarn" and not m.multi_latent_attention \
            and m.position_embedding_type == "rope":
        return "yarn"
    return m.position_embedding_type


def yarn_attributes(m) -> dict:
    """The yarn_* attributes megatron's GPTModel reads for its YarnRotaryEmbedding."""
    return dict(yarn_rotary_scaling_factor=m.rotary_scaling_factor,
                yarn_original_max_position_embeddings=m.original_max_position_embeddings,
                yarn_beta_fast=m.beta_fast, yarn_beta_slow=m.beta_slow,
                yarn_mscale=m.mscale, yarn_mscale_all_dim=m.mscale_all_dim,
                yarn_correction_range_round_to_int=m.yarn_truncate)


def mark_sinks_tensor_parallel(model) -> int:
    """Marks each attention's learnable softmax offset (its heads' sinks: a TP rank holds
    its own heads') as tensor-parallel, as megatron's sharded linears are: megatron-core
    0.16.1 leaves the mark out, and the gradient norm would then count TP rank 0's sinks
    only (param_is_not_tensor_parallel_duplicate). Returns how many."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    marked = 0
    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            marked += 1
    return marked


def window_config(m) -> dict:
    """Sliding-window attention (--window_size, --window_attn_skip_freq) and the score scale
    as megatron's TransformerConfig spells them: a window of w tokens is (w - 1, 0)."""
    from ..arguments.model import window_layer_pattern

    pattern = window_layer_pattern(m)
    return dict(window_size=(m.window_size - 1, 0) if m.window_size else None,
                window_attn_skip_freq=pattern or None, softmax_scale=m.softmax_scale)


def moe_config(m, tensor_parallel: int = 1, context_parallel: int = 1) -> dict:
    """The TransformerConfig fields of the mixture-of-experts flags ({} for a dense model).
    Routing is dropless (no expert capacity): every token reaches its top-k experts. The
    router-loss coefficients megatron gets are the flags' times router_loss_scale."""
    if m.num_experts is None:
        return {}
    from ..arguments.model import moe_layer_pattern

    scale = router_loss_scale(tensor_parallel, context_parallel)

    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_layer_freq=moe_layer_pattern(m),
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff * scale,
        moe_z_loss_coeff=None if m.moe_z_loss_coeff is None else m.moe_z_loss_coeff * scale,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        moe_expert_capacity_factor=None,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
    )


def router_loss_scale(tensor_parallel: int, context_parallel: int = 1) -> int:
    """What the router-loss coefficients are multiplied by so that their gradients do not
    depend on TP or CP (docs/models.md, "TP and the router losses").

    Our losses are per token (calculate_per_token_loss: every gradient is divided by the
    global batch's target count in finalize_model_grads). megatron-core 0.16.1's router
    multiplies each rank's load-balancing and z-loss by the tokens that rank routes
    (router.py:466, 498) before their gradients join the LM loss's; with TP (always with
    sequence parallelism for MoE, arguments/run.py) a rank routes its 1/TP slice of
    the sequence, and with CP its 1/CP part, so the router losses would weigh 1/(TP x CP)
    of what they weigh on one rank (the token counts of the router's statistics and the
    logged values are reduced over TP x CP by megatron already).
    The values megatron logs are each loss over its coefficient: unchanged. Megatron-LM
    fixed this after 0.16 (PR 5047: the scale times the tp_cp size), so a later
    megatron-core gets no compensation; tests/test_moe_runs.py's TP=2 run against one
    rank says whether that holds."""
    from megatron.core import package_info

    major_minor = tuple(int(part) for part in package_info.__version__.split(".")[:2])
    return 1 if major_minor >= (0, 17) else tensor_parallel * context_parallel


def swiglu_module(config) -> bool:
    """Whether the MLPs take their activation from the spec (models/swiglu.py): local-spec
    models with SwiGLU, their dense MLPs, routed experts and shared experts alike."""
    m = config.model
    return m.swiglu and config.layer_spec != "transformer_engine"


def layer_spec(config, moe: bool = False):
    """The layer spec and core attention ``config`` chose (run_config.choose_attention);
    ``moe``: the spec of a mixture-of-experts layer (megatron's MoELayer as its MLP). The
    local spec's SwiGLU keeps less for the backward pass (models/swiglu.py)."""
    from megatron.core.models.gpt import gpt_layer_specs

    m = config.model
    experts = dict(num_experts=m.num_experts, moe_grouped_gemm=m.moe_grouped_gemm) if moe \
        else {}
    if config.layer_spec == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=m.qk_layernorm, multi_latent_attention=m.multi_latent_attention,
            **experts)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=m.qk_layernorm, normalization=m.normalization,
        multi_latent_attention=m.multi_latent_attention, **experts)
    if m.multi_latent_attention:
        from .mla import attention_class

        spec.submodules.self_attention.module = attention_class()
    if config.attention == "sdpa":
        from ..runtime import cpu
        from .sdpa_attention import SdpaAttention

        # --context_parallel_size on CPU: the CPU port's attention over the group (None on
        # CUDA and without CP, where run_config allows only TE's there)
        spec.submodules.self_attention.submodules.core_attention = (
            cpu.context_parallel_attention(config) or SdpaAttention)
    if swiglu_module(config):
        from .swiglu import SwiGLU

        # Keeps one fewer [tokens, ffn] tensor than Hugging Face's Llama for the backward
        # pass, two fewer than megatron's unfused glu, with the same gradients (swiglu.py).
        # Every MLP must have it: under use_te_activation_func an MLP without the submodule
        # would apply plain silu to the whole fc1 output (megatron mlp.py:77, 163).
        mlp = spec.submodules.mlp.submodules
        # MoE: each routed expert (SequentialMLP's MLPs) and the shared expert
        for slot in ([mlp.experts.submodules, mlp.shared_experts.submodules] if moe
                     else [mlp]):
            slot.activation_func = SwiGLU
        if moe:
            from megatron.core.transformer.moe.experts import SequentialMLP

            from ..runtime import cpu

            grouped = cpu.expert_module(config)
            if grouped is not None and mlp.experts.module is SequentialMLP:
                # without CUDA: every routed expert's SwiGLU MLP in one autograd function
                mlp.experts.module = grouped
                mlp.experts.params = {**mlp.experts.params, "swiglu": SwiGLU}
    if m.model_type == "gemma3":
        from . import gemma3_layers

        spec = gemma3_layers.adapt_spec(spec, config)
    if moe and m.add_bias_linear:
        from . import gpt_oss_layers

        spec = gpt_oss_layers.adapt_moe_spec(spec)
    from ..arguments.model import HYBRID_MODEL_TYPES

    if m.model_type in HYBRID_MODEL_TYPES:
        from . import hybrid_layers

        spec = hybrid_layers.adapt_spec(spec, m.qk_layernorm)
    if config.parallel.sequence_parallel:
        from . import sequence_parallel_norm

        # megatron's torch norms refuse sequence parallelism; these sum their gradients
        # over the TP ranks (sequence_parallel_norm.py).
        sequence_parallel_norm.use_in(spec)
    return spec


def block_spec(config, transformer_config, vp_stage=None):
    """The decoder block of this rank's layers. With the local spec the final norm is the
    spec's own (megatron's torch or apex norm): megatron would make it Transformer Engine's
    whenever TE is importable, so a local-spec model on a machine with TE (a conversion
    child on the CPU, --attention_backend sdpa on a GPU) would hold one TE module."""
    spec = layer_spec(config)
    linear = config.model.linear_attention_freq is not None
    if config.layer_spec == "transformer_engine" and config.model.num_experts is None \
            and not linear:
        return spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layers = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    specs = [spec] * layers
    if config.model.num_experts is not None:  # --moe_layer_freq: this stage's slice
        from ..arguments.model import moe_layer_pattern

        moe_spec = layer_spec(config, moe=True)
        offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
        pattern = moe_layer_pattern(config.model)[offset: offset + layers]
        specs = [moe_spec if is_moe else spec for is_moe in pattern]
    if linear:  # --linear_attention_freq: this stage's slice
        from ..arguments.model import linear_attention_pattern
        from .hybrid_layers import with_delta_net

        offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
        specs = with_delta_net(specs, linear_attention_pattern(config.model)[offset:
                                                                            offset + layers])
    if config.layer_spec == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    return TransformerBlockSubmodules(layer_specs=specs,
                                      layer_norm=spec.submodules.input_layernorm)


def mtp_block_spec(config, transformer_config, decoder_spec, vp_stage=None):
    """megatron's multi-token prediction block (--mtp_num_layers), or None: each MTP layer's
    transformer layer is the decoder's last layer's (an MoE layer when that one is, as in
    DeepSeek-V3 and GLM-4.5; with gated delta-net layers a full-attention one). With the local spec its three norms are the decoder's own
    norm class, as block_spec's final norm (megatron's local backend would pick apex's
    LayerNorm whenever apex is importable, whatever --normalization says)."""
    if not config.model.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    te = config.layer_spec == "transformer_engine"
    if config.model.linear_attention_freq is not None:
        # Qwen3-Next's MTP layer is a full-attention layer whatever the decoder's last is
        from ..arguments.model import moe_layer_pattern

        moe = config.model.num_experts is not None and moe_layer_pattern(config.model)[-1]
        decoder_spec = layer_spec(config, moe=bool(moe))
    spec = get_gpt_mtp_block_spec(transformer_config, decoder_spec, use_transformer_engine=te,
                                  vp_stage=vp_stage)
    if spec is None or te:
        return spec
    for layer in spec.layer_specs:
        norm = layer.submodules.transformer_layer.submodules.input_layernorm
        layer.submodules.enorm = layer.submodules.hnorm = norm
        layer.submodules.layer_norm = norm
    return spec


def build_model(config, initialize: bool = True) -> List[torch.nn.Module]:
    """This rank's GPTModel chunks: one holding its pipeline stage and TP shard, or with the
    interleaved schedule one per virtual stage (megatron's vp_stage), in that order.

    ``initialize=False`` skips the random initialization, for a one-process model whose
    weights are all loaded next (export, infer). Not for training with TP > 1: megatron then
    leaves out the ``tensor_model_parallel`` marks of the sharded weights, and the gradient
    norm silently counts only TP rank 0's shards."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    m = config.model
    if m.mtp_num_layers:
        GPTModel = _logits_without_mtp(GPTModel)
    tc = transformer_config(config, initialize)
    if m.vision_config:  # a vision-language model: one chunk (no interleaved schedule yet)
        from .vision import VisionLanguage, build_vl_model

        return [build_vl_model(config, VisionLanguage.from_model_args(m), tc,
                               block_spec(config, tc))]
    virtual = config.args.virtual_stages()
    chunks = []
    for vp_stage in (range(virtual) if virtual else [None]):
        decoder_spec = block_spec(config, tc, vp_stage)
        model = GPTModel(
            config=tc,
            transformer_layer_spec=decoder_spec,
            mtp_block_spec=mtp_block_spec(config, tc, decoder_spec, vp_stage),
            vocab_size=config.padded_vocab_size,
            max_sequence_length=m.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            share_embeddings_and_output_weights=shares_embedding(config),
            position_embedding_type=position_embedding(m),
            rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
            rope_scaling=m.use_rope_scaling,
            rope_scaling_factor=m.rope_scaling_factor,
            seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
            vp_stage=vp_stage,
        )
        if m.model_type == "gemma3":
            from . import gemma3_layers

            gemma3_layers.scale_embedding(model, m.hidden_size)
        mark_sinks_tensor_parallel(model)
        mark_whole_experts(model, config.parallel)
        if m.num_labels:
            from . import value_head

            value_head.install(model, config, tc)
        if config.cuda:
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def mark_whole_experts(model, p) -> None:
    """With --expert_tensor_parallel_size 1 under TP > 1 each TP rank runs whole experts on
    its own tokens (its sequence shard), so an expert's gradient is a part on each of them;
    megatron sums expert gradients over the expert-data-parallel ranks (which then include
    the TP ranks) only for parameters marked ``allreduce`` False, which megatron-core 0.16.1
    marks under expert parallelism alone (layers.py, 886): without EP the parts would never
    be summed and the TP ranks' copies of each expert would drift apart. That sum is the
    whole gradient, so an expert's row-parallel bias (gpt-oss), which megatron marks
    ``sequence_parallel``, must not be summed over the TP ranks once more (finalize_model_grads
    would double it)."""
    if p.expert_tensor_parallel_size in (None, p.tensor_model_parallel_size):
        return
    for module in model.modules():
        if getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False
                if getattr(param, "sequence_parallel", False):
                    param.sequence_parallel = False


def shares_embedding(config) -> bool:
    """Whether the output layer is the input embedding (megatron's tied weights). A reward
    model's score head replaces the output layer: on one stage it is built tied, so nothing
    of the vocabulary's size is allocated for it; across pipeline stages untied, else
    megatron would reduce the score head's gradients with the first stage's embedding's and
    checkpoint it as the embedding."""
    m = config.model
    if m.num_labels:
        return config.world.pipeline_parallel == 1
    return not m.untie_embeddings_and_output_weights


_MTP_CLASSES: dict = {}


def _logits_without_mtp(gpt_model):
    """megatron's GPTModel whose forward without labels (logits: infer, the conversion
    check) skips the MTP block: megatron-core 0.16.1 computes the MTP loss from the labels
    whenever the model has MTP layers (gpt_model.py:611, ``labels.clone()``), and the
    logits do not depend on it. With labels (training, evaluation) it is megatron's."""
    if gpt_model not in _MTP_CLASSES:
        class GPTModelWithMTP(gpt_model):
            def _postprocess(self, **kwargs):
                if kwargs.get("labels") is not None:
                    with contextlib.ExitStack() as stack:
                        positions = kwargs.get("position_ids")
                        if kwargs.get("attention_mask") is not None and positions is not None \
                                and positions.dim() == 2 \
                                and kwargs.get("packed_seq_params") is None:
                            stack.enter_context(_rolls_within_conversations(positions,
                                                                            self.cp_group))
                        if self.training and self.cp_group.size() > 1:
                            stack.enter_context(_mtp_loss_per_token_over_cp(
                                self, kwargs["labels"], kwargs.get("loss_mask")))
                        return super()._postprocess(**kwargs)
                kwargs["mtp_in_postprocess"] = False
                layers, self.config.mtp_num_layers = self.config.mtp_num_layers, None
                try:
                    return super()._postprocess(**kwargs)
                finally:
                    self.config.mtp_num_layers = layers

        _MTP_CLASSES[gpt_model] = GPTModelWithMTP
    return _MTP_CLASSES[gpt_model]


@contextlib.contextmanager
def _rolls_within_conversations(position_ids, cp_group):
    """Packed rows behind the block-causal mask (sft --packing without Transformer Engine's
    PackedSeqParams): megatron's MTP roll (roll_tensor: the next token's input, the labels
    and loss mask of each depth) would carry a conversation's first tokens into the
    previous one's last position. While it runs, each roll is megatron's, after which the
    positions whose next one starts a conversation (position id 0: data/sft_datasets.py
    restarts them per conversation, and padding is all zeros) are zero-filled, as megatron
    fills each sequence's last position when it rolls PackedSeqParams' sequences. Rows that
    are not packed have no start but the first, so nothing changes for them. The starts are
    rolled over the CP ranks as the tensors are."""
    from megatron.core.models.gpt import gpt_model as gpt_module
    from megatron.core.transformer import multi_token_prediction as mtp_module

    roll = mtp_module.roll_tensor
    ends, _ = roll((position_ids == 0).to(torch.int32), shifts=-1, dims=-1, cp_group=cp_group)
    ends = ends.bool()

    def within(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        if packed_seq_params is not None or shifts != -1 or tensor.shape != ends.shape:
            return roll(tensor, shifts=shifts, dims=dims, cp_group=cp_group,
                        packed_seq_params=packed_seq_params)
        rolled, _ = roll(tensor, shifts=shifts, dims=dims, cp_group=cp_group)
        rolled = rolled.masked_fill(ends, 0)
        return rolled, rolled.sum()

    mtp_module.roll_tensor = gpt_module.roll_tensor = within
    try:
        yield
    finally:
        mtp_module.roll_tensor = gpt_module.roll_tensor = roll


@contextlib.contextmanager
def _mtp_loss_per_token_over_cp(model, labels, loss_mask):
    """megatron logs each context-parallel rank's MTP loss per token of that rank's chunks
    and averages the ranks (gpt_model.py:645), so a rank with fewer counted tokens weighs
    as much as the other: not the loss per token of the micro-batch one rank logs. Each
    rank's value is scaled here by CP x its share of the micro-batch's counted tokens
    (the loss mask rolled as megatron rolls it for each MTP layer), which makes the
    average that loss. The gradients are per token already (calculate_per_token_loss)."""
    from megatron.core.transformer import multi_token_prediction as mtp_module

    helper = mtp_module.MTPLossLoggingHelper
    group = model.cp_group
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    weights = []
    for _ in range(model.config.mtp_num_layers):
        mask, local = mtp_module.roll_tensor(mask, shifts=-1, dims=-1, cp_group=group)
        local = local.detach().float().reshape(1)
        total = local.clone()
        torch.distributed.all_reduce(total, group=group)
        weights.append(group.size() * local / total.clamp(min=1))
    saved = helper.__dict__["save_loss_to_tracker"]
    save = saved.__func__

    def weighted(loss, layer_number, *args, **kwargs):
        if layer_number is not None:
            loss = loss * weights[layer_number].to(loss.device)[0]
        return save(loss, layer_number, *args, **kwargs)

    helper.save_loss_to_tracker = staticmethod(weighted)
    try:
        yield
    finally:
        helper.save_loss_to_tracker = saved


def count_parameters(chunks) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
