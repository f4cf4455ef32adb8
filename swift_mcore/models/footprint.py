"""The memory a model needs, estimated from the resolved flags before anything is built, and
the refusal of a model that cannot fit (naming the field that makes it so large).

The estimate is a lower bound: the parameters of every part (embedding, layers, experts,
LoRA adapters) counted from the flags as megatron builds them, times the bytes each one
takes (weights, gradients and Adam's two moments for what trains; weights alone for what is
frozen or only loaded, and for rlhf's frozen reference copy), plus the hidden states a training step must keep and the Python
modules of each layer. What it leaves out (temporary buffers, the allocator's slack) only
makes the real need larger, so a model refused here could never have run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Tuple

from ..errors import ArgumentError

# Bytes a trained parameter takes with the data-parallel optimizer: 16 in fp32 (weight,
# gradient, Adam's two moments); bf16/fp16 keep a 2-byte weight and gradient and a float32
# master copy with the moments (2 + 2 + 12). The distributed optimizer shards the 12.
TRAINED_BYTES = 16
OPTIMIZER_BYTES = 12
# The Python objects of one megatron transformer layer on the host (modules, parameters'
# wrappers): about 58 KiB measured on CPU with the local spec; half of it is a safe floor.
LAYER_OBJECT_BYTES = 32 * 1024
# config.json's names of the model flags, to name the key a tampered config.json sets.
CONFIG_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
               "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim",
               "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
               "vocab_size": "vocab_size", "num_experts": "num_experts",
               "moe_ffn_hidden_size": "moe_intermediate_size",
               "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
               "max_position_embeddings": "max_position_embeddings"}


@dataclass(frozen=True)
class Part:
    """One part of the model's memory: what it is, its parameters (or 0), its bytes on one
    rank, and the flags that size it (name -> value)."""

    name: str
    parameters: int
    bytes: int
    fields: Tuple[Tuple[str, int], ...]

    def lead(self, given) -> Tuple[str, int]:
        """The flag that makes this part large: the largest of its values, among the flags
        ``given`` (explicitly or by config.json) when any is."""
        chosen = [item for item in self.fields if item[0] in given] or self.fields
        return max(chosen, key=lambda item: item[1])


def parameter_counts(m, tuner=None) -> Dict[str, int]:
    """Parameters of each part of the whole model (all ranks together), as megatron builds
    it: embedding, output layer, the dense layers, the MoE layers' experts (router and
    shared expert included), the final norm and the LoRA adapters (an upper bound: every
    targeted linear of every layer)."""
    from ..arguments.model import linear_attention_pattern, moe_layer_pattern

    h, heads = m.hidden_size, m.num_attention_heads
    groups = m.num_query_groups or heads
    kv = m.kv_channels or h // heads
    ffn = m.ffn_hidden_size
    gemma3 = m.model_type == "gemma3"  # gated gelu-tanh; norms after attention and MLP
    # Gemma 3's gated gelu-tanh and gpt-oss's clamped SwiGLU are gated without --swiglu
    gated = 2 if m.swiglu or gemma3 or m.model_type == "gpt_oss" else 1
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    # --attention_output_gate: the query projection also computes each head's gate
    qkv_out = kv * (heads * (2 if m.attention_output_gate else 1) + 2 * groups)
    bias = m.add_bias_linear
    attention = (h * qkv_out + heads * kv * h + (qkv_out if bias or m.add_qkv_bias else 0)
                 + (h if bias else 0) + (2 * kv if m.qk_layernorm else 0)
                 + (heads if m.softmax_type == "learnable" else 0))  # attention sinks
    if m.multi_latent_attention:
        attention = mla_parameters(m)
    dense_mlp = h * ffn * gated + ffn * h + ((ffn * gated + h) if bias else 0)
    moe_layers = sum(moe_layer_pattern(m)) if m.num_experts else 0
    layers = m.num_layers
    linear = sum(linear_attention_pattern(m))
    vocab = padded_vocab(m)
    counts = {
        "embedding": vocab * h + (m.max_position_embeddings * h
                                  if m.position_embedding_type == "learned_absolute" else 0),
        # a reward model's score head replaces the LM head (models/value_head.py)
        "output layer": (m.num_labels * h if getattr(m, "num_labels", None) else
                         vocab * h if m.untie_embeddings_and_output_weights else 0),
        "layers": (layers - linear) * attention + linear * delta_net_parameters(m)
        + layers * (4 if gemma3 else 2) * norm
        + (layers - moe_layers) * dense_mlp + norm,
        "experts": 0,
        "LoRA adapters": 0,
        "vision tower": vision_parameters(m),
    }
    if moe_layers:
        expert_ffn = m.moe_ffn_hidden_size or ffn
        shared = m.moe_shared_expert_intermediate_size or 0
        per_layer = (m.num_experts * (h + (1 if bias else 0))  # router
                     + m.num_experts * (h * expert_ffn * gated + expert_ffn * h
                                        + ((expert_ffn * gated + h) if bias else 0))
                     + h * shared * gated + shared * h + (h if m.moe_shared_expert_gate else 0))
        counts["experts"] = moe_layers * per_layer
    if m.mtp_num_layers:
        # multi-token prediction: per MTP layer its embedding and hidden norms, the
        # [embedding; hidden] -> hidden projection, its final norm and a transformer layer
        # like the decoder's last (embedding and output layer shared with the model's)
        last_moe = bool(moe_layers) and moe_layer_pattern(m)[-1] == 1
        counts["layers"] += m.mtp_num_layers * (
            3 * norm + 2 * h * h + attention + (4 if gemma3 else 2) * norm
            + (0 if last_moe else dense_mlp))
        if last_moe:
            counts["experts"] += m.mtp_num_layers * per_layer
    if tuner is not None and tuner.tuner_type == "lora":
        from ..arguments.tuner import (DELTA_NET_LINEARS, MCORE_LINEARS, MTP_LINEARS,
                                       mcore_targets)

        kinds = (MCORE_LINEARS + DELTA_NET_LINEARS + MTP_LINEARS
                 if tuner.target_regex is not None else mcore_targets(tuner.target_modules))
        sizes = {"linear_qkv": h + qkv_out, "linear_proj": heads * kv + h,
                 "linear_fc1": h + ffn * gated, "linear_fc2": ffn + h, "eh_proj": 3 * h}
        if m.multi_latent_attention:  # in + out of each projection (models/mla.py)
            rope, q_lora = m.qk_pos_emb_head_dim, m.q_lora_rank
            q_out = heads * (m.qk_head_dim + rope)
            sizes.update(linear_qkv=0, linear_proj=heads * m.v_head_dim + h,
                         linear_q_proj=0 if q_lora else h + q_out,
                         linear_q_down_proj=h + q_lora if q_lora else 0,
                         linear_q_up_proj=q_lora + q_out if q_lora else 0,
                         linear_kv_down_proj=h + m.kv_lora_rank + rope,
                         linear_kv_up_proj=m.kv_lora_rank + heads * (m.qk_head_dim
                                                                     + m.v_head_dim))
        # each kind in the layers that have it: attention's or a delta net's projections
        # (an MTP layer is an attention layer, models/gpt.py mtp_block_spec)
        mtp_layers = m.mtp_num_layers or 0
        count = {"linear_qkv": layers - linear + mtp_layers,
                 "linear_proj": layers - linear + mtp_layers,
                 "in_proj": linear, "out_proj": linear, "eh_proj": mtp_layers}
        if linear:  # a delta net's in_proj: hidden -> [q; k; v; z; b; a], out_proj: v -> hidden
            qk = m.linear_num_key_heads * m.linear_key_head_dim
            v = m.linear_num_value_heads * m.linear_value_head_dim
            sizes.update(in_proj=h + 2 * qk + 2 * v + 2 * m.linear_num_value_heads,
                         out_proj=v + h)
        counts["LoRA adapters"] = tuner.lora_rank * sum(
            sizes.get(k, 0) * count.get(k, layers + mtp_layers) for k in kinds)
        if getattr(m, "vision_config", None):
            from .vision import VisionLanguage, lora_parameters

            if tuner.freeze_llm:  # the tower's adapters alone
                counts["LoRA adapters"] = 0
            counts["LoRA adapters"] += lora_parameters(VisionLanguage.from_model_args(m), tuner)
    return counts


def delta_net_parameters(m) -> int:
    """One gated delta-net block (megatron's GatedDeltaNet, models/delta_net.py): the input
    projection (queries, keys, values, output gates, betas, alphas), the depthwise causal
    conv1d over queries, keys and values (no bias), dt_bias and A_log per value head, the
    per-head output norm and the output projection."""
    h = m.hidden_size
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    heads = m.linear_num_value_heads
    return (h * (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) * m.linear_conv_kernel_dim
            + 2 * heads + m.linear_value_head_dim + v * h)


def vision_parameters(m) -> int:
    """A vision-language model's tower and merger (transformers' modules, built on the
    meta device); 0 for a text model."""
    if not getattr(m, "vision_config", None):
        return 0
    import math

    from .vision import VisionLanguage, tower_shapes

    return sum(math.prod(shape) for _, shape in tower_shapes(VisionLanguage.from_model_args(m)))


def mla_parameters(m) -> int:
    """One multi-latent attention block (models/mla.py): the query path (direct, or down
    projection, norm and up projection), the key/value down projection with the shared RoPE
    key, its norm and up projection, and the output projection; the norms only with
    --qk_layernorm (megatron's identity otherwise)."""
    h, heads, rope = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    q_out = heads * (m.qk_head_dim + rope)
    norm = 1 if m.qk_layernorm else 0
    query = h * q_out if m.q_lora_rank is None else \
        m.q_lora_rank * (h + norm + q_out)
    key_value = h * (m.kv_lora_rank + rope) + m.kv_lora_rank * (
        norm + heads * (m.qk_head_dim + m.v_head_dim))
    return query + key_value + heads * m.v_head_dim * h


def padded_vocab(m) -> int:
    """The embedding's rows as far as the flags know them: --vocab_size (or, unset, the
    smallest vocabulary) padded by megatron's rule. The tensor-parallel factor is left out:
    the padding only grows with it."""
    multiple = m.make_vocab_size_divisible_by
    return -(-(m.vocab_size or 1) // multiple) * multiple


def parts(flags, world_size: int, precision: str, weights_only: bool, cuda: bool = False
          ) -> List[Part]:
    """The memory of one rank, part by part (a lower bound); ``cuda``: on GPU (CPU's
    context-parallel attention keeps more)."""
    m, t, p, tuner = flags.model, flags.training, flags.parallel, flags.tuner
    counts = parameter_counts(m, tuner)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep = p.expert_model_parallel_size
    weight = 4 if precision == "fp32" else 2
    lora = tuner.tuner_type == "lora"
    saved = set(getattr(tuner, "modules_to_save", ()) or ())

    def trained_bytes(name: str) -> int:
        if not p.use_distributed_optimizer:
            return TRAINED_BYTES
        # megatron shards the optimizer state over the data-parallel ranks (CP's included);
        # the experts' over the expert-data-parallel ones, EP times fewer
        dp = max(1, world_size // (tp * pp * (ep if name == "experts" else 1)))
        return TRAINED_BYTES - OPTIMIZER_BYTES + -(-OPTIMIZER_BYTES // dp)

    def per_parameter(name: str) -> int:
        if weights_only:
            return weight
        trained = trained_bytes(name)
        if not lora or name == "LoRA adapters":
            return trained
        if name == "embedding" and saved & {"word_embeddings", "embed_tokens"}:
            return trained
        if name == "output layer" and saved & {"output_layer", "lm_head"}:
            return trained
        return weight  # frozen base weights

    # each routed expert over --expert_tensor_parallel_size ranks (TP's by default)
    etp = p.expert_tensor_parallel_size or tp
    shards = {"embedding": tp, "output layer": tp, "layers": tp * pp, "experts": ep * etp * pp,
              "LoRA adapters": pp, "vision tower": 1}  # the tower: whole on each (first-stage) rank
    sizes = {
        "embedding": (("vocab_size", padded_vocab(m)), ("hidden_size", m.hidden_size),
                      ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by)),
        "layers": (("num_layers", m.num_layers), ("hidden_size", m.hidden_size),
                   ("ffn_hidden_size", m.ffn_hidden_size),
                   ("num_attention_heads", m.num_attention_heads),
                   ("kv_channels", m.kv_channels or 0)),
        "experts": (("num_experts", m.num_experts or 0),
                    ("moe_ffn_hidden_size", m.moe_ffn_hidden_size or 0),
                    ("moe_shared_expert_intermediate_size",
                     m.moe_shared_expert_intermediate_size or 0),
                    ("hidden_size", m.hidden_size), ("num_layers", m.num_layers)),
        "LoRA adapters": (("lora_rank", tuner.lora_rank), ("hidden_size", m.hidden_size),
                          ("num_layers", m.num_layers)),
        "vision tower": (("vision_config", 1),),
    }
    if m.position_embedding_type == "learned_absolute":
        sizes["embedding"] += (("max_position_embeddings", m.max_position_embeddings),)
    sizes["output layer"] = sizes["embedding"][:3]
    found = [Part(name, count, -(-count // shards[name]) * per_parameter(name), sizes[name])
             for name, count in counts.items() if count]
    if needs_reference_copy(flags) and not weights_only:
        # rlhf's frozen reference: the base model's weights again, no gradient or optimizer
        # state (its parameters are the model's own, so not counted twice)
        copy = sum(-(-count // shards[name]) * weight for name, count in counts.items()
                   if count and name != "LoRA adapters")
        found.append(Part("reference model", 0, copy, sizes["layers"]))
    layers_here = -(-m.num_layers // pp)
    found.append(Part("Python modules", 0, layers_here * LAYER_OBJECT_BYTES,
                      (("num_layers", m.num_layers),)))
    if not weights_only:
        # kept for the backward pass at least: each layer's input (also under full
        # recompute) and the logits, per micro-batch (split over the TP ranks at most); a
        # context-parallel rank holds 2 of the 2 x CP chunks of every sequence
        cp = p.context_parallel_size
        tokens = t.micro_batch_size * m.seq_length // cp
        kept = tokens * (layers_here * m.hidden_size + padded_vocab(m)) * weight // tp
        if cp > 1 and not cuda:
            kept += gathered_kv_bytes(flags, layers_here, weight)
        found.append(Part("activations", 0, kept,
                          (("seq_length", m.seq_length),
                           ("micro_batch_size", t.micro_batch_size),
                           ("hidden_size", m.hidden_size), ("vocab_size", padded_vocab(m)),
                           ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by))))
    return found


def gathered_kv_bytes(flags, layers_here: int, weight: int) -> int:
    """What the CPU port's context-parallel attention (runtime/cpu/all_gather_attention.py)
    adds in every attention layer and keeps for the backward pass: the whole sequence's
    keys and values (all-gathered, one per query group; its mask is built per block of
    keys, never kept). Each layer's stay until its backward, except in the layers whose
    attention is recomputed (one chunk at a time)."""
    from ..arguments.model import linear_attention_pattern

    m, t, tp = flags.model, flags.training, flags.parallel.tensor_model_parallel_size
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    kv = m.kv_channels or m.hidden_size // heads
    linear = sum(linear_attention_pattern(m))
    attention_here = max(0, layers_here - linear)
    layers = attention_here
    if t.recompute_granularity == "selective" and "core_attn" in t.recompute_modules:
        layers = min(1, attention_here)
    elif t.recompute_granularity == "full" and t.recompute_method == "uniform":
        # every chunk of --recompute_num_layers layers runs again at once in the backward
        # pass (with delta-net layers among them, one attention layer at least)
        chunk = 1 if linear else t.recompute_num_layers
        layers = min(chunk, attention_here)
    elif t.recompute_granularity == "full":  # block: the first layers recomputed
        recomputed = min(attention_here, t.recompute_num_layers)
        layers = attention_here - recomputed + min(1, recomputed)
    seq = m.seq_length
    keys_values = 2 * t.micro_batch_size * seq * -(-groups // tp) * kv * weight
    return layers * keys_values


def needs_reference_copy(flags) -> bool:
    """rlhf keeps a second, frozen copy of the model as its reference, unless LoRA's base
    serves (adapters switched off), --reference_free, or the task has no reference (orpo,
    simpo)."""
    r = getattr(flags, "rlhf", None)
    if getattr(flags, "COMMAND", None) != "rlhf" or r is None or not r.needs_reference():
        return False
    return bool(r.ref_model) or flags.tuner.tuner_type != "lora"


def available(cuda: bool, ranks_here: int) -> Tuple[int, str]:
    """(bytes one rank may use, where they are): the GPU's memory with CUDA; on CPU the
    memory the machine has available, shared by the ranks on it, and at most what this
    process's address-space limit (ulimit -v) leaves. None-like 0 when unknown."""
    if cuda:
        from ..runtime import hardware

        total = hardware.gpu_memory()  # 0 without a usable GPU (a simulated one in tests)
        if total:
            return total, f"the {fmt_bytes(total)} of GPU memory of each rank"
        return 0, ""
    import psutil
    import resource

    memory = psutil.virtual_memory()
    # A rank of a launched run sees its peers already allocating: the machine's total, the
    # same on every rank, keeps the ranks' decisions alike.
    launched = "LOCAL_RANK" in os.environ
    machine = memory.total if launched else memory.available
    have = machine // max(1, ranks_here)
    where = (f"the {fmt_bytes(machine)} {'of' if launched else 'available on'} this machine"
             + (f" shared by {ranks_here} ranks" if ranks_here > 1 else ""))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        left = max(0, soft - psutil.Process().memory_info().vms)
        if left < have:
            have, where = left, (f"the {fmt_bytes(left)} this process's address-space limit "
                                 f"(ulimit -v) leaves")
    return have, where


def check(flags, world_size: int, cuda: bool, precision: str, weights_only: bool = False
          ) -> None:
    """Refuse (ArgumentError) a model whose lower-bound memory exceeds what one rank has,
    naming the flag that makes it large, the parameters and the estimate."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NPROC_PER_NODE")
                     or 1) if not cuda else 1
    ranks_here = min(ranks_here, world_size)
    found = parts(flags, world_size, precision, weights_only, cuda)
    need = sum(part.bytes for part in found)
    have, where = available(cuda, ranks_here)
    if not have or need <= have:
        return
    biggest = max(found, key=lambda part: part.bytes)
    m = flags.model
    given = set(flags.explicit) | (set(CONFIG_KEYS) if m.model else set())
    name, value = biggest.lead(given)
    source = ""
    if m.model and name in CONFIG_KEYS and name not in flags.explicit:
        source = f" ({CONFIG_KEYS[name]} in {m.model}/config.json)"
    total = sum(part.parameters for part in found)
    use = ("weights" if weights_only else
           "weights, gradients, optimizer state and activations")
    raise ArgumentError(
        f"--{name} {value}{source} makes the model too large for this machine: it has "
        f"{fmt_count(total)} parameters, and one rank needs at least {fmt_bytes(need)} for "
        f"its {use} ({precision}; {fmt_bytes(biggest.bytes)} for its {biggest.name}), more "
        f"than {where}")


def fmt_bytes(count: int) -> str:
    """'59.1 GB', '3.2 TB'; beyond petabytes '10^21 bytes' (ints of any size)."""
    for unit, size in (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if size <= count < 1000 * size or (unit == "MB" and count < size):
            return f"{count / size:.3g} {unit}"
    return f"about 10^{len(str(count)) - 1} bytes"


def fmt_count(count: int) -> str:
    """'3.69 billion', '412 million', '5000'; beyond trillions '10^15' (ints of any size)."""
    for unit, size in (("trillion", 10**12), ("billion", 10**9), ("million", 10**6)):
        if size <= count < 1000 * size:
            return f"{count / size:.3g} {unit}"
    return str(count) if count < 10**6 else f"about 10^{len(str(count)) - 1}"
