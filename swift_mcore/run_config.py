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
from .arguments.pretrain import PretrainArguments, check_schedule_length
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


@dataclass(frozen=True)
class RunConfig:
    args: PretrainArguments      # read-only: --model's config applied, defaults filled, checked
    world: World
    cuda: bool
    backend: str                 # process-group backend: nccl | gloo
    layer_spec: str              # megatron layer spec: local | transformer_engine
    attention: str               # core attention: local | sdpa | transformer_engine
    packed_rows: str             # how packed sft rows keep conversations apart:
                                 # block_causal_mask (local/sdpa) | thd (TE variable length)
    # --dataset (and sft's --val_dataset) expanded into the files they name, once
    dataset_sources: Tuple[Any, ...] = ()
    val_dataset_sources: Tuple[Any, ...] = ()
    vocab_size: Optional[int] = None         # the tokenizer's (complete() sets both)
    padded_vocab_size: Optional[int] = None  # the embedding's rows: megatron's padding rule

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
        """What runs, for the start-up log line."""
        if self.layer_spec == "transformer_engine":
            what = "Transformer Engine layer spec and fused attention"
        else:
            what = f"megatron local layer spec, attention {LOCAL_ATTENTION[self.attention]}"
        precision = "bf16" if self.training.bf16 else "fp16" if self.training.fp16 else "fp32"
        return f"{what}, {precision}, {self.backend} on {'CUDA' if self.cuda else 'CPU'}"


def _group(name: str) -> property:
    return property(lambda self: getattr(self.args, name), doc=f"The {name} flags.")


for _name in ("model", "data", "training", "parallel", "checkpoint", "logging", "sft"):
    setattr(RunConfig, _name, _group(_name))


def resolve(args: PretrainArguments, world_size: Optional[int] = None,
            cuda: Optional[bool] = None, transformer_engine: Optional[bool] = None
            ) -> RunConfig:
    """Check ``args`` and decide the run. Reads config.json, the data files' headers and the
    hardware; creates nothing, writes nothing, and leaves ``args`` untouched. Raises
    ArgumentError naming the flag. Runs before any process group exists: the world size
    comes from the launcher's environment (WORLD_SIZE) unless given."""
    from .runtime import hardware

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda is None:
        cuda = hardware.cuda_available()
    if transformer_engine is None:
        transformer_engine = cuda and hardware.transformer_engine_available()
    flags = copy.deepcopy(args)
    flags.coerce()
    from .models.families import apply_hf_config

    apply_hf_config(flags)  # --model's config.json sets the model flags before any check
    if flags.model.model:  # its values are checked as the flags were (ranges, finite numbers)
        try:
            check_flags(flags.model)
        except ArgumentError as err:
            raise ArgumentError(f"{err} (from {flags.model.model}/config.json)") from None
    flags.fill_defaults()
    flags.check(world_size)
    backend = check_hardware(flags, cuda)
    check_trackers(flags)
    sources, val_sources = check_inputs(flags)
    attention = choose_attention(flags.model.attention_backend, transformer_engine)
    layer_spec = "transformer_engine" if attention == "transformer_engine" else "local"
    packed_rows = "thd" if attention == "transformer_engine" else "block_causal_mask"
    if flags.COMMAND == "sft" and flags.sft.packing and packed_rows == "thd" \
            and flags.training.micro_batch_size != 1:
        raise ArgumentError(
            "--packing with Transformer Engine passes each packed row as one variable-length "
            "batch (THD); set --micro_batch_size 1 and raise --seq_length instead")
    p, t = flags.parallel, flags.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    world = World(world_size=world_size, tensor_parallel=tp, pipeline_parallel=pp,
                  data_parallel=dp,
                  num_microbatches=t.global_batch_size // (t.micro_batch_size * dp))
    return RunConfig(args=flags.frozen(), world=world, cuda=cuda, backend=backend,
                     layer_spec=layer_spec, attention=attention, packed_rows=packed_rows,
                     dataset_sources=sources, val_dataset_sources=val_sources)


def choose_attention(flag: str, transformer_engine: bool) -> str:
    """--attention_backend -> the core attention that runs. 'auto': Transformer Engine's
    when it is installed (with CUDA), else megatron's local module."""
    if flag == "auto":
        return "transformer_engine" if transformer_engine else "local"
    if flag == "transformer_engine" and not transformer_engine:
        raise ArgumentError("--attention_backend transformer_engine needs CUDA and "
                            "Transformer Engine (pip install -r requirements/gpu.txt); choose "
                            "auto, local or sdpa")
    return flag


def check_hardware(flags: PretrainArguments, cuda: bool) -> str:
    """Flags this machine cannot run; returns the process-group backend."""
    t, p = flags.training, flags.parallel
    if (t.bf16 or t.fp16) and not cuda:
        which = "--bf16" if t.bf16 else "--fp16"
        raise ArgumentError(f"{which} needs a CUDA GPU; on CPU swift-mcore trains in float32 "
                            f"(drop {which})")
    if p.use_distributed_optimizer and not cuda:
        raise ArgumentError("--use_distributed_optimizer needs CUDA; on CPU the plain "
                            "data-parallel optimizer is used (drop the flag)")
    if p.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed_backend nccl needs CUDA; use gloo on CPU")
    if p.sequence_parallel and not cuda:
        raise ArgumentError("--sequence_parallel is supported on CUDA only (the local torch "
                            "norms do not reduce their gradients across TP ranks)")
    return p.distributed_backend or ("nccl" if cuda else "gloo")


def check_trackers(flags: PretrainArguments) -> None:
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


def check_inputs(flags: PretrainArguments) -> Tuple[tuple, tuple]:
    """The files the flags name: data inputs (headers and sizes only, so bad data stops
    here, before anything is built), checkpoints to resume or load, and whether the model
    can be written as a Hugging Face family when --save_safetensors asks for it. Returns
    the sources --dataset and --val_dataset name."""
    from .data.sources import expand_inputs

    c, d = flags.checkpoint, flags.data
    for name in ("resume", "load"):
        path = getattr(c, name)
        if path and path != "auto" and not os.path.exists(os.path.expanduser(path)):
            raise ArgumentError(f"--{name} {path}: no such checkpoint folder")
    sources = tuple(expand_inputs(d.dataset, "--dataset")) if d.dataset else ()
    val_sources = ()
    if flags.COMMAND == "sft" and flags.sft.val_dataset:
        val_sources = tuple(expand_inputs(flags.sft.val_dataset, "--val_dataset"))
    if flags.COMMAND != "sft":
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
