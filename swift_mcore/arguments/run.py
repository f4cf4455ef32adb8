"""RunArguments: a run's flag groups (pt takes them as they are; sft adds its own), and the
checks that need only the flags."""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Dict, List, Optional, Set, Tuple

from ..errors import ArgumentError
from .checkpoint import CheckpointArguments
from .data import DataArguments
from .fields import check_flags, coerce, field_default, freeze
from .logging import LoggingArguments
from .model import ModelArguments, moe_layer_pattern
from .parallel import ParallelArguments
from .training import DENSE_RECOMPUTE_MODULES, TrainingArguments
from .tuner import TunerArguments


@dataclass
class RunArguments:
    """A run's flags, grouped by concern: what ``run_config.resolve`` makes a RunConfig of.
    ``swift-mcore pt`` takes them as they are; sft adds its group; export and infer resolve
    a model from them. Checks here read nothing but the flags; what needs files, a Hugging Face config or the hardware is ``run_config.resolve``'s."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    training: TrainingArguments = field(default_factory=TrainingArguments)
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    logging: LoggingArguments = field(default_factory=LoggingArguments)
    tuner: TunerArguments = field(default_factory=TunerArguments)
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
    def from_flags(cls, **flags: Any) -> "RunArguments":
        """Build from flat flag names, as on the command line: ``from_flags(lr=1e-4)``."""
        args = cls()
        args.update(**flags)
        return args

    def update(self, **flags: Any) -> "RunArguments":
        owner = flag_owners(type(self))
        for name, value in flags.items():
            if name not in owner:
                raise ArgumentError(f"unknown flag '{name}'; see `swift-mcore {self.COMMAND} "
                                    f"--help`")
            group = getattr(self, owner[name])
            setattr(group, name, coerce(flag_field(type(self), name), value))
            self.explicit.add(name)
        return self

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Plain JSON-ready data, grouped by concern (saved in checkpoints)."""
        return {name: _plain(asdict(getattr(self, name))) for name in self.GROUPS}

    def groups(self):
        return [getattr(self, name) for name in self.GROUPS]

    def frozen(self) -> "RunArguments":
        """A deep copy in which every assignment raises (what the resolved run holds)."""
        return freeze(copy.deepcopy(self), nested=self.GROUPS)

    # ---- the checks that need only the flags ---------------------------------------------
    def coerce(self) -> None:
        """Every value to its flag's type; choices and ranges declared on the flags."""
        for group in self.groups():
            check_flags(group)

    def fill_defaults(self) -> None:
        """Defaults that follow from other flags (the model's from its config, first)."""
        m, t = self.model, self.training
        if m.ffn_hidden_size is None:
            m.ffn_hidden_size = (
                _round_up(int(8 * m.hidden_size / 3), 64) if m.swiglu else 4 * m.hidden_size)
        if m.max_position_embeddings is None:
            m.max_position_embeddings = m.seq_length
        if m.num_experts is not None and m.moe_ffn_hidden_size is None:
            m.moe_ffn_hidden_size = m.ffn_hidden_size
        if t.num_train_epochs is not None and "train_iters" in self.explicit:
            if "num_train_epochs" in self.explicit:
                raise ArgumentError("--train_iters and --num_train_epochs are alternatives; "
                                    "give one of them")
            t.num_train_epochs = None  # the command's default epochs yield to the flag
        if t.recompute_granularity == "full":
            # megatron requires both; every layer's input kept is the usual choice
            t.recompute_method = t.recompute_method or "uniform"
            if t.recompute_num_layers is None:
                t.recompute_num_layers = 1
        self.fill_tracking_defaults()

    def fill_tracking_defaults(self) -> None:
        """--report_to without 'none' or repeats, --tensorboard (an alias) folded into it;
        early stopping judges val_loss unless --metric_for_best names another metric."""
        lg, c = self.logging, self.checkpoint
        names = list(dict.fromkeys(lg.report_to or []))
        if "none" in names:
            if len(names) > 1:
                raise ArgumentError(f"--report_to none cannot be combined with other trackers "
                                    f"(got {','.join(names)})")
            names = []
        if "tensorboard" in self.explicit:
            if "report_to" in self.explicit and lg.tensorboard != ("tensorboard" in names):
                raise ArgumentError(
                    f"--tensorboard {str(lg.tensorboard).lower()} contradicts --report_to "
                    f"{','.join(names) or 'none'}; give --report_to alone (--tensorboard is "
                    f"its older alias)")
            if lg.tensorboard and "tensorboard" not in names:
                names.insert(0, "tensorboard")
            elif not lg.tensorboard:
                names = [n for n in names if n != "tensorboard"]
        lg.report_to = names
        lg.tensorboard = "tensorboard" in names
        if c.early_stopping_patience is not None and c.metric_for_best is None:
            c.metric_for_best = "val_loss"

    def check(self, world_size: int) -> None:
        """Ranges and combinations of the flags, and the layout over ``world_size`` ranks.
        Raises ArgumentError naming the flag and what it accepts."""
        m, t, p, lg = self.model, self.training, self.parallel, self.logging
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
        if t.lr_decay_iters is not None:
            _positive(t, "lr_decay_iters")
        if t.num_train_epochs is None:
            check_schedule_length(t, t.train_iters)
        elif self.data.data_order == "megatron" and self.COMMAND not in ("sft", "rlhf"):
            raise ArgumentError("--data_order megatron sizes the data by --train_iters (as "
                                "Megatron-LM does); give --train_iters, not --num_train_epochs")
        self.check_profile(world_size)
        if not str(lg.output_dir).strip():
            raise ArgumentError("--output_dir must not be empty")
        self.check_model_shape(world_size)
        self.check_parallel(world_size)
        self.check_moe(world_size)
        self.check_attention()
        self.check_mtp()
        self.check_recompute()
        self.check_checkpoint_flags()
        self.check_best_flags()
        self.check_tuner()
        if self.data.streaming and self.COMMAND not in ("pt", "sft"):
            raise ArgumentError(f"--streaming reads pt and sft data; `swift-mcore "
                                f"{self.COMMAND}` reads its rows whole (leave it out)")
        if "shuffle_buffer_size" in self.explicit and not self.data.streaming:
            raise ArgumentError("--shuffle_buffer_size sizes --streaming's shuffle buffer; "
                                "without --streaming every row is shuffled by --seed (add "
                                "--streaming, or leave it out)")
        self.check_command()

    def check_profile(self, world_size: int) -> None:
        """--profile's iterations and ranks; its companions only with it."""
        lg = self.logging
        companions = ("profile_step_start", "profile_step_end", "profile_ranks",
                      "record_memory_history")
        if not lg.profile:
            given = [name for name in companions if name in self.explicit]
            if given:
                raise ArgumentError(f"--{given[0]} needs --profile")
            return
        _positive(lg, "profile_step_start")
        if lg.profile_step_end < lg.profile_step_start:
            raise ArgumentError(f"--profile_step_end ({lg.profile_step_end}) must not be "
                                f"below --profile_step_start ({lg.profile_step_start})")
        outside = [r for r in lg.profile_ranks if not 0 <= r < world_size]
        if outside or not lg.profile_ranks:
            raise ArgumentError(f"--profile_ranks {outside or '(none)'}: ranks are 0 to "
                                f"{world_size - 1} in this world of {world_size}")

    def check_model_shape(self, world_size: int) -> None:
        m, p = self.model, self.parallel
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise ArgumentError(
                f"--hidden_size ({m.hidden_size}) must be divisible by --num_attention_heads "
                f"({m.num_attention_heads})")
        if m.num_query_groups is not None and m.num_attention_heads % m.num_query_groups:
            raise ArgumentError(
                f"--num_attention_heads ({m.num_attention_heads}) must be divisible by "
                f"--num_query_groups ({m.num_query_groups})")
        if m.max_position_embeddings < m.seq_length:
            raise ArgumentError(
                f"--max_position_embeddings ({m.max_position_embeddings}) must be at least "
                f"--seq_length ({m.seq_length})")
        tp = p.tensor_model_parallel_size
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
        self.pipeline_stage_layers(source)
        self.check_window()
        self.check_vision()

    UNEVEN_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                    "account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split")

    def pipeline_stage_layers(self, source: str = "") -> List[int]:
        """The transformer layers of each pipeline stage (all its model chunks together), as
        megatron splits them (see pipeline_chunk_layers). Raises ArgumentError naming the
        flag where megatron would refuse the split; the even split's chunks are checked
        with the interleaved schedule's other flags (check_virtual_pipeline)."""
        p = self.parallel
        stages = self._stage_places(source, self._virtual_stages_checked() or 1)
        stages[0] -= int(p.account_for_embedding_in_pipeline_split)
        stages[-1] -= int(p.account_for_loss_in_pipeline_split)
        return stages

    def pipeline_chunk_layers(self, source: str = "") -> List[List[range]]:
        """The global numbers of the transformer layers megatron builds in each model chunk,
        [pipeline stage][virtual stage] (one chunk per stage without the interleaved
        schedule), split evenly, with --decoder_first/last_pipeline_num_layers, or with the
        embedding and loss counted as layers (megatron-core's get_num_layers_to_build and
        get_transformer_layer_offset). The chunks hold consecutive layers in pipeline order:
        virtual stage 0 of every pipeline stage, then virtual stage 1, and so on; a counted
        embedding takes the first place of the first chunk and a counted loss the last place
        of the last one, so those chunks hold one layer fewer (none, where a chunk is one
        place). Raises ArgumentError naming the flag where megatron would refuse the split."""
        m, p = self.model, self.parallel
        pp, n = p.pipeline_model_parallel_size, m.num_layers
        vp = self._virtual_stages_checked()
        places = self._stage_places(source, vp or 1)
        self._check_even_chunks(vp)
        embedding = int(p.account_for_embedding_in_pipeline_split)
        chunks: List[List[range]] = [[] for _ in range(pp)]
        place = 0
        for _ in range(vp or 1):
            for stage in range(pp):
                size = places[stage] // (vp or 1)
                # places [place, place + size); the counted embedding is place 0 and the
                # counted loss place n + embedding: neither is a layer
                chunks[stage].append(range(max(place - embedding, 0),
                                           min(place + size - embedding, n)))
                place += size
        return chunks

    def _virtual_stages_checked(self) -> Optional[int]:
        """virtual_stages(), its flag checked positive first (pipeline_chunk_layers runs
        before check_virtual_pipeline); None without the interleaved schedule or with one
        stage (check_virtual_pipeline refuses that)."""
        p = self.parallel
        for name in ("num_virtual_stages_per_pipeline_rank",
                     "num_layers_per_virtual_pipeline_stage"):
            if getattr(p, name) is not None:
                _positive(p, name)
        vp = self.virtual_stages()
        return vp if vp and p.pipeline_model_parallel_size > 1 else None

    def _check_even_chunks(self, vp: Optional[int]) -> None:
        """The even split with the interleaved schedule: PP x vp equal chunks."""
        m, p = self.model, self.parallel
        pp, n = p.pipeline_model_parallel_size, m.num_layers
        uneven = any(getattr(p, name) is not None and getattr(p, name) is not False
                     for name in self.UNEVEN_FLAGS)
        if uneven or not vp or vp < 2 or n % (pp * vp) == 0:  # uneven: _stage_places
            return
        flag = ("num_virtual_stages_per_pipeline_rank"
                if p.num_virtual_stages_per_pipeline_rank is not None
                else "num_layers_per_virtual_pipeline_stage")
        raise ArgumentError(
            f"--{flag} {getattr(p, flag)}: --num_layers ({n}) must split into "
            f"--pipeline_model_parallel_size ({pp}) x virtual stages ({vp}) equal chunks")

    def _stage_places(self, source: str, vp: int) -> List[int]:
        """Each pipeline stage's places: its layers, and the embedding (loss) on the first
        (last) stage when counted as a layer; every stage's in ``vp`` equal chunks."""
        m, p = self.model, self.parallel
        pp, n = p.pipeline_model_parallel_size, m.num_layers
        first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
        given = [name for name in self.UNEVEN_FLAGS
                 if getattr(p, name) is not None and getattr(p, name) is not False]
        per_chunk = p.num_layers_per_virtual_pipeline_stage
        if not given:
            if n % pp:
                raise ArgumentError(
                    f"--pipeline_model_parallel_size ({pp}) must divide --num_layers "
                    f"({n}){source}")
            return [n // pp] * pp
        if pp == 1:
            raise ArgumentError(f"--{given[0]} needs --pipeline_model_parallel_size > 1")
        if first is not None or last is not None:
            if per_chunk is not None:
                # Megatron-LM's arguments.py refuses it too ("please use
                # --num-virtual-stages-per-pipeline-rank ... uneven pipeline parallelism")
                raise ArgumentError(
                    f"--num_layers_per_virtual_pipeline_stage with --{given[0]}: the uneven "
                    f"stages' chunks differ in size, so no one chunk size describes them "
                    f"(Megatron-LM refuses it too); give --num_virtual_stages_per_pipeline_rank "
                    f"instead")
            if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
                named = given[-1]
                raise ArgumentError(f"--{given[0]} and --{named} both decide the split; give "
                                    f"the first/last stage's layers or the accounting, not both")
            for name, value in (("decoder_first_pipeline_num_layers", first),
                                ("decoder_last_pipeline_num_layers", last)):
                if value is not None and value < 1:
                    raise ArgumentError(f"--{name} must be at least 1 (got {value})")
            middle = pp - (first is not None) - (last is not None)
            rest = n - (first or 0) - (last or 0)
            if (middle == 0 and rest != 0) or (middle and (rest < middle or rest % middle)):
                raise ArgumentError(
                    f"--{given[0]}: the other {middle} pipeline stage(s) must split the "
                    f"remaining {rest} of --num_layers ({n}) evenly, at least one layer each")
            each = rest // middle if middle else 0
            stages = ([first if first is not None else each] + [each] * (pp - 2)
                      + [last if last is not None else each])
            if vp > 1 and any(s % vp for s in stages):
                # megatron's interleaved split: every stage in vp equal chunks
                # (transformer_config.py, the uneven pipeline's checks)
                raise ArgumentError(
                    f"--{given[0]} with --num_virtual_stages_per_pipeline_rank {vp}: each "
                    f"pipeline stage's layers ({', '.join(map(str, stages))}) must split "
                    f"into {vp} equal virtual stages")
            return stages
        counted = [name for name in given if name.startswith("account_for_")]
        total = n + len(counted)
        what = (f"--num_layers ({n}) plus the counted "
                f"{' and '.join(name.split('_')[2] for name in counted)}")
        if total % pp:
            raise ArgumentError(
                f"--{given[0]}: {what} ({total}) must split evenly over "
                f"--pipeline_model_parallel_size ({pp})")
        share = total // pp
        if per_chunk is not None and share % per_chunk:
            raise ArgumentError(
                f"--num_layers_per_virtual_pipeline_stage {per_chunk} with --{given[0]}: each "
                f"pipeline stage's {share} places ({what}, {total}, over "
                f"--pipeline_model_parallel_size {pp}) must split into chunks of "
                f"{per_chunk}")
        if share % vp:
            raise ArgumentError(
                f"--{given[0]} with --num_virtual_stages_per_pipeline_rank {vp}: each "
                f"pipeline stage's {share} places ({what}, {total}, over "
                f"--pipeline_model_parallel_size {pp}) must split into {vp} equal virtual "
                f"stages")
        return [share] * pp

    def check_window(self) -> None:
        """The sliding-window flags: a pattern needs a window; the local RoPE base is Gemma
        3's (only its attention swaps RoPE tables)."""
        from .model import window_layer_pattern

        m = self.model
        if m.window_attn_skip_freq is not None and not m.window_size:
            raise ArgumentError("--window_attn_skip_freq needs --window_size")
        window_layer_pattern(m)
        if m.rotary_base_local is not None and m.model_type != "gemma3":
            raise ArgumentError("--rotary_base_local is Gemma 3's local RoPE base: it needs "
                                "--model_type gemma3")
        self.check_linear_attention()

    def check_linear_attention(self) -> None:
        """The gated delta-net flags (megatron's GatedDeltaNet): its value heads group its key
        heads, TP splits whole key heads and needs --sequence_parallel (megatron sums the
        per-head output norm's partial gradients over the TP ranks only then); the output
        gate is not megatron's for MLA."""
        from .model import linear_attention_pattern

        m, p = self.model, self.parallel
        if m.attention_output_gate and m.multi_latent_attention:
            raise ArgumentError("--attention_output_gate with --multi_latent_attention is not "
                                "supported by megatron-core; drop one")
        if not linear_attention_pattern(m):
            return
        if m.linear_num_value_heads % m.linear_num_key_heads:
            raise ArgumentError(f"--linear_num_value_heads ({m.linear_num_value_heads}) must be "
                                f"a multiple of --linear_num_key_heads "
                                f"({m.linear_num_key_heads})")
        tp = p.tensor_model_parallel_size
        if m.linear_num_key_heads % tp:
            raise ArgumentError(f"--tensor_model_parallel_size ({tp}) must divide "
                                f"--linear_num_key_heads ({m.linear_num_key_heads})")
        if tp > 1 and not p.sequence_parallel:
            raise ArgumentError(f"--tensor_model_parallel_size {tp} with gated delta-net layers "
                                f"(--linear_attention_freq) needs --sequence_parallel (the "
                                f"delta nets' output norm sums its gradients over the TP ranks "
                                f"only then); add --sequence_parallel")
        if m.multi_latent_attention:
            raise ArgumentError("--linear_attention_freq with --multi_latent_attention is not "
                                "supported; drop one")

    # sft's video flags (arguments/sft.py), of vision-language models only
    VIDEO_FLAGS = ("fps", "fps_min_frames", "fps_max_frames", "video_min_pixels",
                   "video_max_pixels", "video_total_pixels")

    def check_vision(self) -> None:
        """The vision-language flags come together (a Qwen2.5-VL folder sets all three);
        its vision tower sits on one stage and joins the sequence before it is split."""
        import json

        m, p = self.model, self.parallel
        given = [f"--{name}" for name, on in (
            ("position_embedding_type mrope", m.position_embedding_type == "mrope"),
            ("mrope_section", m.mrope_section is not None),
            ("vision_config", m.vision_config is not None)) if on]
        # values other than the defaults (a checkpoint's saved flags restate the defaults)
        t, s = self.tuner, getattr(self, "sft", None)
        freeze = [f"--{name} {value}" for name, value, default in (
            ("freeze_vit", t.freeze_vit, True), ("freeze_aligner", t.freeze_aligner, True),
            ("freeze_llm", t.freeze_llm, False),
            ("max_pixels", getattr(s, "max_pixels", None), None),
            ("min_pixels", getattr(s, "min_pixels", None), None),
            *((name, getattr(s, name, None), None) for name in self.VIDEO_FLAGS),
            ("vit_lr", self.training.vit_lr, None),
            ("aligner_lr", self.training.aligner_lr, None)) if value != default]
        if freeze and not given:
            raise ArgumentError(f"{freeze[0]} is a flag of vision-language models; this is "
                                f"a text model (give a Qwen2.5-VL --model folder)")
        if not given:
            return
        if s is not None and self.data.streaming:
            raise ArgumentError("--streaming with a vision-language model: not supported yet "
                                "(its image rows are read whole with --dataset)")
        if s is not None and s.max_pixels and s.min_pixels and s.min_pixels > s.max_pixels:
            raise ArgumentError(f"--min_pixels {s.min_pixels} is above --max_pixels "
                                f"{s.max_pixels}")
        if s is not None:
            s.check_video_flags()
        for flag_name, lr, frozen, part in (
                ("--vit_lr", self.training.vit_lr, t.freeze_vit, "--freeze_vit"),
                ("--aligner_lr", self.training.aligner_lr, t.freeze_aligner,
                 "--freeze_aligner")):
            if lr is not None and (frozen or t.tuner_type != "full"):
                raise ArgumentError(f"{flag_name} {lr}: that part does not train here (it "
                                    f"needs --tuner_type full and {part} false)")
        if t.freeze_vit and t.freeze_aligner and t.freeze_llm:
            raise ArgumentError("--freeze_vit, --freeze_aligner and --freeze_llm together "
                                "leave nothing to train (with --tuner_type lora: nothing to "
                                "put adapters on)")
        if t.tuner_type == "lora" and t.freeze_llm and (t.target_regex or t.adapters):
            raise ArgumentError(f"--freeze_llm True with "
                                f"{'--target_regex' if t.target_regex else '--adapters'}: "
                                f"those choose the language model's adapters, which "
                                f"--freeze_llm leaves out")
        if len(given) < 3:
            raise ArgumentError(f"{' and '.join(given)}: a vision-language model needs "
                                f"--position_embedding_type mrope, --mrope_section and "
                                f"--vision_config together (a Qwen2.5-VL --model folder sets "
                                f"them)")
        try:
            section = json.loads(m.mrope_section)
            vision = json.loads(m.vision_config)
        except (TypeError, ValueError):
            raise ArgumentError("--mrope_section and --vision_config are JSON (a list of three "
                                "integers; an object)") from None
        head = m.kv_channels or m.hidden_size // m.num_attention_heads
        if not (isinstance(section, list) and len(section) == 3 and all(
                type(s) is int and s >= 0 for s in section) and 2 * sum(section) == head):
            raise ArgumentError(f"--mrope_section {m.mrope_section} must be three integers "
                                f"summing to half the head size ({head // 2})")
        if not isinstance(vision, dict) or not isinstance(vision.get("vision_config"), dict):
            raise ArgumentError("--vision_config must be a JSON object with a vision_config "
                                "object (a Qwen2.5-VL --model folder sets it)")
        given_vp = [f"--{name}" for name in ("num_virtual_stages_per_pipeline_rank",
                                             "num_layers_per_virtual_pipeline_stage")
                    if getattr(p, name) is not None]
        if given_vp:
            raise ArgumentError(f"{given_vp[0]} (the interleaved pipeline schedule) with a "
                                f"vision-language model is not supported yet; drop it (plain "
                                f"pipeline stages work)")
        self.check_deepstack_stage(vision["vision_config"])

    def check_deepstack_stage(self, vision: dict) -> None:
        """Qwen3-VL adds its deepstack features after the first decoder layers: the tower
        is on the first pipeline stage, so those layers must be there too."""
        p = self.parallel
        deepstack = vision.get("deepstack_visual_indexes") or []
        if p.pipeline_model_parallel_size == 1 or not deepstack:
            return
        first = self.pipeline_stage_layers()[0]
        if first < len(deepstack):
            raise ArgumentError(
                f"--pipeline_model_parallel_size {p.pipeline_model_parallel_size}: the first "
                f"pipeline stage holds {first} decoder layer(s), but Qwen3-VL adds its "
                f"{len(deepstack)} deepstack features (vision_config.deepstack_visual_indexes) "
                f"after layers 0..{len(deepstack) - 1}, next to the tower; give it at least "
                f"{len(deepstack)} with --decoder_first_pipeline_num_layers or use fewer "
                f"stages")

    def check_attention(self) -> None:
        """Multi-latent attention's flags, YaRN's and gpt-oss's (attention sinks, the
        clamped SwiGLU)."""
        m, p = self.model, self.parallel
        if m.rope_type == "yarn" and not m.multi_latent_attention \
                and m.model_type != "gpt_oss":
            raise ArgumentError("--rope_type yarn is multi-latent attention's RoPE or "
                                "gpt-oss's here; it needs --multi_latent_attention or "
                                "--model_type gpt_oss")
        if m.rope_type == "yarn" and m.position_embedding_type != "rope":
            raise ArgumentError(f"--rope_type yarn with --position_embedding_type "
                                f"{m.position_embedding_type}: YaRN scales RoPE (rope only)")
        if m.activation_func_clamp_value is not None and m.model_type != "gpt_oss":
            raise ArgumentError("--activation_func_clamp_value is gpt-oss's clamped SwiGLU: "
                                "it needs --model_type gpt_oss")
        if m.softmax_type != "vanilla" and m.attention_backend == "transformer_engine":
            raise ArgumentError(f"--softmax_type {m.softmax_type} with --attention_backend "
                                f"transformer_engine: not tested here; use sdpa, local or "
                                f"auto (sdpa)")
        if not m.multi_latent_attention:
            return
        if not m.yarn_truncate:
            raise ArgumentError("--yarn_truncate false with --multi_latent_attention: "
                                "megatron's MLA rounds YaRN's correction range; only true")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            _positive(m, name)
        if m.q_lora_rank is not None:
            _positive(m, "q_lora_rank")
        if m.qk_pos_emb_head_dim % 2:
            raise ArgumentError(f"--qk_pos_emb_head_dim {m.qk_pos_emb_head_dim} must be even "
                                f"(RoPE rotates channel pairs)")
        if m.attention_backend == "local":
            raise ArgumentError("--multi_latent_attention with --attention_backend local: "
                                "megatron's local attention cannot take MLA's head sizes; "
                                "use sdpa, transformer_engine or auto")
        tp = p.tensor_model_parallel_size
        # the local spec's down projections are column-parallel: TP splits their outputs
        for name, width in (("--q_lora_rank", m.q_lora_rank),
                            ("--kv_lora_rank + --qk_pos_emb_head_dim",
                             m.kv_lora_rank + m.qk_pos_emb_head_dim)):
            if width is not None and width % tp:
                raise ArgumentError(f"--tensor_model_parallel_size {tp} must divide {name} "
                                    f"({width}): the local spec splits multi-latent "
                                    f"attention's down projections over the TP ranks")

    def check_mtp(self) -> None:
        """Multi-token prediction (--mtp_num_layers): what swift-mcore runs it with so far.
        megatron places every MTP layer on the last pipeline stage (the last rank's last
        virtual chunk under the interleaved schedule), with a copy of the embedding there
        (tested at PP=2, PP=2 x 2 virtual stages, and TP=2 with sequence parallelism); it
        runs with LoRA, context parallelism and packed rows too."""
        m, t = self.model, self.training
        if not m.mtp_num_layers:
            # (a saved run's flags, all explicit, hold the default)
            if "mtp_loss_scaling_factor" in self.explicit and m.mtp_loss_scaling_factor != \
                    flag_field(type(self), "mtp_loss_scaling_factor").default:
                raise ArgumentError("--mtp_loss_scaling_factor weighs the multi-token "
                                    "prediction loss: it needs --mtp_num_layers N > 0")
            return
        n = f"--mtp_num_layers {m.mtp_num_layers}"
        refusals = [
            (self.COMMAND == "rlhf",
             f"{n} with rlhf: the preference loss has no multi-token prediction term; drop "
             f"the flag (or give 0 to leave a folder's MTP layers out)"),
            (bool(getattr(getattr(self, "sft", None), "packing", False))
             and m.position_embedding_type == "mrope",
             f"{n} with --packing and multimodal positions (mrope): not supported yet (the "
             f"next-token shift is kept inside each conversation by its text position ids); "
             f"drop --packing"),
            (bool(m.window_size) and str(m.window_attn_skip_freq or "").lstrip().startswith("["),
             f"{n} with a per-layer --window_attn_skip_freq {m.window_attn_skip_freq} (gpt-oss's "
             f"layer_types): megatron-core 0.16.1 looks an MTP layer up in that list by its "
             f"layer number, past --num_layers; not supported"),
            (t.recompute_granularity == "full" and t.recompute_method == "uniform"
             and t.recompute_num_layers != 1,
             f"{n} with --recompute_method uniform needs --recompute_num_layers 1 (megatron "
             f"recomputes each MTP layer alone)"),
        ]
        for broken, message in refusals:
            if broken:
                raise ArgumentError(message)

    def check_parallel(self, world_size: int) -> None:
        p, t = self.parallel, self.training
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        _positive(p, "context_parallel_size")
        cp = p.context_parallel_size
        if world_size % (tp * pp * cp):
            cp_part = f" x --context_parallel_size ({cp})" if cp > 1 else ""
            raise ArgumentError(
                f"the world size ({world_size} ranks) must be divisible by "
                f"--tensor_model_parallel_size ({tp}) x --pipeline_model_parallel_size "
                f"({pp}){cp_part}")
        if p.sequence_parallel and tp == 1:
            raise ArgumentError("--sequence_parallel needs --tensor_model_parallel_size > 1")
        seq = self.model.seq_length
        if p.sequence_parallel and cp == 1 and seq % tp and self.fixed_width_rows():
            # megatron scatters each row's positions over the TP ranks (an AssertionError
            # in the first forward pass otherwise)
            raise ArgumentError(
                f"--seq_length ({seq}) must be a multiple of --tensor_model_parallel_size "
                f"({tp}) with --sequence_parallel: each tensor-parallel rank holds an equal "
                f"share of every row's {self.fixed_width_rows()}")
        self.check_context_parallel()
        dp = world_size // (tp * pp * cp)
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ArgumentError(
                f"--global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"--micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp})")
        for name in ("num_buckets", "bucket_size"):
            if getattr(p, name) is not None:
                _positive(p, name)
        if (p.num_buckets or p.bucket_size) and not p.overlap_grad_reduce:
            raise ArgumentError(
                "--num_buckets/--bucket_size need --overlap_grad_reduce: without overlap "
                "megatron-core reduces all gradients in one bucket")
        if t.bf16 and t.fp16:
            raise ArgumentError("--bf16 and --fp16 are mutually exclusive")
        self.check_virtual_pipeline(dp)
        self.check_param_gather()

    def fixed_width_rows(self) -> str:
        """What makes every row --seq_length positions wide ('' where rows are padded to a
        width the parallel layout splits): pt's rows are --seq_length tokens."""
        return "--seq_length tokens"

    def check_param_gather(self) -> None:
        """--overlap_param_gather and --align_param_gather: megatron's DDP options of the
        distributed optimizer's weight all-gather (Megatron-LM asks the same)."""
        p = self.parallel
        if p.overlap_param_gather and not (p.use_distributed_optimizer
                                           and p.overlap_grad_reduce):
            raise ArgumentError(
                "--overlap_param_gather all-gathers the distributed optimizer's weights: it "
                "needs --use_distributed_optimizer and --overlap_grad_reduce")
        if p.align_param_gather and not (p.overlap_param_gather and self.virtual_stages()):
            raise ArgumentError(
                "--align_param_gather aligns the weight all-gathers of the interleaved "
                "pipeline's model chunks: it needs --overlap_param_gather and "
                "--num_virtual_stages_per_pipeline_rank (or "
                "--num_layers_per_virtual_pipeline_stage)")

    def virtual_stages(self) -> Optional[int]:
        """Model chunks per pipeline rank of the interleaved schedule (None: not interleaved)."""
        p, m = self.parallel, self.model
        if p.num_virtual_stages_per_pipeline_rank is not None:
            return p.num_virtual_stages_per_pipeline_rank
        if p.num_layers_per_virtual_pipeline_stage is not None:
            # Megatron-LM's arguments.py: the counted embedding and loss are places too
            places = (m.num_layers + int(p.account_for_embedding_in_pipeline_split)
                      + int(p.account_for_loss_in_pipeline_split))
            return places // (p.pipeline_model_parallel_size
                              * p.num_layers_per_virtual_pipeline_stage)
        return None

    def check_context_parallel(self) -> None:
        """--context_parallel_size: megatron cuts each sequence into 2 x CP chunks (x TP
        under --sequence_parallel), so --seq_length must split into them; the parts of the
        run that do not take a cut sequence yet are refused."""
        m, p = self.model, self.parallel
        cp = p.context_parallel_size
        if cp == 1:
            if "cp_comm_type" in self.explicit and p.cp_comm_type != "p2p":
                raise ArgumentError("--cp_comm_type needs --context_parallel_size > 1")
            return
        unit = 2 * cp * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
        if m.seq_length % unit:
            what = " x --tensor_model_parallel_size (--sequence_parallel)" \
                if p.sequence_parallel else ""
            raise ArgumentError(
                f"--seq_length ({m.seq_length}) must be a multiple of 2 x "
                f"--context_parallel_size{what} ({unit}): each context-parallel rank holds "
                f"two of {2 * cp} equal chunks of every sequence")
        refused = [*self.rlhf_refused_with_cp()]
        for what, given in refused:
            if given:
                raise ArgumentError(f"--context_parallel_size {cp} with {what} is not "
                                    f"supported yet; use --context_parallel_size 1")

    def rlhf_refused_with_cp(self) -> list:
        """(what, given) for the rlhf runs that do not take a cut sequence yet: none (every
        task sums each sequence's parts over the group; rm reads its score where the last
        token lives)."""
        return []

    def check_virtual_pipeline(self, dp: int) -> None:
        """The interleaved schedule: PP > 1, equal chunks, and micro-batches that megatron's
        schedule can group by PP (its microbatch_group_size_per_vp_stage)."""
        p, t = self.parallel, self.training
        given = [name for name in ("num_virtual_stages_per_pipeline_rank",
                                   "num_layers_per_virtual_pipeline_stage")
                 if getattr(p, name) is not None]
        if not given:
            return
        if len(given) == 2:
            raise ArgumentError("--num_virtual_stages_per_pipeline_rank and "
                                "--num_layers_per_virtual_pipeline_stage say the same; give one")
        _positive(p, given[0])
        pp = p.pipeline_model_parallel_size
        if pp == 1:
            raise ArgumentError(f"--{given[0]} needs --pipeline_model_parallel_size > 1 (with "
                                f"one stage there is no pipeline to interleave)")
        vp = self.virtual_stages()
        if vp < 2:
            raise ArgumentError(
                f"--{given[0]} {getattr(p, given[0])} gives {max(vp, 0)} virtual stage(s) per "
                f"pipeline rank; the interleaved schedule needs 2 or more")
        self._check_even_chunks(vp)
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        if micro % pp:
            raise ArgumentError(
                f"--{given[0]}: the interleaved schedule runs the micro-batches in groups of "
                f"--pipeline_model_parallel_size ({pp}); this run has {micro} per iteration "
                f"(--global_batch_size / (--micro_batch_size x DP)): make it a multiple")

    def check_moe(self, world_size: int) -> None:
        """The mixture-of-experts flags: experts, top-k, the layer pattern, and expert
        parallelism (EP) inside the layout (megatron: EP x TP x PP divides the world)."""
        m, p = self.model, self.parallel
        ep, tp, pp = (p.expert_model_parallel_size, p.tensor_model_parallel_size,
                      p.pipeline_model_parallel_size)
        _positive(p, "expert_model_parallel_size")
        if p.expert_tensor_parallel_size is not None:
            _positive(p, "expert_tensor_parallel_size")
        source = f" (from {m.model}/config.json)" if m.model else ""
        if m.num_experts is None:
            # (a value equal to the default changes nothing: args.json replays every flag)
            defaults = {f.name: field_default(f) for f in fields(ModelArguments)}
            given = sorted(name for name in MOE_FLAGS if name in self.explicit
                           and getattr(m, name) != defaults[name])
            if given:
                raise ArgumentError(f"--{given[0]} configures mixture-of-experts layers; it "
                                    f"needs --num_experts N (routed experts per layer)")
            if ep > 1:
                raise ArgumentError(f"--expert_model_parallel_size {ep} splits the experts of "
                                    f"MoE layers; it needs --num_experts")
            if p.expert_tensor_parallel_size not in (None, tp):
                raise ArgumentError(f"--expert_tensor_parallel_size "
                                    f"{p.expert_tensor_parallel_size} splits the experts of "
                                    f"MoE layers; it needs --num_experts")
            return
        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            _positive(m, name)
        if m.moe_shared_expert_intermediate_size is not None:
            _positive(m, "moe_shared_expert_intermediate_size")
        elif m.moe_shared_expert_gate:
            raise ArgumentError("--moe_shared_expert_gate gates the shared expert; it needs "
                                "--moe_shared_expert_intermediate_size")
        if m.moe_router_topk > m.num_experts:
            raise ArgumentError(f"--moe_router_topk ({m.moe_router_topk}) must not exceed "
                                f"--num_experts ({m.num_experts}){source}")
        if m.moe_router_topk == 1 and not m.moe_router_pre_softmax \
                and m.moe_router_load_balancing_type != "sinkhorn":
            raise ArgumentError(
                f"--moe_router_topk 1 needs --moe_router_pre_softmax{source}: top-1 routing "
                f"weights the chosen expert by its softmax probability over all experts "
                f"(Switch Transformers); a softmax over the one chosen expert is always 1 and "
                f"the router would learn nothing from the loss")
        if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_aux_loss_coeff:
            raise ArgumentError(f"--moe_router_load_balancing_type sinkhorn balances the "
                                f"experts without a loss; set --moe_aux_loss_coeff 0 (now "
                                f"{m.moe_aux_loss_coeff}{source})")
        moe_layer_pattern(m)
        if m.num_experts % ep:
            raise ArgumentError(f"--expert_model_parallel_size ({ep}) must divide "
                                f"--num_experts ({m.num_experts}){source}")
        if world_size % (ep * tp * pp):
            raise ArgumentError(
                f"the world size ({world_size} ranks) must be divisible by "
                f"--expert_model_parallel_size ({ep}) x --tensor_model_parallel_size ({tp}) x "
                f"--pipeline_model_parallel_size ({pp})")
        etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
        if etp not in (1, tp):
            raise ArgumentError(f"--expert_tensor_parallel_size {etp}: 1 (each expert whole "
                                f"on its rank) or --tensor_model_parallel_size ({tp})")
        if tp > 1 and not p.sequence_parallel:
            raise ArgumentError(
                f"--num_experts with --tensor_model_parallel_size {tp} needs "
                f"--sequence_parallel (megatron's MoE layer refuses to train with tensor "
                f"parallelism without it): add --sequence_parallel, or use "
                f"--expert_model_parallel_size instead of TP")
        if m.add_bias_linear and etp > 1:
            raise ArgumentError(f"--tensor_model_parallel_size {tp} with biased experts "
                                f"(--add_bias_linear: gpt-oss) needs "
                                f"--expert_tensor_parallel_size 1: megatron-core supports "
                                f"expert biases only with each expert whole on its rank")
        if m.add_bias_linear and m.moe_shared_expert_intermediate_size:
            raise ArgumentError("--moe_shared_expert_intermediate_size with --add_bias_linear: "
                                "megatron's shared expert has no bias (its routed experts "
                                "and router have: gpt-oss); drop one of them")
        groups, chosen = m.moe_router_num_groups, m.moe_router_group_topk
        if (groups is None) != (chosen is None):
            raise ArgumentError("--moe_router_num_groups and --moe_router_group_topk go "
                                "together (group-limited routing); give both or neither")
        if groups is not None and not (0 < chosen <= groups and m.num_experts % groups == 0
                                       and m.moe_router_topk <= chosen * (m.num_experts //
                                                                          groups)):
            raise ArgumentError(
                f"--moe_router_num_groups {groups} must divide --num_experts "
                f"({m.num_experts}) and --moe_router_group_topk {chosen} be 1 to {groups}, "
                f"with the chosen groups holding at least --moe_router_topk experts{source}")

    def check_recompute(self) -> None:
        """The combinations megatron-core's TransformerConfig accepts, and that its block can
        run: uniform chunks tile a pipeline stage's layers (megatron would index past the
        stage's last layer), block recomputes at most the stage's layers."""
        t = self.training
        granularity = t.recompute_granularity
        modules = "recompute_modules" in self.explicit
        if granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(t, name) is not None:
                    raise ArgumentError(
                        f"--{name} chooses the layers of --recompute_granularity full; "
                        + ("selective recomputes --recompute_modules in every layer" if
                           granularity else "set --recompute_granularity full"))
        if granularity is None:
            if modules:
                raise ArgumentError("--recompute_modules needs --recompute_granularity "
                                    "selective")
            return
        if granularity == "selective":
            if not t.recompute_modules:
                raise ArgumentError("--recompute_granularity selective needs at least one "
                                    f"--recompute_modules ({', '.join(DENSE_RECOMPUTE_MODULES)})")
            other = [name for name in t.recompute_modules if name not in DENSE_RECOMPUTE_MODULES]
            if other:
                raise ArgumentError(
                    f"--recompute_modules {','.join(other)}: megatron recomputes "
                    f"{'it' if len(other) == 1 else 'them'} only in MoE or multi-latent "
                    f"attention layers, which swift-mcore does not recompute yet; choose from "
                    f"{', '.join(DENSE_RECOMPUTE_MODULES)}")
            return
        if modules:
            raise ArgumentError("--recompute_modules chooses what --recompute_granularity "
                                "selective recomputes; full recomputes whole layers (drop "
                                "--recompute_modules or choose selective)")
        _positive(t, "recompute_num_layers")
        # megatron's block recomputes within each model chunk (a pipeline stage, or one
        # virtual stage of it), indexing its own layers: uniform steps of n past a chunk's
        # last layer fail with an IndexError mid-iteration
        sizes = sorted({len(chunk) for stage in self.pipeline_chunk_layers()
                        for chunk in stage} - {0})
        n, (one, every) = t.recompute_num_layers, self._chunk_words()
        if n > sizes[-1]:
            raise ArgumentError(
                f"--recompute_num_layers ({n}) must be at most the layers of {one} "
                f"({_sizes(sizes)})")
        uneven = [size for size in sizes if size % n]
        if t.recompute_method == "uniform" and uneven:
            raise ArgumentError(
                f"--recompute_method uniform recomputes chunks of --recompute_num_layers ({n}) "
                f"layers, which must divide the layers of {every} ({_sizes(sizes)}); "
                f"choose a divisor, or --recompute_method block")

    def _chunk_words(self) -> Tuple[str, str]:
        """What megatron's recompute counts layers in, for a message naming the flags:
        (one of them, every one of them)."""
        p = self.parallel
        if self.virtual_stages() and p.pipeline_model_parallel_size > 1:
            given = ("num_virtual_stages_per_pipeline_rank"
                     if p.num_virtual_stages_per_pipeline_rank is not None
                     else "num_layers_per_virtual_pipeline_stage")
            what = f"model chunk (--pipeline_model_parallel_size x --{given})"
        elif p.pipeline_model_parallel_size > 1:
            what = "pipeline stage (--pipeline_model_parallel_size)"
        else:
            return "the model (--num_layers)", "the model (--num_layers)"
        return f"one {what}", f"every {what}"

    def check_checkpoint_flags(self) -> None:
        c = self.checkpoint
        for name in ("save_steps", "save_total_limit", "exit_interval"):
            if getattr(c, name) is not None:
                _positive(c, name)
        combinations = [  # (the flags break the rule, the message)
            (c.finetune and not c.load,
             "--finetune needs --load PATH (the checkpoint to take weights from)"),
            (c.resume and c.load,
             "--resume and --load are exclusive: --resume continues a run, --load --finetune "
             "starts a new one from its weights"),
            (c.load and not c.finetune,
             "--load PATH takes weights for a new run and needs --finetune; to continue a run "
             "use --resume PATH"),
            (c.save_safetensors and c.no_save,
             "--save_safetensors converts the final checkpoint; it cannot be combined with "
             "--no_save"),
        ]
        for broken, message in combinations:
            if broken:
                raise ArgumentError(message)

    def check_tuner(self) -> None:
        self.tuner.check(self.explicit)

    def check_best_flags(self) -> None:
        """--metric_for_best, --greater_is_better, --early_stopping_patience: they judge
        evaluations, so they need some (and a checkpoint to keep, for the best)."""
        c, lg = self.checkpoint, self.logging
        if c.early_stopping_patience is not None:
            _positive(c, "early_stopping_patience")
        if c.metric_for_best is None:
            if c.greater_is_better is not None:
                raise ArgumentError("--greater_is_better needs --metric_for_best (the metric "
                                    "it orders)")
            return
        which = (f"--early_stopping_patience {c.early_stopping_patience}"
                 if "metric_for_best" not in self.explicit
                 else f"--metric_for_best {c.metric_for_best}")
        if not lg.eval_steps:
            raise ArgumentError(f"{which} judges evaluations: set --eval_steps N > 0 (now "
                                f"{lg.eval_steps})")
        if c.no_save and "metric_for_best" in self.explicit:
            raise ArgumentError(f"--metric_for_best {c.metric_for_best} keeps the best "
                                f"checkpoint; it cannot be combined with --no_save")
        problem = self.validation_problem()
        if problem:
            raise ArgumentError(f"{which} needs validation data: {problem}")

    def validation_problem(self):
        """Why the flags give no validation data (None: they do); sft overrides it."""
        if self.data.streaming:
            return ("a pt --streaming run has no validation data (every row streamed trains, "
                    "and --split is refused)")
        parts = str(self.data.split).replace("/", ",").split(",")
        try:
            valid = float(parts[1]) if len(parts) > 1 else 0.0
        except ValueError:
            return None  # the data checks name a malformed --split
        if valid <= 0:
            return (f"--split {self.data.split} holds out nothing for validation (its second "
                    f"number is the validation share, e.g. --split 90,10,0)")
        return None

    def check_command(self) -> None:
        """The command's own flag checks (sft: its data flags); pt's --dataset/--data_path
        and --streaming."""
        d = self.data
        if d.data_path and d.dataset:
            raise ArgumentError("--data_path and --dataset are exclusive: give preprocessed "
                                "prefixes or raw files, not both")
        if d.streaming:
            if not d.dataset:
                raise ArgumentError("--streaming reads raw text files: give them with "
                                    "--dataset (.jsonl, .parquet or a saved datasets folder)")
            if d.data_order != "resumable":
                raise ArgumentError("--data_order megatron orders megatron's GPTDataset; a "
                                    "--streaming run reads its own order (leave it out)")
            if "split" in self.explicit:
                raise ArgumentError("--split cuts a dataset read whole; a --streaming run "
                                    "trains on every row and has no validation split")
            check_streaming_flags(self)


# The mixture-of-experts flags that mean something only with --num_experts.
MOE_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate", "moe_layer_freq", "moe_router_load_balancing_type",
             "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_pre_softmax",
             "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_router_score_function",
             "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
             "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")


def check_streaming_flags(args) -> None:
    """What every --streaming run needs (pt and sft): --train_iters, one loader worker."""
    if "train_iters" not in args.explicit:
        raise ArgumentError("--streaming needs --train_iters: a stream has no length to "
                            "count --num_train_epochs in")
    if args.data.num_workers > 1:
        raise ArgumentError(f"--streaming reads the stream in one loader worker per rank "
                            f"(its position is exact only so); give --num_workers 0 or 1, "
                            f"not {args.data.num_workers}")


def check_schedule_length(t, train_iters: int) -> None:
    decay = t.lr_decay_iters or train_iters
    if t.lr_warmup_iters >= decay:
        raise ArgumentError(
            f"--lr_warmup_iters ({t.lr_warmup_iters}) must be smaller than the decay "
            f"length ({decay}, from --lr_decay_iters or else --train_iters)")


RunArguments.GROUPS = {
    "model": ModelArguments,
    "data": DataArguments,
    "training": TrainingArguments,
    "parallel": ParallelArguments,
    "checkpoint": CheckpointArguments,
    "logging": LoggingArguments,
    "tuner": TunerArguments,
}


def flag_owners(cls=RunArguments) -> Dict[str, str]:
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
    """A flag's default for the command ``cls`` (None: the group's own): its DEFAULTS
    entry, else the field's."""
    if cls is not None and f.name in cls.DEFAULTS:
        return cls.DEFAULTS[f.name]
    return field_default(f)


def _plain(value):
    """Tuples of a frozen copy back to JSON's lists."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def _sizes(sizes: List[int]) -> str:
    if sizes == [1]:
        return "1 layer"
    return f"{sizes[0]} layers" if len(sizes) == 1 else \
        f"{', '.join(map(str, sizes[:-1]))} or {sizes[-1]} layers"


def _positive(group, name):
    value = getattr(group, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentError(f"--{name} must be a positive integer, got {value!r}")


def _non_negative(group, name):
    value = getattr(group, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ArgumentError(f"--{name} must be a non-negative number, got {value!r}")


# `swift-mcore pt` takes the training flags as they are; scripts written against this name
# keep working.
PretrainArguments = RunArguments
