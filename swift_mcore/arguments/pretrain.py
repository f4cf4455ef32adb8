"""PretrainArguments: the per-concern dataclasses composed, validated once, derived once."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Dict, Optional, Set

from .checkpoint import CheckpointArguments
from .data import DataArguments
from ..errors import ArgumentError
from .fields import check_flags, coerce
from .logging import LoggingArguments
from .model import ModelArguments
from .parallel import ParallelArguments
from .training import TrainingArguments


@dataclass(frozen=True)
class Derived:
    """Values computed from the flags and the launch, once, in ``validate``."""

    world_size: int
    data_parallel_size: int
    num_microbatches: int


@dataclass
class PretrainArguments:
    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    training: TrainingArguments = field(default_factory=TrainingArguments)
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    logging: LoggingArguments = field(default_factory=LoggingArguments)
    derived: Optional[Derived] = field(default=None, repr=False)
    # Flags set explicitly (command line, YAML, from_flags): --model's config.json may not
    # silently overrule them.
    explicit: Set[str] = field(default_factory=set, repr=False, compare=False)

    # The command's flag groups (name -> dataclass) and its defaults where they differ from
    # the groups' own (sft finetunes with a smaller learning rate than pt pretrains).
    COMMAND: ClassVar[str] = "pt"
    GROUPS: ClassVar[Dict[str, type]] = {}
    DEFAULTS: ClassVar[Dict[str, Any]] = {}

    def __post_init__(self):
        owner = flag_owners(type(self))
        for name, value in self.DEFAULTS.items():
            setattr(getattr(self, owner[name]), name, value)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_flags(cls, **flags: Any) -> "PretrainArguments":
        """Build from flat flag names, as on the command line: ``from_flags(lr=1e-4)``."""
        args = cls()
        args.update(**flags)
        return args

    def update(self, **flags: Any) -> "PretrainArguments":
        owner = flag_owners(type(self))
        for name, value in flags.items():
            if name not in owner:
                raise ArgumentError(f"unknown flag '{name}'; see `swift-mcore {self.COMMAND} "
                                    f"--help`")
            group = getattr(self, owner[name])
            setattr(group, name, coerce(flag_field(type(self), name), value))
            self.explicit.add(name)
        self.derived = None
        return self

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Plain JSON-ready data, grouped by concern (saved in checkpoints)."""
        return {name: asdict(getattr(self, name)) for name in self.GROUPS}

    def flat(self) -> Dict[str, Any]:
        return {k: v for group in self.to_dict().values() for k, v in group.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    # ---- validation ---------------------------------------------------------------------
    def validate(self, world_size: Optional[int] = None, cuda: Optional[bool] = None) -> Derived:
        """Check every flag and compute derived values. Raises ArgumentError naming the flag.

        Runs before any process group exists: the world size comes from the launcher's
        environment (WORLD_SIZE) unless given.
        """
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        m, t, p, c, lg = self.model, self.training, self.parallel, self.checkpoint, self.logging

        for name in self.GROUPS:
            check_flags(getattr(self, name))

        # --model's config.json (or --model_type) sets the model flags before they are checked.
        from ..models.families import apply_hf_config

        apply_hf_config(self)
        if m.model:  # its values are checked as the flags were (ranges, finite numbers)
            try:
                check_flags(m)
            except ArgumentError as err:
                raise ArgumentError(f"{err} (from {m.model}/config.json)") from None

        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "make_vocab_size_divisible_by"):
            _positive(m, name)
        for name in ("ffn_hidden_size", "num_query_groups", "kv_channels", "vocab_size",
                     "max_position_embeddings"):
            if getattr(m, name) is not None:
                _positive(m, name)
        for name in ("micro_batch_size", "global_batch_size", "train_iters",
                     "nonfinite_skip_limit"):
            _positive(t, name)
        if t.num_train_epochs is not None:
            if "train_iters" in self.explicit and "num_train_epochs" in self.explicit:
                raise ArgumentError("--train_iters and --num_train_epochs are alternatives; "
                                    "give one of them")
            if "train_iters" in self.explicit:
                t.num_train_epochs = None  # the command's default epochs yield to the flag
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            _positive(p, name)
        for name in ("log_interval", "eval_iters"):
            _positive(lg, name)
        # Float flags: finite and in their declared range, checked by check_flags above.
        _non_negative(t, "lr_warmup_iters")
        _non_negative(lg, "eval_steps")
        _non_negative(self.data, "num_workers")
        if t.min_lr > t.lr:
            raise ArgumentError(f"--min_lr ({t.min_lr}) must not exceed --lr ({t.lr})")

        # Model shape.
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise ArgumentError(
                f"--hidden_size ({m.hidden_size}) must be divisible by --num_attention_heads "
                f"({m.num_attention_heads})")
        if m.num_query_groups is not None and m.num_attention_heads % m.num_query_groups:
            raise ArgumentError(
                f"--num_attention_heads ({m.num_attention_heads}) must be divisible by "
                f"--num_query_groups ({m.num_query_groups})")
        if m.ffn_hidden_size is None:
            m.ffn_hidden_size = (
                _round_up(int(8 * m.hidden_size / 3), 64) if m.swiglu else 4 * m.hidden_size)
        if m.max_position_embeddings is None:
            m.max_position_embeddings = m.seq_length
        if m.max_position_embeddings < m.seq_length:
            raise ArgumentError(
                f"--max_position_embeddings ({m.max_position_embeddings}) must be at least "
                f"--seq_length ({m.seq_length})")

        # Parallel layout.
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ArgumentError(
                f"the world size ({world_size} ranks) must be divisible by "
                f"--tensor_model_parallel_size ({tp}) x --pipeline_model_parallel_size ({pp})")
        source = f" (from {m.model}/config.json)" if m.model else ""
        if m.num_attention_heads % tp:
            raise ArgumentError(
                f"--tensor_model_parallel_size ({tp}) must divide --num_attention_heads "
                f"({m.num_attention_heads}){source}")
        groups = m.num_query_groups or m.num_attention_heads
        if groups % tp:
            raise ArgumentError(
                f"--tensor_model_parallel_size ({tp}) must divide --num_query_groups "
                f"({groups}){source}")
        if m.num_layers % pp:
            raise ArgumentError(
                f"--pipeline_model_parallel_size ({pp}) must divide --num_layers "
                f"({m.num_layers}){source}")
        if p.sequence_parallel and tp == 1:
            raise ArgumentError("--sequence_parallel needs --tensor_model_parallel_size > 1")
        if p.sequence_parallel and not cuda:
            raise ArgumentError("--sequence_parallel is supported on CUDA only (the local "
                                "torch norms do not reduce their gradients across TP ranks)")
        dp = world_size // (tp * pp)
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise ArgumentError(
                f"--global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"--micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")

        # Gradient buckets.
        if p.num_buckets is not None and p.num_buckets <= 0:
            raise ArgumentError(
                f"--num_buckets must be a positive integer, got {p.num_buckets}")
        if p.bucket_size is not None and p.bucket_size <= 0:
            raise ArgumentError(
                f"--bucket_size must be a positive integer, got {p.bucket_size}")
        if (p.num_buckets or p.bucket_size) and not p.overlap_grad_reduce:
            raise ArgumentError(
                "--num_buckets/--bucket_size need --overlap_grad_reduce: without overlap "
                "megatron-core reduces all gradients in one bucket")

        # Precision and device.
        if t.bf16 and t.fp16:
            raise ArgumentError("--bf16 and --fp16 are mutually exclusive")
        if (t.bf16 or t.fp16) and not cuda:
            which = "--bf16" if t.bf16 else "--fp16"
            raise ArgumentError(
                f"{which} needs a CUDA GPU; on CPU swift-mcore trains in float32 "
                f"(drop {which})")
        if p.use_distributed_optimizer and not cuda:
            raise ArgumentError(
                "--use_distributed_optimizer needs CUDA; on CPU the plain data-parallel "
                "optimizer is used (drop the flag)")
        if p.distributed_backend == "nccl" and not cuda:
            raise ArgumentError("--distributed_backend nccl needs CUDA; use gloo on CPU")
        if m.attention_backend == "sdpa" and cuda:
            from ..models.gpt import has_transformer_engine

            # Not silently ignored: with TE the model takes TE's layer spec and its attention.
            if has_transformer_engine():
                raise ArgumentError(
                    "--attention_backend sdpa sets the attention of megatron's local layer "
                    "spec, but Transformer Engine is installed, so its layer spec and fused "
                    "attention are used; drop --attention_backend")

        # Checkpoint flags.
        for name in ("save_steps", "save_total_limit", "exit_interval"):
            if getattr(c, name) is not None:
                _positive(c, name)
        if c.finetune and not c.load:
            raise ArgumentError("--finetune needs --load PATH (the checkpoint to take "
                                "weights from)")
        if c.resume and c.load:
            raise ArgumentError("--resume and --load are exclusive: --resume continues a "
                                "run, --load --finetune starts a new one from its weights")
        if c.load and not c.finetune:
            raise ArgumentError("--load PATH takes weights for a new run and needs "
                                "--finetune; to continue a run use --resume PATH")
        for name in ("resume", "load"):
            path = getattr(c, name)
            if path and path != "auto" and not os.path.exists(os.path.expanduser(path)):
                raise ArgumentError(f"--{name} {path}: no such checkpoint folder")

        if c.save_safetensors:
            if c.no_save:
                raise ArgumentError("--save_safetensors converts the final checkpoint; it "
                                    "cannot be combined with --no_save")
            from ..models.families import for_model_args

            try:
                for_model_args(m)
            except ArgumentError as err:
                raise ArgumentError(f"--save_safetensors: {err}") from None

        if t.lr_decay_iters is not None:
            _positive(t, "lr_decay_iters")
        if t.num_train_epochs is None:
            self.check_schedule_length()
        if not str(lg.output_dir).strip():
            raise ArgumentError("--output_dir must not be empty")

        self.validate_command(cuda)

        self.derived = Derived(
            world_size=world_size,
            data_parallel_size=dp,
            num_microbatches=t.global_batch_size // per_step,
        )
        return self.derived

    def validate_command(self, cuda: bool) -> None:
        """The command's own checks. pt's: named inputs exist, blends parse, .bin/.idx pairs
        are whole (headers and sizes only), so bad data stops here, before the model is built."""
        from ..data.gpt_datasets import check_data_arguments

        check_data_arguments(self.data)

    def check_schedule_length(self) -> None:
        t = self.training
        decay = t.lr_decay_iters or t.train_iters
        if t.lr_warmup_iters >= decay:
            raise ArgumentError(
                f"--lr_warmup_iters ({t.lr_warmup_iters}) must be smaller than the decay "
                f"length ({decay}, from --lr_decay_iters or else --train_iters)")

    def resolve_train_iters(self, train_samples: int) -> int:
        """--num_train_epochs -> --train_iters, once the training set's size is known
        (samples, or packed rows with --packing): whole global batches, rounded up."""
        t = self.training
        if t.num_train_epochs is not None:
            t.train_iters = max(1, math.ceil(
                t.num_train_epochs * train_samples / t.global_batch_size))
            self.check_schedule_length()
        return t.train_iters


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of divisible_by * TP."""
    multiple = divisible_by * tp
    return _round_up(vocab_size, multiple)


PretrainArguments.GROUPS = {
    "model": ModelArguments,
    "data": DataArguments,
    "training": TrainingArguments,
    "parallel": ParallelArguments,
    "checkpoint": CheckpointArguments,
    "logging": LoggingArguments,
}


def flag_owners(cls=PretrainArguments) -> Dict[str, str]:
    """flag name -> the group that defines it. Each flag is defined in exactly one group."""
    owners: Dict[str, str] = {}
    for group_name, group_type in cls.GROUPS.items():
        for f in fields(group_type):
            if f.name in owners:
                raise AssertionError(f"flag {f.name} defined in {owners[f.name]} and "
                                     f"{group_name}")
            owners[f.name] = group_name
    return owners


def flag_field(cls, name: str):
    """The dataclass field that defines flag ``name`` for the command ``cls``."""
    return next(f for t in cls.GROUPS.values() for f in fields(t) if f.name == name)


def flag_default(cls, f) -> Any:
    """A flag's default for the command ``cls``: its DEFAULTS entry, else the field's."""
    from dataclasses import MISSING

    if f.name in cls.DEFAULTS:
        return cls.DEFAULTS[f.name]
    return f.default if f.default is not MISSING else f.default_factory()


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def _positive(group, name):
    value = getattr(group, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentError(f"--{name} must be a positive integer, got {value!r}")


def _non_negative(group, name):
    value = getattr(group, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ArgumentError(f"--{name} must be a non-negative number, got {value!r}")
