"""LoRA on megatron's GPTModel through peft: which layers get adapters, what a LoRA
checkpoint holds, the base weights' reference, merging, and the adapter in peft's own
format (HF module names).

``LoraParallelLinear`` (models/lora_layer.py) is registered with peft as the LoRA layer of
``ColumnParallelLinear`` and ``RowParallelLinear``, and of Transformer Engine's linears on
the TE spec (``LoraConfig._register_custom_module``);
peft injects it, freezes the base, and keeps its bookkeeping (scaling, dropout, merge
state). Every TP rank holds the shard of B·A that matches its shard of the base weight,
and the adapters' gradients reach the replicated factor through megatron's own region
mappings. This module imports peft only where a LoRA model is built or read, so that
importing it costs a full-parameter run nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..arguments.tuner import (ALL_LINEAR, MCORE_LINEARS, MTP_LINEARS, SAVABLE_MODULES,
                               mcore_targets)
from ..errors import ArgumentError, CheckpointError
from ..input_files import open_regular
from . import mtp

ADAPTER = "default"  # peft's adapter name: one adapter per model
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
           "linear_fc1": "mlp", "linear_fc2": "mlp"}


def enabled(config) -> bool:
    return config.tuner.tuner_type == "lora"


# ---- which layers ------------------------------------------------------------------------
def _moe_pattern(m) -> List[int]:
    if getattr(m, "num_experts", None) is None:
        return [0] * m.num_layers
    from ..arguments.model import moe_layer_pattern

    return moe_layer_pattern(m)


def linear_names(m) -> List[str]:
    """The global names of the transformer blocks' linear layers, in model order: in a MoE
    layer (SequentialMLP) each routed expert's linear_fc1/linear_fc2 (global expert index)
    and the shared expert's; the router is not a linear layer here (megatron's TopKRouter).
    After the decoder's, each multi-token prediction layer's eh_proj and its transformer
    layer's (built like the decoder's last layer, always with attention: models/gpt.py
    mtp_block_spec)."""
    from ..arguments.model import linear_attention_pattern

    attention = ["linear_qkv"]
    if m.multi_latent_attention:
        attention = (["linear_q_proj"] if m.q_lora_rank is None else
                     ["linear_q_down_proj", "linear_q_up_proj"])
        attention += ["linear_kv_down_proj", "linear_kv_up_proj"]

    def layer_linears(layer: str, delta: bool, moe: bool) -> List[str]:
        mixer = ("in_proj", "out_proj") if delta else (*attention, "linear_proj")
        names = [layer + "self_attention." + name for name in mixer]
        if not moe:
            return names + [layer + "mlp.linear_fc1", layer + "mlp.linear_fc2"]
        for e in range(m.num_experts):
            names += [f"{layer}mlp.experts.local_experts.{e}.{fc}"
                      for fc in ("linear_fc1", "linear_fc2")]
        if m.moe_shared_expert_intermediate_size:
            names += [layer + "mlp.shared_experts.linear_fc1",
                      layer + "mlp.shared_experts.linear_fc2"]
        return names

    names = []
    delta = linear_attention_pattern(m) or [0] * m.num_layers
    moe = _moe_pattern(m)
    for i in range(m.num_layers):
        names += layer_linears(f"decoder.layers.{i}.", bool(delta[i]), bool(moe[i]))
    for k in range(m.mtp_num_layers or 0):
        names.append(f"mtp.layers.{k}.eh_proj")
        names += layer_linears(f"mtp.layers.{k}.transformer_layer.", False, bool(moe[-1]))
    return names


def select_targets(tuner, m) -> List[str]:
    """The global module names that get an adapter; ArgumentError if none does."""
    names = linear_names(m)
    if tuner.target_regex is not None:
        pattern = re.compile(tuner.target_regex)
        chosen = [n for n in names if pattern.fullmatch(n)]
        if not chosen:
            raise ArgumentError(
                f"--target_regex {tuner.target_regex!r} matches no linear layer of this "
                f"model; it is matched against whole names such as {names[0]} (the layers: "
                f"{', '.join(MCORE_LINEARS)} of decoder.layers.0..{m.num_layers - 1}"
                + (", the experts' mlp.experts.local_experts.E.linear_fc1/2"
                   if getattr(m, "num_experts", None) else "")
                + (", the multi-token prediction layers' mtp.layers.K.eh_proj and "
                   "mtp.layers.K.transformer_layer.*" if m.mtp_num_layers else "") + ")")
        return chosen
    kinds = mcore_targets(tuner.target_modules)
    present = {n.rsplit(".", 1)[1] for n in names}
    absent = [k for k in kinds if k not in present]
    if absent and ALL_LINEAR not in tuner.target_modules:
        raise ArgumentError(
            f"--target_modules: this model has no {absent[0]} layer; its linear layers are "
            f"{', '.join(k for k in MCORE_LINEARS + MTP_LINEARS if k in present)}")
    return [n for n in names if n.rsplit(".", 1)[1] in kinds]


def is_expert(name: str) -> bool:
    """A routed expert's linear (mlp.experts.local_experts.E.linear_fc1/2)."""
    return ".mlp.experts.local_experts." in name


def layer_shape(m, name: str) -> Tuple[int, int]:
    """(in, out) of the whole linear layer ``name`` (global), from the model flags."""
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    kind = name.rsplit(".", 1)[1]
    if kind == "eh_proj":  # a multi-token prediction layer's [embedding; hidden] -> hidden
        return 2 * m.hidden_size, m.hidden_size
    if kind in ("in_proj", "out_proj"):  # a gated delta net's (footprint.delta_net_parameters)
        qk = m.linear_num_key_heads * m.linear_key_head_dim
        v = m.linear_num_value_heads * m.linear_value_head_dim
        return ((m.hidden_size, 2 * qk + 2 * v + 2 * m.linear_num_value_heads)
                if kind == "in_proj" else (v, m.hidden_size))
    h, heads, rope = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    mla = {"linear_q_proj": (h, heads * (m.qk_head_dim + rope)),
           "linear_q_down_proj": (h, m.q_lora_rank),
           "linear_q_up_proj": (m.q_lora_rank, heads * (m.qk_head_dim + rope)),
           "linear_kv_down_proj": (h, m.kv_lora_rank + rope),
           "linear_kv_up_proj": (m.kv_lora_rank, heads * (m.qk_head_dim + m.v_head_dim))}
    if kind in mla:
        return mla[kind]
    if kind == "linear_proj" and m.multi_latent_attention:
        return heads * m.v_head_dim, h
    if kind == "linear_qkv":
        queries = m.num_attention_heads * (2 if m.attention_output_gate else 1)
        return m.hidden_size, (queries + 2 * groups) * head_dim
    if kind == "linear_proj":
        return m.num_attention_heads * head_dim, m.hidden_size
    ffn = (m.moe_ffn_hidden_size if is_expert(name) else
           m.moe_shared_expert_intermediate_size if ".shared_experts." in name
           else m.ffn_hidden_size)
    if kind == "linear_fc1":
        return m.hidden_size, ffn * (2 if m.swiglu else 1)
    return ffn, m.hidden_size


# Above this share of the adapted layers' own parameters an "adapter" is not low-rank any
# more (r*(in+out) against in*out): refused unless --lora_max_fraction is raised.
def check_size(tuner, m, targets: List[str]) -> None:
    adapter = base = 0
    for name in targets:
        fan_in, fan_out = layer_shape(m, name)
        adapter += tuner.lora_rank * (fan_in + fan_out)
        base += fan_in * fan_out
    if adapter > tuner.lora_max_fraction * base:
        raise ArgumentError(
            f"--lora_rank {tuner.lora_rank}: the adapters would hold {adapter:,} parameters, "
            f"{100 * adapter / base:.0f}% of the {base:,} of the {len(targets)} layers they "
            f"adapt (--lora_max_fraction {tuner.lora_max_fraction:g}); that is no longer a "
            f"low-rank adapter: lower --lora_rank, train with --tuner_type full, or raise "
            f"--lora_max_fraction")


def check(flags, layer_spec: str) -> None:
    """resolve's part: what the LoRA flags need of the model and the layer spec."""
    # Either spec: resolve chose Transformer Engine's only where TE is usable, and its
    # linears have the LoRA layer of megatron's own (models/lora_layer.py, lora_te.py).
    m, t = flags.model, flags.tuner
    targets = select_targets(t, m)
    experts = [n for n in targets if is_expert(n)]
    if experts and m.moe_grouped_gemm:
        raise ArgumentError(
            f"--tuner_type lora with --moe_grouped_gemm: the grouped experts' linears have "
            f"no LoRA layer ({experts[0]} is chosen); drop --moe_grouped_gemm (each expert "
            f"then has its own linears and adapters), or leave the experts out of "
            f"--target_modules/--target_regex")
    tp = flags.parallel.tensor_model_parallel_size
    if experts and layer_spec == "transformer_engine" and tp > 1:
        # megatron's TE linears do not say they are an expert's, which decides how the
        # adapter's factors are split and communicate (models/lora_layer.py)
        raise ArgumentError(
            f"--tuner_type lora with adapters on routed experts ({experts[0]}) on Transformer "
            f"Engine's layer spec at --tensor_model_parallel_size {tp}: not supported yet; "
            f"leave the experts out of --target_modules/--target_regex, or use "
            f"--expert_model_parallel_size instead of TP")
    tied = not m.untie_embeddings_and_output_weights
    for name in t.modules_to_save:
        if tied and SAVABLE_MODULES[name] == "output_layer":
            raise ArgumentError(
                f"--modules_to_save {name}: this model ties its output layer to the word "
                f"embeddings (no separate weight to train or save); give word_embeddings "
                f"(the one shared weight) instead")
    if not t.adapters:  # an imported adapter's ranks are its own
        check_size(t, m, targets)


def base_reference(flags, cuda: bool) -> str:
    """What the frozen base weights are, as a LoRA checkpoint records it (a resume on other
    base weights is refused): a fingerprint of --model's safetensors files, or the random
    initialization (its seed, and the layout it depends on)."""
    args = getattr(flags, "args", flags)  # the arguments, or a RunConfig's
    p = args.parallel
    layout = f"PP {p.pipeline_model_parallel_size}"
    virtual = args.virtual_stages()
    if virtual:  # each rank draws its layers chunk by chunk: another initialization
        layout += f" x {virtual} virtual stages"
    if cuda:  # on the GPU each TP rank initialises its own shard
        layout += f", TP {p.tensor_model_parallel_size}"
    if args.model.model:
        reference = "sha256:" + folder_fingerprint(args.model.model)
        if args.model.mtp_num_layers and not _folder_mtp_layers(args.model.model):
            # the new MTP layers' frozen weights come from the last stage's seed, drawn
            # after that stage's decoder layers: another layout draws others
            reference += (f"; new MTP layers: random initialization (--seed "
                          f"{args.training.seed}, {layout}, "
                          f"{args.pipeline_stage_layers()[-1]} decoder layer(s) before them)")
        return reference
    if any(getattr(p, name) not in (None, False) for name in args.UNEVEN_FLAGS):
        # each stage draws its layers from its own seed in build order: another split of
        # the same layers is another base (the even split's reference stays as it was)
        layout += ", layers per stage " + "/".join(
            "+".join(str(len(chunk)) for chunk in stage)
            for stage in args.pipeline_chunk_layers())
    return f"random initialization (--seed {args.training.seed}, {layout})"


def _folder_mtp_layers(path: str) -> int:
    """The MTP layers the --model folder holds (its text part's)."""
    from . import mtp
    from .families import for_config
    from .text_part import open_folder

    folder = open_folder(path, flag="--model")
    return mtp.folder_layers(for_config(folder.config, folder.config_path), folder)


# Whole files up to this size; above it the header and 64 KiB of every 16 MiB, which tells a
# retrained or finetuned model (different bytes everywhere) from its base at a read cost
# of 0.4% of the weights.
WHOLE_FILE, STRIDE, SAMPLE = 64 << 20, 16 << 20, 64 << 10


def folder_fingerprint(folder: str) -> str:
    digest = hashlib.sha256()
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    for name in files:
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open_regular(path, "rb") as fh:  # a FIFO named like a shard would block
            if size <= WHOLE_FILE:
                digest.update(fh.read())
                continue
            header = int.from_bytes(fh.read(8), "little")
            fh.seek(0)
            digest.update(fh.read(8 + min(header, size - 8)))
            for offset in range(0, size, STRIDE):
                fh.seek(offset)
                digest.update(fh.read(SAMPLE))
    return digest.hexdigest()


# ---- applying it -------------------------------------------------------------------------
def apply(config, chunks) -> list:
    """Collective-free, before DDP: adapters on the chosen layers of every chunk (its base
    frozen), --modules_to_save trainable. A no-op for --tuner_type full."""
    if not enabled(config):
        return chunks
    from peft import LoraConfig, inject_adapter_in_model

    from .convert import layer_offset
    from .lora_layer import LoraParallelLinear, base_classes, describe

    t = config.tuner
    imported = config.lora_import  # --adapters: per-layer ranks of the fused parts
    wanted = (set(imported.parts()) if imported is not None
              else set(select_targets(t, config.model)))
    vision = bool(config.model.vision_config)
    if vision and t.freeze_llm:  # adapters on the vision tower alone (models/vision.py)
        wanted = set()
    for chunk in chunks:
        chunk.swift_mcore_lora = True  # also a pipeline stage without adapters: base frozen
        offset = layer_offset(chunk)
        full = {name: global_module_name(name, offset, config)
                for name, _ in chunk.named_modules()}
        local = [name for name, g in full.items() if g in wanted]
        for name in local:
            module = chunk.get_submodule(name)
            if describe(module) is None:  # the layer spec made it of a class we do not know
                raise ArgumentError(f"--tuner_type lora: {full[name]} is a "
                                    f"{type(module).__name__}, which has no LoRA layer")
        _check_all_found(chunk, offset, wanted, set(full.values()), config)
        for param in chunk.parameters():
            param.requires_grad_(False)
        tower = []
        if vision:
            from .vision import lora_targets

            tower = lora_targets(chunk, t)  # torch Linears: peft's own LoRA layer
        local += tower
        if local:  # a pipeline stage may hold none of the chosen layers
            patterns = {}
            if imported is not None:  # exact names: peft matches the keys as regexes
                names = {re.escape(n): full[n] for n in local}
                patterns = dict(rank_pattern={k: imported.fused_rank(g) for k, g in names.items()},
                                alpha_pattern={k: imported.fused_alpha(g)
                                               for k, g in names.items()})
            lora_config = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha,
                                     lora_dropout=t.lora_dropout, target_modules=local,
                                     use_rslora=t.use_rslora, init_lora_weights=False,
                                     **patterns)
            lora_config._register_custom_module({cls: LoraParallelLinear
                                                 for cls in base_classes()})
            inject_adapter_in_model(lora_config, chunk, adapter_name=ADAPTER)
        for name, module in chunk.named_modules():
            if isinstance(module, LoraParallelLinear):
                module.gated_rows = (name.endswith("linear_fc1")
                                     and chunk.config.gated_linear_unit)
                module.init_adapter(config.training.seed * 1000003
                                    + zlib.crc32(full[name].encode()))
            elif name in tower:
                _init_torch_adapter(module, config.training.seed * 1000003
                                    + zlib.crc32(name.encode()))
        if imported is not None:
            load_imported(config, chunk, offset)
        for name in t.modules_to_save:
            module = _find(chunk, SAVABLE_MODULES[name])
            if module is not None:
                module.requires_grad_(True)
        if config.model.num_labels and getattr(chunk, "post_process", False):
            # a reward model's score head is new: it trains whole, as peft's modules_to_save
            chunk.output_layer.requires_grad_(True)
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None and config.training.recompute_granularity == "full":
            # Full recompute checkpoints each layer on its input hidden states. With the
            # embedding frozen they need no gradient, so megatron's CheckpointFunction
            # gives outputs no gradient flows back through, and no adapter inside a
            # recomputed layer would train (the case HF's enable_input_require_grads is for).
            embedding.register_forward_hook(_output_requires_grad)
    return chunks


@torch.no_grad()
def _init_torch_adapter(module, seed: int) -> None:
    """peft's LoRA layer of a torch Linear (the vision tower's) initialised as
    LoraParallelLinear.init_adapter does: A Kaiming-uniform from its own generator, B = 0."""
    import math

    for name in module.lora_A:
        nn.init.kaiming_uniform_(module.lora_A[name].weight, a=math.sqrt(5),
                                 generator=torch.Generator().manual_seed(seed))
        module.lora_B[name].weight.zero_()


def _is_torch_lora(module) -> bool:
    """peft's own LoRA layer around a torch Linear (the vision tower's adapters)."""
    from peft.tuners.lora import Linear

    return isinstance(module, Linear)


def global_module_name(local: str, offset: int, config) -> str:
    """A chunk's module name as the whole model names it: its layer's global index (PP) and,
    for a routed expert, its global expert index (EP rank r holds experts r*E/EP ...)."""
    from .convert import global_name

    name = global_name(local, offset)
    match = _LOCAL_EXPERT.match(name)
    if match is None or not config.model.num_experts:
        return name
    from megatron.core import parallel_state

    ep_size = parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * (config.model.num_experts
                                                               // ep_size)
    return f"{match.group(1)}{first + int(match.group(2))}{match.group(3)}"


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*|)$")


def _check_all_found(chunk, offset: int, wanted, present, config) -> None:
    """Every chosen layer this chunk should hold is there: a name the model does not have
    would otherwise leave that layer silently without an adapter."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None) or []
    held = range(offset, offset + len(layers))
    num_experts = config.model.num_experts
    if num_experts:
        from megatron.core import parallel_state

        per_rank = num_experts // parallel_state.get_expert_model_parallel_world_size()
        first = parallel_state.get_expert_model_parallel_rank() * per_rank
    for name in sorted(wanted - present):
        if name.startswith("mtp."):  # the MTP block is the last pipeline stage's alone
            mine = getattr(chunk, "mtp", None) is not None
        else:
            mine = int(name.split(".")[2]) in held
        expert = _LOCAL_EXPERT.match(name)
        if not mine or (expert and not first <= int(expert.group(2)) < first + per_rank):
            continue  # another pipeline stage's or expert-parallel rank's
        raise ArgumentError(f"--tuner_type lora: the model built has no layer {name} to "
                            f"adapt (its layer spec differs from the flags')")


def _output_requires_grad(module, inputs, output):
    return output.requires_grad_(True)


@torch.no_grad()
def load_imported(config, chunk, offset: int) -> None:
    """--adapters: the peft adapter's factors into this rank's fused LoRA layers
    (models/lora_import.py), in place of their initial values."""
    from megatron.core import parallel_state

    from .convert import Layout, global_name
    from .lora_layer import LoraParallelLinear
    from .lora_import import fused_factors, load_tensors

    imported = config.lora_import
    tensors = load_tensors(imported)
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, module in chunk.named_modules():
        if isinstance(module, LoraParallelLinear):
            a, b = fused_factors(imported, global_name(name, offset), tensors, layout,
                                 module.scaling[ADAPTER], tp_rank, tp_size)
            module.lora_A[ADAPTER].weight.copy_(a)
            module.lora_B[ADAPTER].weight.copy_(b)


def _find(chunk, dotted: str):
    module = chunk
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def is_lora(chunk) -> bool:
    return getattr(chunk, "swift_mcore_lora", False)


def parameter_counts(chunks) -> Tuple[int, int]:
    """(trainable, all) parameters of this rank's chunks, a weight replicated over the TP
    ranks counted on the first only (summed over the model-parallel ranks: the model's)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for chunk in chunks for p in chunk.parameters()
              if param_is_not_tensor_parallel_duplicate(p)]
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# ---- what a checkpoint holds -------------------------------------------------------------
def _kept(chunk) -> set:
    """The state-dict keys a LoRA checkpoint holds: the trainable parameters and the
    routers' expert bias, which training moves outside the optimizer (aux-loss-free
    balancing updates it after each step, frozen base or not)."""
    kept = {n for n, p in chunk.named_parameters() if p.requires_grad}
    return kept | {n for n, _ in chunk.named_buffers() if n.endswith(".router.expert_bias")}


def checkpoint_state(chunk, sharded: Dict) -> Dict:
    """The part of a chunk's sharded state dict a LoRA checkpoint holds: the trainable
    parameters (adapters, --modules_to_save) and the expert bias, not the frozen base.
    Others: all of it."""
    if not is_lora(chunk):
        return sharded
    kept = _kept(chunk)
    return {k: v for k, v in sharded.items() if k in kept}


def frozen_keys(chunk) -> set:
    """State-dict keys a LoRA checkpoint may leave out (restore accepts them as missing):
    the frozen base, and the expert bias, which checkpoints written before it was kept
    lack (checkpointing/io.py loads it where it is there)."""
    if not is_lora(chunk):
        return set()
    trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
    return {k for k in chunk.state_dict(keep_vars=True) if k not in trainable}


# ---- merging and peft's format -----------------------------------------------------------
@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Every adapter merged into its base weight (W + B·A·scaling, as peft's
    merge_and_unload) and the LoRA layers replaced by their base layers, in place."""
    from .lora_layer import LoraParallelLinear

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraParallelLinear) or _is_torch_lora(module):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    module.get_base_layer())
    for param in model.parameters():
        param.requires_grad_(True)
    model.swift_mcore_lora = False
    return model


_LINEAR = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LINEAR = re.compile(r"^mtp\.layers\.(\d+)\.(?:transformer_layer\.)?(.+)$")


def _hf_layer(layout, name: str) -> Tuple[int, str, str]:
    """(HF layer index, megatron suffix, HF module prefix) of LoRA layer ``name``: a decoder
    layer's is model.layers.N.; a multi-token prediction layer's is the folder's layer
    num_layers + K (models/mtp.py), or mtp.layers.K. where the family names it apart
    (Qwen3-Next's; its eh_proj is mtp.fc, outside the prefix)."""
    match = _LINEAR.match(name)
    if match:
        layer = int(match.group(1))
        return layer, match.group(2), f"model.layers.{layer}."
    match = _MTP_LINEAR.match(name)
    k, suffix = int(match.group(1)), match.group(2)
    layer = layout.num_layers + k
    if suffix == "eh_proj":
        return layer, suffix, ""
    prefix = f"{mtp.PREFIXED_LAYER}{k}." if layout.mtp_prefixed else f"model.layers.{layer}."
    return layer, suffix, prefix


def _mtp_projection(layout, layer: int) -> str:
    """The HF module of MTP layer ``layer``'s eh_proj (its whole name)."""
    if layout.mtp_prefixed:
        return mtp.PREFIXED_NAMES["eh_proj.weight"][: -len(".weight")]
    return f"model.layers.{layer}.{mtp.hf_name('eh_proj.weight')[: -len('.weight')]}"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])$")


def _hf_parts(layout, layer: int, suffix: str) -> Tuple[str, ...]:
    """The HF modules (under model.layers.N) of megatron layer ``suffix``: a MoE layer's
    experts and shared expert by the family's names (convert.Experts.hf_names); a delta
    net's in_proj by the family's input projections (Qwen3-Next's two, Qwen3.5's four:
    delta_net.DeltaNet.projections), its out_proj as transformers' out_proj."""
    if suffix.startswith("mlp.") and layout.is_moe(layer):
        hf = layout.experts.hf_names(layer)[suffix + ".weight"]
        return tuple(h[: -len(".weight")] for h in (hf if isinstance(hf, tuple) else (hf,)))
    if suffix == "self_attention.in_proj" and layout.is_linear(layer):
        return tuple(name[: -len(".weight")] for name in layout.delta_net.projections())
    if suffix == "self_attention.out_proj" and layout.is_linear(layer):
        return ("linear_attn.out_proj",)
    return _HF_PARTS[suffix]


def _check_peft_experts(layout, experts, ranks) -> None:
    """What peft (0.21, transformers 5) can load of expert adapters. transformers 5 stacks a
    MoE layer's experts into 3-D parameters; peft converts per-expert adapters (the names
    written here) into LoRA on those parameters, and for that maps every targeted module
    named gate_proj/up_proj/down_proj (w1/w3/w2) onto the experts: so an adapter of a dense
    MLP or of the shared expert of the same model would not be loaded, and a layer's experts
    are adapted all or none."""

    why = "peft loads expert adapters onto transformers 5's stacked expert parameters"
    for (layer, fc), adapted in sorted(experts.items()):
        if adapted != set(range(layout.experts.count)):
            raise ArgumentError(
                f"--to_peft: decoder.layers.{layer} has {fc} adapters on experts "
                f"{sorted(adapted)} of {layout.experts.count}; {why}, all of a layer's "
                f"experts or none (export --to_hf --merge_lora instead)")
    clash = sorted(hf for hf in ranks if ".experts." not in hf and
                   hf.rsplit(".", 1)[1] in _EXPERT_PROJS)
    if clash:
        raise ArgumentError(
            f"--to_peft: {clash[0]} has an adapter, and peft maps every module of that name "
            f"onto the MoE experts' stacked parameters ({why}): it would not be loaded. "
            f"Export the merged model with --to_hf --merge_lora, or train without adapters "
            f"on the dense/shared-expert MLP")


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


# megatron module suffix -> the HF modules it is fused from (Layout.to_hf splits B's rows).
_HF_PARTS = {"self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj",
                                           "self_attn.v_proj"),
             "self_attention.linear_proj": ("self_attn.o_proj",),
             # multi-latent attention (models/mla.py): one HF module each
             "self_attention.linear_q_proj": ("self_attn.q_proj",),
             "self_attention.linear_q_down_proj": ("self_attn.q_a_proj",),
             "self_attention.linear_q_up_proj": ("self_attn.q_b_proj",),
             "self_attention.linear_kv_down_proj": ("self_attn.kv_a_proj_with_mqa",),
             "self_attention.linear_kv_up_proj": ("self_attn.kv_b_proj",),
             "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.linear_fc2": ("mlp.down_proj",)}
_HF_SAVED = {"embedding.word_embeddings": "model.embed_tokens", "output_layer": "lm_head"}


def peft_adapter(model: nn.Module, tuner, layout, base_path: Optional[str],
                 multimodal: bool = False):
    """(adapter_config.json contents, adapter_model.safetensors tensors) of a whole (TP=PP=1)
    LoRA model, with Hugging Face module names: peft.PeftModel.from_pretrained(base) gives
    the same function. A fused layer's A is shared by its parts; B's rows are split as the
    weight's are (per query group for q/k/v, halves for gate/up, a delta net's in_proj into
    its projections in transformers' row order). ``multimodal``: the model is the language
    model of a multimodal folder, transformers' ``model.language_model`` there, and its
    modules are named so."""
    from .convert import nested_name
    from .lora_layer import LoraParallelLinear

    def module_name(flat: str) -> str:
        return nested_name(flat) if multimodal else flat

    tensors: Dict[str, torch.Tensor] = {}
    targets = set()
    ranks: Dict[str, Tuple[int, float]] = {}  # HF module -> (rank, alpha)
    experts: Dict[Tuple[int, str], set] = {}  # (layer, fc) -> the adapted experts
    for name, module in model.named_modules():
        if _is_torch_lora(module):
            raise ArgumentError(f"--to_peft: {name} (the vision tower's) has an adapter; "
                                f"the adapter format here holds the language model's only: "
                                f"export the merged model with --to_hf --merge_lora")
        if not isinstance(module, LoraParallelLinear):
            continue
        layer, suffix, prefix = _hf_layer(layout, name)
        expert = _EXPERT.match(suffix)
        if expert and layout.experts.names in ("gpt_oss", "stacked"):
            which = "gpt-oss" if layout.experts.names == "gpt_oss" else "Qwen3-VL-MoE"
            raise ArgumentError(
                f"--to_peft: {name} (a {which} expert) has an adapter; peft's LoRA on "
                f"{which}'s fused expert tensors is not written yet: export the merged model "
                f"with --to_hf --merge_lora, or adapt the attention only (--target_modules "
                f"linear_qkv linear_proj)")
        parts = (_mtp_projection(layout, layer),) if suffix == "eh_proj" else \
            _hf_parts(layout, layer, suffix)
        if expert:
            experts.setdefault((layer, expert.group(2)), set()).add(int(expert.group(1)))
        a = module.lora_A[ADAPTER].weight.detach().float().cpu()
        b = module.lora_B[ADAPTER].weight.detach().float().cpu()
        for part in parts:
            flat = prefix + part
            hf = module_name(flat)
            if suffix != "eh_proj":  # transformers has no module of the name to target
                targets.add(part.rsplit(".", 1)[1])
            ranks[hf] = (module.r[ADAPTER], module.lora_alpha[ADAPTER])
            b_part = layout.to_hf(flat + ".weight", lambda _name, b=b: b)
            tensors[f"base_model.model.{hf}.lora_A.weight"] = a.clone()  # one file entry each
            tensors[f"base_model.model.{hf}.lora_B.weight"] = b_part.contiguous()
    if experts:
        _check_peft_experts(layout, experts, ranks)
    saved = []
    for name in tuner.modules_to_save:
        mcore = SAVABLE_MODULES[name]
        hf = module_name(_HF_SAVED[mcore])
        weight = getattr(model.get_submodule(mcore), "weight", None)
        if weight is None:  # a checkpoint trained before resolve refused this
            raise ArgumentError(f"--to_peft: the checkpoint's --modules_to_save {name} is the "
                                f"tied word embedding, no module of its own; nothing trained "
                                f"it apart from word_embeddings")
        weight = weight.detach().float().cpu()[: layout.vocab]
        tensors[f"base_model.model.{hf}.weight"] = weight.contiguous()
        saved.append(hf.rsplit(".", 1)[-1])
    if not ranks:
        raise CheckpointError("the model holds no LoRA adapter to export")
    # An imported adapter's fused layers have ranks of their own (r_q + r_k + r_v, ...):
    # peft's rank_pattern/alpha_pattern give them, by whole module name.
    rank, alpha = tuner.lora_rank, tuner.lora_alpha
    other = {hf: value for hf, value in ranks.items() if value != (rank, alpha)}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        # peft's LoRA on the experts' stacked parameters refuses dropout (inference
        # ignores it anyway)
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0 if experts else tuner.lora_dropout,
        "rank_pattern": {hf: r for hf, (r, _) in other.items()},
        "alpha_pattern": {hf: a for hf, (_, a) in other.items()},
        "use_rslora": tuner.use_rslora, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(targets), "modules_to_save": saved or None,
        "init_lora_weights": True, "inference_mode": True,
    }
    return config, tensors
