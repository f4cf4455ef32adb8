"""RlhfArguments: a run's flag groups plus preference training's (`swift-mcore rlhf`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import ArgumentError
from .fields import NON_NEGATIVE, POSITIVE, Range, flag
from .run import RunArguments

RLHF_TYPES = ("dpo", "kto", "rm", "orpo", "simpo")
# the tasks whose loss has no reference model (TRL's ORPOTrainer, CPOTrainer's simpo)
REFERENCE_FREE_TYPES = ("orpo", "simpo")
# TRL 1.16's DPO loss types, spelled as DPOConfig.loss_type spells them.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop",
                  "sft", "sigmoid_norm")
# TRL 1.16's KTO loss types (KTOConfig.loss_type); kto is --rlhf_type kto's default
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class RlhfGroupArguments:
    rlhf_type: str = flag(
        "dpo", "The preference task: dpo (Direct Preference Optimization on chosen/rejected "
        "pairs), kto (Kahneman-Tversky Optimization on answers labelled desirable or not), "
        "rm (a reward model: a score head trained with the Bradley-Terry loss on the pairs), "
        "orpo (Odds Ratio Preference Optimization) and simpo (Simple Preference "
        "Optimization), both on pairs and without a reference model.",
        choices=RLHF_TYPES)
    beta: float = flag(
        0.1, "How far the policy may move from the reference: the temperature of the DPO "
        "losses (tau for ipo) and of KTO's; orpo: the odds-ratio term's weight (lambda in "
        "the ORPO paper); simpo: the reward scale.", range=POSITIVE)
    loss_type: List[str] = flag(
        ["sigmoid"], "The DPO loss, or several summed with --loss_weights, as TRL 1.16 names "
        "them: " + ", ".join(DPO_LOSS_TYPES) + ". kto: one of " + ", ".join(KTO_LOSS_TYPES)
        + " (default kto; apo_zero_unpaired has no KL term).",
        choices=DPO_LOSS_TYPES + KTO_LOSS_TYPES, comma_separated=True)
    loss_weights: Optional[List[float]] = flag(
        None, "One weight per --loss_type (default: 1 each), each >= 0.",
        comma_separated=True)
    label_smoothing: float = flag(
        0.0, "The probability that a pair's labels are flipped (robust, exo_pair, aot; "
        "TRL's conservative DPO).", range=Range(0, 0.5, high_open=True))
    rpo_alpha: Optional[float] = flag(
        None, "Add the NLL of the chosen answers with this weight (RPO): TRL 1.16's 'sft' loss "
        "type with weight rpo_alpha.", range=NON_NEGATIVE)
    discopop_tau: float = flag(
        0.05, "The temperature of the discopop loss.", range=POSITIVE)
    reference_free: bool = flag(
        False, "Train without a reference model: its log-probabilities are taken as 0 (no "
        "reference is built).")
    precompute_ref_log_probs: bool = flag(
        False, "dpo: compute the reference's log-probabilities of every pair once, before "
        "training, keep them in --output_dir (ref_logps.safetensors, fingerprinted; a resume "
        "reuses them) and free the reference model.")
    ref_model: Optional[str] = flag(
        None, "The reference model, a Hugging Face folder of the same architecture and "
        "vocabulary (default: the starting weights; with --tuner_type lora the base model "
        "with its adapters switched off).")
    max_length: Optional[int] = flag(
        None, "Longest prompt + answer in tokens; longer ones are cut as --truncation_mode "
        "says (default and most: --seq_length + 1). rm: longer rows are refused (default "
        "and most: --seq_length).", range=POSITIVE)
    desirable_weight: float = flag(
        1.0, "kto: the weight of the desirable answers' losses (to balance unequal counts "
        "of desirable and undesirable rows).", range=NON_NEGATIVE)
    undesirable_weight: float = flag(
        1.0, "kto: the weight of the undesirable answers' losses.", range=NON_NEGATIVE)
    center_rewards_coefficient: Optional[float] = flag(
        None, "rm: add this times the mean of (chosen + rejected reward)^2 to the loss, which "
        "pulls the rewards towards zero mean (TRL's RewardConfig).", range=NON_NEGATIVE)
    simpo_gamma: float = flag(
        0.5, "simpo: the target reward margin (TRL's simpo_gamma).", range=NON_NEGATIVE)
    cpo_alpha: float = flag(
        0.0, "simpo: add the NLL of the chosen answers with this weight (TRL's cpo_alpha; "
        "0 is SimPO as its paper defines it, TRL's CPOConfig default 1.0 is CPO-SimPO).",
        range=NON_NEGATIVE)
    packing: bool = flag(
        False, "Lay each micro-batch's sequences (a pair's chosen and rejected; kto: the rows, "
        "and apart from them the KL rows) end to end in --seq_length rows (attention never "
        "crosses one; position ids restart) instead of padding every sequence to the "
        "longest; the losses are the unpacked ones.")
    truncation_mode: str = flag(
        "keep_start", "What a cut keeps of a sequence longer than --max_length: its start or "
        "its end (TRL's truncation_mode).", choices=TRUNCATION_MODES)

    def kto_loss_type(self) -> str:
        """--rlhf_type kto's loss: kto unless --loss_type names another of KTO's."""
        return self.loss_type[0] if self.loss_type[0] in KTO_LOSS_TYPES else "kto"

    def needs_reference(self) -> bool:
        """Whether the task compares the policy with a reference model."""
        return self.rlhf_type in ("dpo", "kto") and not self.reference_free


@dataclass
class RlhfArguments(RunArguments):
    rlhf: RlhfGroupArguments = field(default_factory=RlhfGroupArguments)

    COMMAND = "rlhf"
    # TRL's DPOConfig defaults where they differ from pretraining's: a small learning rate,
    # no warmup, one pass over the data, no dropout in the adapters (TRL's disable_dropout:
    # the policy's and the reference's log-probabilities of a pair are then comparable).
    DEFAULTS = {"lr": 1e-6, "min_lr": 0.0, "lr_warmup_iters": 0, "num_train_epochs": 1.0,
                "lora_dropout": 0.0, "output_dir": "output/swift-mcore-rlhf"}

    def fill_defaults(self) -> None:
        super().fill_defaults()
        if self.rlhf.rlhf_type != "rm":
            return
        if self.model.num_labels is None:
            self.model.num_labels = 1  # the score head (models/value_head.py)
        if "lr" not in self.explicit:
            self.training.lr = 1e-4  # TRL's RewardConfig (DPO's 1e-6 is for a policy)

    def check_command(self) -> None:
        d, r, p = self.data, self.rlhf, self.parallel
        if r.rlhf_type == "rm":
            self.check_reward_model()
        if d.data_path:
            raise ArgumentError("--data_path holds pretraining .bin/.idx files; rlhf reads "
                                "preference rows from --dataset (jsonl, json, parquet)")
        if not d.dataset:
            raise ArgumentError("rlhf needs --dataset: preference rows (prompt/chosen/rejected, "
                                "or messages + rejected_response; for kto prompt/completion/"
                                "label; docs/rlhf.md)")
        if "eval_steps" in self.explicit and self.logging.eval_steps:
            raise ArgumentError(f"--eval_steps {self.logging.eval_steps}: rlhf has no "
                                f"validation data yet, so no evaluation would run; leave "
                                f"--eval_steps out (or 0)")
        if d.data_order != "resumable":
            raise ArgumentError("--data_order megatron orders megatron's GPTDataset (pt); "
                                "rlhf rows keep the resumable order")
        if r.loss_weights is not None and len(r.loss_weights) != len(r.loss_type):
            raise ArgumentError(f"--loss_weights: {len(r.loss_weights)} weights for "
                                f"{len(r.loss_type)} --loss_type values; give one per loss")
        if len(set(r.loss_type)) != len(r.loss_type):
            raise ArgumentError(f"--loss_type {','.join(r.loss_type)}: a loss is named twice")
        if "exo_pair" in r.loss_type and r.label_smoothing == 0.0:
            raise ArgumentError("--loss_type exo_pair needs --label_smoothing > 0 (the EXO "
                                "paper uses 1e-3)")
        if r.rpo_alpha is not None and "sft" in r.loss_type:
            raise ArgumentError("--rpo_alpha adds the 'sft' loss; it cannot be combined with "
                                "--loss_type sft (weight that one with --loss_weights)")
        if r.rlhf_type == "dpo":
            self.check_dpo_loss_flags()
        self.check_task()
        if r.center_rewards_coefficient is not None and r.rlhf_type != "rm":
            raise ArgumentError("--center_rewards_coefficient is a reward model's (--rlhf_type "
                                "rm)")
        if r.precompute_ref_log_probs and not r.needs_reference():
            raise ArgumentError("--precompute_ref_log_probs computes the reference's "
                                "log-probabilities; " + ("--reference_free has no reference"
                                                         if r.reference_free else
                                                         f"--rlhf_type {r.rlhf_type} has none"))
        if r.reference_free and r.ref_model:
            raise ArgumentError("--reference_free trains without a reference; it cannot be "
                                "combined with --ref_model")
        if (self.checkpoint.load and not r.ref_model and r.needs_reference()
                and self.tuner.tuner_type != "lora"):
            raise ArgumentError("rlhf --load: the reference would not be the loaded weights "
                                "(it is a copy of --model's, taken before the checkpoint is "
                                "read); export the checkpoint (swift-mcore export --to_hf) and "
                                "give it as --model, or name the reference with --ref_model")
        seq = self.model.seq_length
        if r.rlhf_type == "rm" and r.max_length is not None and r.max_length > seq:
            raise ArgumentError(f"--max_length {r.max_length} exceeds --seq_length {seq} (a "
                                f"reward model reads whole sequences); raise --seq_length or "
                                f"lower --max_length")
        if r.rlhf_type != "rm" and r.max_length is not None and r.max_length < 2:
            raise ArgumentError(f"--max_length {r.max_length}: a sequence of n tokens trains "
                                f"n - 1 positions, so a cut to {r.max_length} token leaves "
                                f"none to train; give 2 or more")
        if r.max_length is not None and r.max_length > seq + 1:
            raise ArgumentError(f"--max_length {r.max_length} exceeds --seq_length {seq} + 1 "
                                f"(a sequence of n tokens trains n - 1 positions); raise "
                                f"--seq_length or lower --max_length")
        if p.pipeline_model_parallel_size > 1:
            self.check_pipeline()

    def check_loss_weights(self) -> None:
        """A negative weight turns its loss into one to maximize (most are unbounded above:
        the run diverges); all weights 0 train nothing."""
        r = self.rlhf
        for name, weight in zip(r.loss_type, r.loss_weights):
            if weight < 0:
                raise ArgumentError(f"--loss_weights: {weight:g} for --loss_type {name}; a "
                                    f"weight is >= 0 (a negative one maximizes that loss)")
        if not any(r.loss_weights):
            raise ArgumentError("--loss_weights: every weight is 0, so the loss is 0 and "
                                "nothing trains; give at least one a positive weight")

    def check_dpo_loss_flags(self) -> None:
        """--label_smoothing and --discopop_tau change only the DPO losses that read them;
        with others they would do nothing (TRL 1.16's sigmoid ignores label smoothing)."""
        r = self.rlhf
        if r.loss_weights is not None:
            self.check_loss_weights()
        smoothed = ("robust", "exo_pair", "aot", "aot_unpaired")
        if r.label_smoothing != 0.0 and not set(r.loss_type) & set(smoothed):
            raise ArgumentError(f"--label_smoothing {r.label_smoothing:g} changes only the "
                                f"{', '.join(smoothed)} losses; --loss_type "
                                f"{','.join(r.loss_type)} ignores it (TRL 1.16's sigmoid "
                                f"has no label smoothing: use --loss_type robust for "
                                f"conservative DPO)")
        if r.discopop_tau != 0.05 and "discopop" not in r.loss_type:
            raise ArgumentError(f"--discopop_tau is the discopop loss's temperature; "
                                f"--loss_type {','.join(r.loss_type)} does not read it")

    def check_pipeline(self) -> None:
        """Pipeline parallelism (interleaved too) runs every task, the stages passing the
        policy's activations and, beside them, the reference's (and KTO's KL rows'); what
        does not fit that is refused."""
        r, pp = self.rlhf, self.parallel.pipeline_model_parallel_size
        if r.packing and r.rlhf_type != "dpo":
            raise ArgumentError(f"--packing with --pipeline_model_parallel_size {pp} packs "
                                f"DPO's pairs only yet; --rlhf_type {r.rlhf_type}: drop "
                                f"--packing")
        packed_with = [name for name, given in (
            ("--precompute_ref_log_probs", r.precompute_ref_log_probs),
            ("--num_virtual_stages_per_pipeline_rank", self.virtual_stages() is not None))
            if given]
        if r.packing and packed_with:
            raise ArgumentError(f"--packing with {packed_with[0]} and "
                                f"--pipeline_model_parallel_size {pp} is not supported yet "
                                f"for rlhf; drop one of them")
        tp, seq = self.parallel.tensor_model_parallel_size, self.model.seq_length
        if self.parallel.sequence_parallel and seq % tp:
            raise ArgumentError(f"--seq_length {seq} with --sequence_parallel and "
                                f"--pipeline_model_parallel_size {pp}: the stages exchange "
                                f"rows of --seq_length positions split over the "
                                f"--tensor_model_parallel_size {tp} ranks; give a multiple "
                                f"of {tp}")

    def check_task(self) -> None:
        """The flags of one --rlhf_type are refused with another (they would do nothing)."""
        r, t = self.rlhf, self.training
        if r.rlhf_type == "kto":
            if "loss_type" in self.explicit and (len(r.loss_type) != 1
                                                 or r.loss_type[0] not in KTO_LOSS_TYPES):
                raise ArgumentError(f"--loss_type {','.join(r.loss_type)}: --rlhf_type kto "
                                    f"takes one of TRL's KTO losses: "
                                    f"{', '.join(KTO_LOSS_TYPES)}")
            dpo_only = [name for name, given in (
                ("--loss_weights", r.loss_weights is not None),
                ("--label_smoothing", r.label_smoothing != 0.0),
                ("--rpo_alpha", r.rpo_alpha is not None),
                ("--reference_free", r.reference_free),
                ("--precompute_ref_log_probs", r.precompute_ref_log_probs)) if given]
            if dpo_only:
                raise ArgumentError(f"{dpo_only[0]} is a DPO flag; --rlhf_type kto has "
                                    f"TRL's KTO losses (--loss_type kto or "
                                    f"apo_zero_unpaired), weighted by --desirable_weight and "
                                    f"--undesirable_weight, against a reference")
            if r.desirable_weight == 0 and r.undesirable_weight == 0:
                raise ArgumentError("--desirable_weight 0 and --undesirable_weight 0: the "
                                    "loss is 0 and nothing trains; give one of them > 0")
            if t.micro_batch_size < 2 and r.kto_loss_type() == "kto":
                raise ArgumentError("--rlhf_type kto needs --micro_batch_size 2 or more: the "
                                    "KL estimate pairs each prompt with another row's answer "
                                    "of the same micro-batch (as TRL's KTOTrainer)")
        elif kto_only := [name for name in r.loss_type if name in KTO_LOSS_TYPES]:
            raise ArgumentError(f"--loss_type {kto_only[0]} is a KTO loss; it needs "
                                f"--rlhf_type kto")
        elif r.desirable_weight != 1.0 or r.undesirable_weight != 1.0:
            which = "--desirable_weight" if r.desirable_weight != 1.0 else "--undesirable_weight"
            raise ArgumentError(f"{which} weighs KTO's losses; it needs --rlhf_type kto")
        if r.rlhf_type in REFERENCE_FREE_TYPES:
            self.check_reference_free_task()
        elif r.simpo_gamma != 0.5 or r.cpo_alpha != 0.0:
            which = "--simpo_gamma" if r.simpo_gamma != 0.5 else "--cpo_alpha"
            raise ArgumentError(f"{which} is a SimPO flag; it needs --rlhf_type simpo")

    def check_reference_free_task(self) -> None:
        """orpo and simpo have no reference and one loss each: the flags that would pick or
        weigh a reference or another loss are refused."""
        r = self.rlhf
        kind = r.rlhf_type
        if r.ref_model:
            raise ArgumentError(f"--ref_model: --rlhf_type {kind} is reference-free (no "
                                f"reference model is loaded); leave --ref_model out")
        given = [name for name, on in (
            ("--reference_free", r.reference_free),
            ("--precompute_ref_log_probs", r.precompute_ref_log_probs),
            ("--loss_type", list(r.loss_type) != ["sigmoid"]),
            ("--loss_weights", r.loss_weights is not None),
            ("--rpo_alpha", r.rpo_alpha is not None),
            ("--discopop_tau", r.discopop_tau != 0.05),
            ("--label_smoothing", kind == "orpo" and r.label_smoothing != 0.0),
            ("--simpo_gamma", kind == "orpo" and r.simpo_gamma != 0.5),
            ("--cpo_alpha", kind == "orpo" and r.cpo_alpha != 0.0)) if on]
        if given:
            what = ("its loss is TRL's ORPO (the odds-ratio term weighted by --beta plus the "
                    "chosen answers' NLL)" if kind == "orpo" else
                    "its loss is TRL's simpo (--beta, --simpo_gamma, --label_smoothing, "
                    "--cpo_alpha)")
            raise ArgumentError(f"{given[0]} does not apply to --rlhf_type {kind}: {what}")
        if r.truncation_mode != "keep_start":
            raise ArgumentError(f"--truncation_mode {r.truncation_mode}: --rlhf_type {kind} "
                                f"cuts the answer to --max_length as TRL's {kind} trainer "
                                f"does (keep_start only)")

    def check_reward_model(self) -> None:
        """rm: the flags of DPO's reference and losses mean nothing to a reward model."""
        m = self.model
        if m.num_labels != 1:
            raise ArgumentError(f"--num_labels {m.num_labels}: a reward model has one score "
                                f"(--num_labels 1)")
        dpo_only = ("beta", "loss_type", "loss_weights", "label_smoothing", "rpo_alpha",
                    "discopop_tau", "reference_free", "ref_model", "truncation_mode")
        given = [name for name in dpo_only if name in self.explicit]
        if given:
            raise ArgumentError(f"--{given[0]} is a DPO flag; --rlhf_type rm trains a reward "
                                f"model without a reference or a DPO loss (docs/rlhf.md)")

    def fixed_width_rows(self) -> str:
        """rlhf pads its rows to a multiple of the TP size; under pipeline parallelism its
        own check names --seq_length (check_command)."""
        return ""

    def validation_problem(self):
        return "rlhf has no validation data yet (no --eval_steps judging)"


RlhfArguments.GROUPS = {**RunArguments.GROUPS, "rlhf": RlhfGroupArguments}


def check_score_head(config) -> None:
    """Only rlhf --rlhf_type rm trains a model with a score head (--num_labels, or a
    *ForSequenceClassification --model); the other commands train next-token prediction."""
    m = config.model
    if not m.num_labels:
        return
    if config.COMMAND == "rlhf" and config.rlhf.rlhf_type == "rm":
        return
    if m.model and "num_labels" not in config.args.explicit:
        what = f"--model {m.model} is a reward model (*ForSequenceClassification)"
    else:
        what = f"--num_labels {m.num_labels} makes a reward model"
    raise ArgumentError(f"{what}: `swift-mcore {config.COMMAND}` trains a causal LM's "
                        f"next-token head; train a reward model with `swift-mcore rlhf "
                        f"--rlhf_type rm`")
