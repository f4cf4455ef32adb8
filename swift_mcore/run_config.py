"""The resolved configuration of a run: ``resolve(args)`` checks what needs files, a Hugging
Face config or the hardware, takes every decision once, and returns an immutable RunConfig.

Everything after it (runtime, model, data, optimizer, checkpoint, trainer) reads the
RunConfig, never the arguments it came from. Two values are known only once the data is
read: the tokenizer's vocabulary (-> the padded embedding) and, with --num_train_epochs,
the training set's size (-> train_iters); ``RunConfig.complete`` returns the config with
both filled in, once, before the model is built.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from .arguments.fields import check_flags
from .arguments.run import RunArguments, check_schedule_length
from .errors import ArgumentError

# --attention_backend -> (layer spec, core attention) when Transformer Engine is not used.
LOCAL_ATTENTION = {"local": "megatron's DotProductAttention",
                   "sdpa": "torch scaled_dot_product_attention"}


@dataclass(frozen=True)
class World:
    """How the ranks are laid out, and how a global batch is split over them."""

    world_size: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    num_microbatches: int
    expert_parallel: int = 1     # MoE experts split over this many of the data-parallel ranks
    context_parallel: int = 1    # ranks that share each sequence (two of 2 x CP chunks each)


@dataclass(frozen=True)
class RunConfig:
    args: RunArguments      # read-only: --model's config applied, defaults filled, checked
    world: World
    cuda: bool
    backend: str                 # process-group backend: nccl | gloo
    layer_spec: str              # megatron layer spec: local | transformer_engine
    attention: str               # core attention: local | sdpa | transformer_engine
    packed_rows: str             # how packed sft rows keep conversations apart:
                                 # block_causal_mask (local/sdpa) | thd (TE variable length)
    # What --precision auto and the hardware gave: on a GPU Megatron-LM's defaults, on the
    # CPU the values its path is tested with. ``choose_gpu_defaults``.
    precision: str = "fp32"      # bf16 | fp16 | fp32 (args.training.bf16/fp16 agree)
    cpu_initialization: bool = True   # weights created on the CPU, then sliced per TP rank
    rope_fusion: bool = False    # Transformer Engine's fused RoPE (no host sync per layer)
    fully_parallel_save: bool = False  # the data-parallel ranks share the checkpoint writes
    # environment variables every rank gets before CUDA starts (setdefault: the user's win)
    environment: Tuple[Tuple[str, str], ...] = ()
    # --dataset (and sft's --val_dataset) expanded into the files they name, once
    dataset_sources: Tuple[Any, ...] = ()
    val_dataset_sources: Tuple[Any, ...] = ()
    # --tuner_type lora: what the frozen base weights are (models/lora.base_reference); a
    # LoRA checkpoint records it and a resume on other base weights is refused
    base_model: Optional[str] = None
    # --adapters: the peft adapter being continued, per megatron layer (models/lora_import.py)
    lora_import: Optional[Any] = None
    vocab_size: Optional[int] = None         # the tokenizer's (complete() sets both)
    padded_vocab_size: Optional[int] = None  # the embedding's rows: megatron's padding rule
    # The CPU port's decisions (runtime/cpu.choose; on CUDA these defaults):
    # --trim_host_memory on a CPU run with glibc: the free heap is released before each
    # micro-batch; --cpu_matmul: the linear layers' GEMM on CPU, onednn | mkl
    trim_host_memory: bool = False
    cpu_matmul: Optional[str] = None

    # The flag groups (model, data, training, parallel, checkpoint, logging, sft) read as on
    # the arguments: config.model.hidden_size; properties made below the class.
    @property
    def COMMAND(self) -> str:
        return self.args.COMMAND

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        return self.args.to_dict()

    def complete(self, tokenizer_vocab_size: int, train_samples: Optional[int],
                 padded_vocab_size: Optional[int] = None) -> "RunConfig":
        """This config with the padded vocabulary and, for --num_train_epochs, train_iters
        (whole global batches over ``train_samples``, rounded up). ``padded_vocab_size``:
        the embedding rows of a checkpoint being loaded whole (padded for its own TP)."""
        m, t = self.model, self.training
        check_vocab(m, tokenizer_vocab_size)
        padded = padded_vocab_size or padded_vocab(
            m.vocab_size or tokenizer_vocab_size, m.make_vocab_size_divisible_by,
            self.world.tensor_parallel)
        args = self.args
        if t.num_train_epochs is not None:
            if not train_samples:
                raise ArgumentError("--num_train_epochs needs a training set with samples")
            iters = max(1, math.ceil(t.num_train_epochs * train_samples / t.global_batch_size))
            check_schedule_length(t, iters)
            args = copy.deepcopy(self.args)
            object.__setattr__(args.training, "train_iters", iters)
        return replace(self, args=args, vocab_size=tokenizer_vocab_size,
                       padded_vocab_size=padded)

    def describe(self) -> str:
        """What runs, for the start-up log line: the layer spec and attention, the precision
        (and whether --precision auto chose it), and on CUDA the GPU defaults taken."""
        if self.layer_spec == "transformer_engine":
            what = "Transformer Engine layer spec and fused attention"
        else:
            what = f"megatron local layer spec, attention {LOCAL_ATTENTION[self.attention]}"
        precision = self.precision
        if not {"precision", "bf16", "fp16"} & self.args.explicit:
            precision += " (--precision auto)"
        if self.training.fp8_format:
            precision += f" with FP8 {self.training.fp8_format} ({self.training.fp8_recipe})"
        text = f"{what}, {precision}, {self.backend} on {'CUDA' if self.cuda else 'CPU'}"
        if self.cuda:
            on = {True: "on", False: "off"}
            chosen = [f"weights initialised on the {'CPU' if self.cpu_initialization else 'GPU'}",
                      f"RoPE fusion {on[self.rope_fusion]}",
                      f"fully parallel checkpoint save {on[self.fully_parallel_save]}"]
            chosen += [f"{name}={value}" for name, value in self.environment]
            text += " (" + ", ".join(chosen) + ")"
        text += f", activation recompute {self.describe_recompute()}"
        if self.cpu_matmul:
            text += (", linear layers on oneDNN" if self.cpu_matmul == "onednn"
                     else ", linear layers on torch.matmul (MKL)")
        if self.trim_host_memory:
            text += ", free heap released before each micro-batch (--trim_host_memory)"
        return text


    def describe_recompute(self) -> str:
        t = self.training
        if t.recompute_granularity == "full":
            return (f"full ({t.recompute_method}, {t.recompute_num_layers} layer"
                    f"{'s' if t.recompute_num_layers > 1 else ''})")
        if t.recompute_granularity == "selective":
            return f"selective ({','.join(t.recompute_modules)})"
        return "off"


def _group(name: str) -> property:
    return property(lambda self: getattr(self.args, name), doc=f"The {name} flags.")


for _name in ("model", "data", "training", "parallel", "checkpoint", "logging", "sft",
              "tuner", "rlhf"):
    setattr(RunConfig, _name, _group(_name))


def resolve(args: RunArguments, world_size: Optional[int] = None,
            cuda: Optional[bool] = None, transformer_engine: Optional[bool] = None,
            apex: Optional[bool] = None, weights_only: bool = False) -> RunConfig:
    """Check ``args`` and decide the run. Reads config.json, the data files' headers and the
    hardware; creates nothing, writes nothing, and leaves ``args`` untouched. Raises
    ArgumentError naming the flag. Runs before any process group exists: the world size
    comes from the launcher's environment (WORLD_SIZE) unless given. ``cuda``,
    ``transformer_engine`` and ``apex`` stand in for the hardware (tests simulate a GPU).
    ``weights_only``: only the weights must fit in memory (export, infer)."""
    from .models import footprint
    from .runtime import cpu, hardware

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda is None:
        cuda = hardware.cuda_available()
    if transformer_engine is None:
        transformer_engine = cuda and hardware.transformer_engine_available()
    if apex is None:
        apex = cuda and hardware.apex_available()
    flags = copy.deepcopy(args)
    flags.coerce()
    anchor_paths(flags)
    from .models.families import apply_hf_config

    family = apply_hf_config(flags)  # --model's config.json sets the model flags first
    if flags.model.model:  # its values are checked as the flags were (ranges, finite numbers)
        try:
            check_flags(flags.model)
        except ArgumentError as err:
            raise ArgumentError(f"{err} (from {flags.model.model}/config.json)") from None
    flags.fill_defaults()
    if family is not None and not weights_only:
        check_training_choices(flags, family)
    from .models.lora_import import read_adapter

    lora_import = read_adapter(flags)  # --adapters' adapter_config.json sets the LoRA flags
    flags.check(world_size)
    precision = choose_precision(flags, cuda)
    footprint.check(flags, world_size, cuda, precision, weights_only)  # before anything is built
    backend = check_hardware(flags, cuda)
    check_trackers(flags)
    sources, val_sources = check_inputs(flags)
    attention = choose_attention(flags.model.attention_backend, cuda, transformer_engine)
    attention = choose_window_attention(flags.model, attention)
    attention = choose_hybrid_attention(flags, attention)
    check_delta_net_kernels(flags, cuda)
    layer_spec = "transformer_engine" if attention == "transformer_engine" else "local"
    check_sequence_parallel(flags, cuda, layer_spec, apex)
    check_moe_hardware(flags, cuda, layer_spec)
    choose_grouped_gemm(flags, layer_spec)
    check_mla_hardware(flags, layer_spec)
    check_recompute_hardware(flags, cuda, transformer_engine)
    check_fp8(flags, cuda, layer_spec)
    if flags.logging.record_memory_history and not cuda:
        raise ArgumentError("--record_memory_history records CUDA allocations: it needs a "
                            "CUDA GPU; on CPU drop the flag (--profile's trace still works)")
    base_model = check_lora(flags, layer_spec, cuda)
    packed_rows = "thd" if attention == "transformer_engine" else "block_causal_mask"
    if flags.COMMAND == "sft" and flags.sft.packing and packed_rows == "thd" \
            and flags.training.micro_batch_size != 1:
        raise ArgumentError(
            "--packing with Transformer Engine passes each packed row as one variable-length "
            "batch (THD); set --micro_batch_size 1 and raise --seq_length instead")
    if flags.COMMAND == "sft" and flags.sft.packing and packed_rows == "thd" \
            and flags.model.mtp_num_layers:
        # megatron rolls PackedSeqParams' sequences apart itself; not run here yet
        raise ArgumentError(
            f"--mtp_num_layers {flags.model.mtp_num_layers} with --packing on Transformer "
            f"Engine's variable-length batches (THD): not tested yet; use --attention_backend "
            f"sdpa (packed rows behind a block-causal mask) or drop --packing")
    if flags.COMMAND == "rlhf" and flags.rlhf.packing and packed_rows == "thd":
        raise ArgumentError(
            "rlhf --packing packs rows behind a block-causal mask, not Transformer Engine's "
            "variable-length batches (THD) yet; use --attention_backend sdpa or drop --packing")
    check_context_parallel_hardware(flags, cuda, attention, packed_rows)
    p, t = flags.parallel, flags.training
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    dp = world_size // (tp * pp * cp)
    world = World(world_size=world_size, tensor_parallel=tp, pipeline_parallel=pp,
                  data_parallel=dp,
                  num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
                  expert_parallel=p.expert_model_parallel_size, context_parallel=cp)
    return RunConfig(args=flags.frozen(), world=world, cuda=cuda, backend=backend,
                     layer_spec=layer_spec, attention=attention, packed_rows=packed_rows,
                     dataset_sources=sources, val_dataset_sources=val_sources,
                     precision=precision, base_model=base_model, lora_import=lora_import,
                     **cpu.choose(flags, cuda),
                     **choose_gpu_defaults(flags, world, cuda, transformer_engine))


# Training choices a Hugging Face family may not express: refused before training, as the
# export after it would be.
TRAINING_CHOICES = ("--moe_router_load_balancing_type ",)


def check_training_choices(flags: RunArguments, family) -> None:
    """A run of a family's model (--model FOLDER or --model_type) trains what export writes
    back: a training choice the family cannot express is an ArgumentError naming the flag."""
    m = flags.model
    found = [p for p in family.representation_problems(m) if p.startswith(TRAINING_CHOICES)]
    if found:
        source = f"--model {m.model}" if m.model else f"--model_type {m.model_type}"
        raise ArgumentError(f"{found[0]}: the model of {source} trained so could not be "
                            f"exported as a {family.name} model; use aux_loss, seq_aux_loss "
                            f"or global_aux_loss")


# (group, flag): folders and files a checkpoint records and export, infer or a resume read
# back from its run flags (args.json), whatever directory they run in.
RECORDED_PATHS = (("model", "model"), ("data", "tokenizer"), ("tuner", "adapters"),
                  ("rlhf", "ref_model"), ("checkpoint", "load"))


def anchor_paths(flags: RunArguments) -> None:
    """Each recorded path that exists, made absolute (``~`` expanded), so that a checkpoint
    names it from any working directory. A path that does not exist stays as typed: its
    own check names it as the user gave it."""
    for group, name in RECORDED_PATHS:
        values = getattr(flags, group, None)
        path = getattr(values, name, None) if values is not None else None
        if isinstance(path, str) and path and os.path.exists(os.path.expanduser(path)):
            setattr(values, name, os.path.abspath(os.path.expanduser(path)))


def check_context_parallel_hardware(flags: RunArguments, cuda: bool, attention: str,
                                    packed_rows: str) -> None:
    """--context_parallel_size > 1 needs an attention that sees the other ranks' keys and
    values: Transformer Engine's on GPU (--cp_comm_type), the CPU port's all-gather on CPU
    (in place of torch SDPA; megatron's local DotProductAttention refuses CP)."""
    p = flags.parallel
    cp = p.context_parallel_size
    if cp == 1:
        return
    if cuda:
        if attention != "transformer_engine":
            raise ArgumentError(
                f"--context_parallel_size {cp} on GPU needs Transformer Engine's attention "
                f"(pip install -r requirements/gpu.txt; --attention_backend auto or "
                f"transformer_engine), not --attention_backend {attention}")
        if flags.COMMAND == "sft" and flags.sft.packing and packed_rows == "thd":
            raise ArgumentError(
                f"--packing with --context_parallel_size {cp} on GPU (variable-length THD "
                f"rows split over the group) is not supported yet; drop --packing or use "
                f"--context_parallel_size 1")
        return
    if attention != "sdpa":
        raise ArgumentError(
            f"--context_parallel_size {cp} on CPU needs --attention_backend sdpa or auto "
            f"(megatron's local DotProductAttention refuses context parallelism)")
    if "cp_comm_type" in flags.explicit and p.cp_comm_type != "allgather":
        raise ArgumentError(
            f"--cp_comm_type {p.cp_comm_type} is Transformer Engine's (GPU); on CPU the "
            f"context-parallel attention all-gathers keys and values: drop the flag or give "
            f"allgather")


def check_lora(flags: RunArguments, layer_spec: str, cuda: bool) -> Optional[str]:
    """--tuner_type lora: the layers it targets exist, the layer spec has LoRA layers, and
    what the base weights are (their reference). None for --tuner_type full."""
    if flags.tuner.tuner_type != "lora":
        return None
    from .models import lora

    lora.check(flags, layer_spec)
    if flags.checkpoint.save_safetensors:
        raise ArgumentError("--save_safetensors with --tuner_type lora: convert the LoRA "
                            "checkpoint with `swift-mcore export --to_hf --merge_lora` (merged "
                            "weights) or `export --to_peft` (the adapter)")
    return lora.base_reference(flags, cuda)


def choose_precision(flags: RunArguments, cuda: bool) -> str:
    """--precision (auto: bf16 on CUDA, as Megatron-LM's and Megatron-Bridge's GPU recipes
    train, fp32 on CPU), or --bf16/--fp16. Writes the choice back into ``flags`` (a private
    copy), so args.json records what ran and ``training.bf16/fp16`` agree with it."""
    t = flags.training
    named = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    if named and t.precision not in ("auto", named):
        raise ArgumentError(f"--{named} and --precision {t.precision} disagree; give one")
    precision = named or t.precision
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    elif precision != "fp32" and not cuda:
        which = f"--{precision}" if named else f"--precision {precision}"
        raise ArgumentError(f"{which} needs a CUDA GPU; on CPU swift-mcore trains in float32 "
                            f"(drop {which})")
    t.precision, t.bf16, t.fp16 = precision, precision == "bf16", precision == "fp16"
    return precision


def check_fp8(flags: RunArguments, cuda: bool, layer_spec: str) -> None:
    """FP8 runs Transformer Engine's FP8 GEMMs: a CUDA GPU and TE's layer spec (megatron's
    local linears have no FP8 path). The recipe and the FP8 weights only mean something
    with a format; FP8 weights are all-gathered by the distributed optimizer."""
    t, p = flags.training, flags.parallel
    if t.fp8_format is None:
        for name in ("fp8_recipe", "fp8_param_gather"):
            if name in flags.explicit:
                raise ArgumentError(f"--{name} needs --fp8_format (e4m3 or hybrid)")
        return
    if not cuda:
        raise ArgumentError(f"--fp8_format {t.fp8_format} needs a CUDA GPU with Transformer "
                            f"Engine (FP8 GEMMs); on CPU drop --fp8_format")
    if layer_spec != "transformer_engine":
        raise ArgumentError(f"--fp8_format {t.fp8_format} needs Transformer Engine's layer "
                            f"spec (pip install -r requirements/gpu.txt; --attention_backend "
                            f"auto or transformer_engine)")
    if t.fp8_param_gather and not p.use_distributed_optimizer:
        raise ArgumentError("--fp8_param_gather needs --use_distributed_optimizer (the FP8 "
                            "weights are all-gathered by it)")


def choose_gpu_defaults(flags: RunArguments, world: World, cuda: bool,
                        transformer_engine: bool) -> Dict[str, Any]:
    """The settings that differ on a GPU, chosen as Megatron-LM's defaults are: weights
    initialised on the GPU (its --use-cpu-initialization is off), Transformer Engine's fused
    RoPE (--no-rope-fusion is off; with packed rows the unfused path syncs the host every
    layer), the data-parallel ranks sharing the checkpoint writes (--no-ckpt-fully-parallel-
    save is off) and CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism (which Megatron-LM
    asserts before Blackwell, so that TP communication overlaps compute in launch order). On
    CPU each is what the CPU path always did."""
    if not cuda:
        return {}
    environment = ()
    if world.tensor_parallel > 1:
        environment = (("CUDA_DEVICE_MAX_CONNECTIONS",
                        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")),)
    return {
        "cpu_initialization": False,
        "rope_fusion": transformer_engine and flags.model.position_embedding_type == "rope",
        "fully_parallel_save": world.data_parallel > 1,
        "environment": environment,
    }


def choose_attention(flag: str, cuda: bool, transformer_engine: bool) -> str:
    """--attention_backend -> the core attention that runs. 'auto' is the fastest exact path
    this machine has: Transformer Engine's fused attention with CUDA and TE; torch's SDPA
    without CUDA (the same result within float rounding, faster, and it keeps no attention
    scores for the backward pass: benchmarks/README.md#where-a-training-step-goes);
    megatron's local module on CUDA without TE (SDPA's kernels on a GPU have not been measured against it yet)."""
    if flag == "auto":
        if transformer_engine:
            return "transformer_engine"
        return "local" if cuda else "sdpa"
    if flag == "transformer_engine" and not transformer_engine:
        raise ArgumentError("--attention_backend transformer_engine needs CUDA and "
                            "Transformer Engine (pip install -r requirements/gpu.txt); choose "
                            "auto, local or sdpa")
    return flag


def choose_window_attention(m, attention: str) -> str:
    """The attention for a model with sliding windows or Gemma 3's layers, which only our
    SDPA core attention and the local layer spec implement here: megatron's local
    attention builds its window mask on CUDA only and drops the packed rows' mask with it,
    and Gemma 3's extra norms are local-spec modules. 'auto' becomes sdpa; an explicit other
    backend is refused. Attention sinks (gpt-oss) run on sdpa or local: 'auto' picks sdpa
    over Transformer Engine (arguments/run.py refuses it given explicitly)."""
    if not m.window_size and m.model_type != "gemma3":
        if m.softmax_type != "vanilla" and attention == "transformer_engine":
            # attention sinks: our SDPA's and megatron's local softmax (check_attention
            # refuses an explicit transformer_engine)
            return "sdpa"
        return attention
    if attention == "sdpa":
        return attention
    if m.attention_backend == "auto":
        return "sdpa"
    what = f"--window_size {m.window_size}" if m.window_size else "a gemma3 model"
    raise ArgumentError(f"--attention_backend {m.attention_backend} with {what}: only sdpa "
                        f"runs sliding-window attention and Gemma 3's layers exactly here; "
                        f"use --attention_backend sdpa (or auto)")


def choose_hybrid_attention(flags: RunArguments, attention: str) -> str:
    """The attention of a model with gated delta-net layers or Qwen3-Next's norms, built
    from the local layer spec only (models/hybrid_layers.py): 'auto' there becomes sdpa,
    transformer_engine is refused (packed rows then reach the delta nets as the
    block-causal mask, hybrid_layers.DocumentGatedDeltaNet)."""
    from .arguments.model import HYBRID_MODEL_TYPES

    m = flags.model
    if m.linear_attention_freq is None and m.model_type not in HYBRID_MODEL_TYPES:
        return attention
    if attention != "transformer_engine":
        return attention
    if m.attention_backend == "auto":
        return "sdpa"
    raise ArgumentError("--attention_backend transformer_engine with gated delta-net layers "
                        "or a qwen3_next model: they are built from the local layer spec; "
                        "use --attention_backend sdpa, local or auto")


def check_delta_net_kernels(flags: RunArguments, cuda: bool) -> None:
    """Gated delta-net layers on a GPU run flash-linear-attention's kernels (megatron's
    GatedDeltaNet refuses to be built without them); on CPU the CPU port has its own."""
    from .runtime import hardware

    if cuda and flags.model.linear_attention_freq is not None \
            and not hardware.flash_linear_attention_available():
        raise ArgumentError("--linear_attention_freq (gated delta-net layers, Qwen3-Next and "
                            "Qwen3.5) on a GPU needs flash-linear-attention's kernels: pip "
                            "install flash-linear-attention (requirements/gpu.txt)")


def check_hardware(flags: RunArguments, cuda: bool) -> str:
    """Flags this machine cannot run; returns the process-group backend."""
    p = flags.parallel
    if p.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed_backend nccl needs CUDA; use gloo on CPU")
    if p.distributed_backend == "gloo" and cuda:
        raise ArgumentError("--distributed_backend gloo with CUDA: the model's tensors live on "
                            "the GPU and megatron's collectives on them (reduce-scatter, "
                            "all-gather) need nccl; drop the flag (nccl is the default with "
                            "CUDA), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU")
    return p.distributed_backend or ("nccl" if cuda else "gloo")


def check_sequence_parallel(flags: RunArguments, cuda: bool, layer_spec: str,
                            apex: bool) -> None:
    """--sequence_parallel needs norms that support it: Transformer Engine's (its layer spec)
    or apex's fused LayerNorm on a GPU. megatron's torch norms (the local spec without apex,
    and every RMSNorm of the local spec) assert 'sequence parallel not supported by torch
    LayerNorm'; on CPU the local spec's norms are models/sequence_parallel_norm.py's, whose
    gradients megatron sums over the TP ranks. Not yet measured on a GPU, where the check
    stays as it was. CPU dropout draws from one generator shared by the TP ranks (megatron's
    inference RNG tracker, runtime/seed.py), so each rank's slice of the sequence would get
    the same hidden-dropout mask (and LoRA-input mask): refused."""
    if not flags.parallel.sequence_parallel:
        return
    if not cuda:
        if flags.model.hidden_dropout:
            raise ArgumentError(
                f"--sequence_parallel with --hidden_dropout {flags.model.hidden_dropout} on CPU: "
                f"the tensor-parallel ranks draw dropout from one generator, so each slice of "
                f"the sequence would get the same mask; set --hidden_dropout 0 or drop "
                f"--sequence_parallel")
        if flags.tuner.tuner_type == "lora" and flags.tuner.lora_dropout:
            raise ArgumentError(
                f"--lora_dropout {flags.tuner.lora_dropout:g} with --sequence_parallel on "
                f"CPU: the tensor-parallel ranks draw dropout from one generator, so each "
                f"slice of the sequence would get the same adapter-input mask; set "
                f"--lora_dropout 0 or drop --sequence_parallel")
        return
    if layer_spec == "transformer_engine":
        return
    if apex and flags.model.normalization == "LayerNorm":
        return
    raise ArgumentError(
        "--sequence_parallel needs Transformer Engine's layer spec (--attention_backend auto or "
        "transformer_engine, with transformer-engine installed: pip install "
        "--no-build-isolation -r requirements/gpu.txt), or apex with --normalization "
        "LayerNorm: megatron's torch norms of the local spec do not support it")


def check_moe_hardware(flags: RunArguments, cuda: bool, layer_spec: str) -> None:
    """--moe_grouped_gemm runs the local experts as one grouped GEMM: Transformer Engine's
    (its layer spec, CUDA). On CPU the experts are megatron's SequentialMLP, run in one
    autograd function (runtime/cpu/grouped_experts.py)."""
    if flags.model.moe_grouped_gemm and (not cuda or layer_spec != "transformer_engine"):
        raise ArgumentError("--moe_grouped_gemm needs CUDA and Transformer Engine's layer spec "
                            "(--attention_backend auto or transformer_engine); without them the "
                            "experts run one after another (drop the flag)")
def choose_grouped_gemm(flags: RunArguments, layer_spec: str) -> None:
    """An MoE model on Transformer Engine's layer spec (CUDA) runs its local experts as TE's
    grouped GEMM unless --moe_grouped_gemm was given: Megatron-LM's MoE recipes do, one GEMM
    for all experts in place of one launch per expert. Not with LoRA (the grouped linears
    have no LoRA layer) or expert biases (--add_bias_linear, gpt-oss). The checkpoint keys
    are SequentialMLP's either way (megatron maps both to one expert axis), and the token
    dispatcher stays --moe_token_dispatcher_type's alltoall, the one megatron recommends
    with expert parallelism. Writes the choice into ``flags`` (args.json records it)."""
    m = flags.model
    if (m.num_experts and layer_spec == "transformer_engine"
            and "moe_grouped_gemm" not in flags.explicit
            and flags.tuner.tuner_type != "lora" and not m.add_bias_linear):
        m.moe_grouped_gemm = True


def check_mla_hardware(flags: RunArguments, layer_spec: str) -> None:
    """Multi-latent attention over TP ranks runs on the local spec (models/mla.py); Transformer
    Engine's spec keeps its down projections whole on each rank, not tested here yet."""
    tp = flags.parallel.tensor_model_parallel_size
    if flags.model.multi_latent_attention and tp > 1 and layer_spec == "transformer_engine":
        raise ArgumentError(f"--multi_latent_attention with --tensor_model_parallel_size {tp} "
                            f"on Transformer Engine's layer spec: not supported yet; use "
                            f"--attention_backend sdpa (the local spec)")


def check_recompute_hardware(flags: RunArguments, cuda: bool,
                             transformer_engine: bool) -> None:
    """--recompute_modules layernorm on a GPU without Transformer Engine: megatron-core
    0.16.1's CheckpointWithoutOutput then takes its FP8 path (random.py:636), which imports
    Transformer Engine (on CPU the CPU port, runtime/cpu, passes it by)."""
    t = flags.training
    if (cuda and not transformer_engine and t.recompute_granularity == "selective"
            and "layernorm" in t.recompute_modules):
        raise ArgumentError(
            "--recompute_modules layernorm on a GPU needs Transformer Engine (megatron-core "
            "0.16.1 recomputes the norms through it): pip install --no-build-isolation -r "
            "requirements/gpu.txt, or drop layernorm from --recompute_modules")


def check_trackers(flags: RunArguments) -> None:
    """Every --report_to tracker is installed (whether it starts is known only when it
    does: Trainer.setup, before the first iteration)."""
    import importlib.util

    from .arguments.logging import TRACKERS

    for name in flags.logging.report_to:
        module = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            pins = ("requirements/base.txt" if name == "tensorboard" else
                    "requirements/trackers.txt (or pip install 'swift-mcore[trackers]')")
            raise ArgumentError(f"--report_to {name}: the {module} package is not installed; "
                                f"pip install -r {pins}, or drop {name} from --report_to")


def check_inputs(flags: RunArguments) -> Tuple[tuple, tuple]:
    """The files the flags name: data inputs (headers and sizes only, so bad data stops
    here, before anything is built), checkpoints to resume or load, and whether the model
    can be written as a Hugging Face family when --save_safetensors asks for it. Returns
    the sources --dataset and --val_dataset name."""
    from .data.sources import expand_inputs

    from .arguments.paths import check_run_outputs

    check_run_outputs(flags)  # --output_dir and --data_cache_path are folders one can write
    c, d = flags.checkpoint, flags.data
    for name in ("resume", "load"):
        path = getattr(c, name)
        if path and path != "auto" and not os.path.exists(os.path.expanduser(path)):
            raise ArgumentError(f"--{name} {path}: no such checkpoint folder")
    sources = tuple(expand_inputs(d.dataset, "--dataset")) if d.dataset else ()
    val_sources = ()
    if flags.COMMAND == "sft" and flags.sft.val_dataset:
        val_sources = tuple(expand_inputs(flags.sft.val_dataset, "--val_dataset"))
    if flags.COMMAND not in ("sft", "rlhf"):  # they read rows, not megatron's datasets
        from .data.gpt_datasets import check_data_arguments

        check_data_arguments(d)
    if c.save_safetensors:
        from .models.families import for_model_args

        try:
            for_model_args(flags.model)
        except ArgumentError as err:
            raise ArgumentError(f"--save_safetensors: {err}") from None
    return sources, val_sources


def check_vocab(model_flags, tokenizer_vocab_size: int) -> None:
    if model_flags.vocab_size is not None and tokenizer_vocab_size > model_flags.vocab_size:
        raise ArgumentError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but --vocab_size is "
            f"{model_flags.vocab_size}; raise --vocab_size or leave it unset")


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of divisible_by * TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
