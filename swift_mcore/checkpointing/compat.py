"""Resume checks: what would silently change the run if it continued from a checkpoint.
Each difference is one line naming the flag (or quantity) with both values."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# (group, flag): the data order and the meaning of an iteration.
RUN_FIELDS = [("training", "global_batch_size"), ("model", "seq_length"),
              ("training", "seed"), ("data", "data_order"), ("data", "streaming")]
# A stream's order of rows depends on these (data/streaming.py); compared when both stream.
STREAM_FIELDS = [("data", "shuffle_buffer_size")]
# sft flags in its data fingerprint (data/sft_datasets.py): named when the fingerprint
# differs, to say why (their values as given: --template auto may name what another run
# gave by name, with the same rows).
SFT_DATA_FIELDS = [("sft", name) for name in (
    "template", "system", "train_separator", "ignore_empty_think", "loss_on",
    "truncation_strategy", "packing", "columns", "split_dataset_ratio")]
# With --data_order megatron the datasets are sized, hence shuffled, by these
# (data/gpt_datasets.py:megatron_num_samples): another value reorders what is still to come.
MEGATRON_ORDER_FIELDS = [("training", "train_iters"), ("logging", "eval_steps"),
                         ("logging", "eval_iters")]
# The model's architecture: shapes and the function it computes.
MODEL_FIELDS = [("model", name) for name in (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "max_position_embeddings", "vocab_size",
    "normalization", "norm_epsilon", "swiglu", "position_embedding_type", "rotary_base",
    "rotary_percent", "use_rope_scaling", "rope_scaling_factor",
    "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq",
    "moe_router_pre_softmax", "num_labels", "mtp_num_layers")]
# What trains (--tuner_type lora: the adapters and their scaling).
TUNER_FIELDS = [("tuner", name) for name in (
    "tuner_type", "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "target_regex",
    "modules_to_save", "use_rslora", "adapters")]
# The preference loss (rlhf): another value changes what the rest of the run optimizes.
RLHF_FIELDS = [("rlhf", name) for name in (
    "rlhf_type", "beta", "loss_type", "loss_weights", "label_smoothing", "rpo_alpha",
    "discopop_tau", "desirable_weight", "undesirable_weight", "center_rewards_coefficient",
    "simpo_gamma", "cpo_alpha")]
# Optimizer settings restored from the checkpoint's state (they would silently win).
OPTIMIZER_FIELDS = [("training", name) for name in (
    "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "bf16", "fp16", "vit_lr",
    "aligner_lr")]
# The learning-rate / weight-decay schedule, compared on the scheduler's own state.
SCHEDULER_FIELDS = {
    "max_lr": "--lr", "min_lr": "--min_lr", "lr_warmup_steps": "--lr_warmup_iters",
    "lr_decay_steps": "--lr_decay_iters (default --train_iters)",
    "lr_decay_style": "--lr_decay_style", "start_wd": "--weight_decay",
    "end_wd": "--weight_decay", "wd_incr_style": "weight decay schedule",
}
_MISSING = object()


def _get(args_dict: Dict[str, Dict[str, Any]], group: str, name: str) -> Any:
    return args_dict.get(group, {}).get(name, _MISSING)


def _fmt(value: Any) -> str:
    return "unset" if value is None else repr(value) if isinstance(value, str) else str(value)


def field_differences(saved: Dict[str, Dict[str, Any]], current: Dict[str, Dict[str, Any]],
                      fields) -> List[str]:
    lines = []
    for group, name in fields:
        old, new = _get(saved, group, name), _get(current, group, name)
        if old is _MISSING or new is _MISSING or old == new:
            continue
        lines.append(f"--{name}: checkpoint {_fmt(old)}, now {_fmt(new)}")
    return lines


def model_differences(saved_args, current_args) -> List[str]:
    return field_differences(saved_args, current_args, MODEL_FIELDS)


def _same_data(saved: Any, current: Any) -> bool:
    """A GPT data fingerprint has parts of several strengths (data/gpt_datasets.py says
    which are compared); any other fingerprint must be equal."""
    from ..data.gpt_datasets import fingerprints_match

    return fingerprints_match(saved, current)


def resume_differences(saved_args: Dict[str, Dict[str, Any]], current_args: Dict[str, Any],
                       saved_fingerprint: Any, fingerprint: Any) -> List[str]:
    """Every difference in flags and data that makes a resumed run not the continuation of
    the saved one (the schedule is compared on the scheduler: ``scheduler_differences``)."""
    lines = field_differences(saved_args, current_args, RUN_FIELDS)
    if _get(saved_args, "data", "data_order") == "megatron" == _get(current_args, "data",
                                                                     "data_order"):
        lines += [f"{line} (--data_order megatron: the sample order depends on it)"
                  for line in field_differences(saved_args, current_args,
                                                MEGATRON_ORDER_FIELDS)]
    if _get(saved_args, "data", "streaming") is True is _get(current_args, "data",
                                                               "streaming"):
        lines += [f"{line} (--streaming: the order of the rows depends on it)"
                  for line in field_differences(saved_args, current_args, STREAM_FIELDS)]
    saved_reference, saved_fingerprint = split_reference(saved_fingerprint)
    reference, fingerprint = split_reference(fingerprint)
    if saved_reference != reference:
        lines.append(f"reference model (--ref_model, or the starting weights of --model): "
                     f"checkpoint {saved_reference}, now {reference}")
    if not _same_data(saved_fingerprint, fingerprint):
        lines.append(f"training data (content fingerprint): checkpoint "
                     f"{_fmt(saved_fingerprint)}, now {_fmt(fingerprint)}")
        lines += field_differences(saved_args, current_args, SFT_DATA_FIELDS)
    lines += field_differences(saved_args, current_args, MODEL_FIELDS)
    lines += field_differences(saved_args, current_args, TUNER_FIELDS)
    lines += field_differences(saved_args, current_args, RLHF_FIELDS)
    lines += field_differences(saved_args, current_args, OPTIMIZER_FIELDS)
    return lines


# rlhf's data fingerprint carries its reference model's identity after this mark.
REFERENCE_MARK = "|reference:"


def with_reference(fingerprint: str, reference: str) -> str:
    return f"{fingerprint}{REFERENCE_MARK}{reference}"


def split_reference(fingerprint: Any):
    """(reference identity or None, the data fingerprint without it)."""
    if isinstance(fingerprint, str) and REFERENCE_MARK in fingerprint:
        data, reference = fingerprint.split(REFERENCE_MARK, 1)
        return reference, data
    return None, fingerprint


def optimizer_format_problem(saved: str, distributed: bool) -> Optional[str]:
    """Why a checkpoint's optimizer state cannot be resumed into this run's optimizer (None:
    it can). megatron's plain and distributed optimizers keep their state in different
    layouts (checkpointing/io.py optimizer_format) and neither reads the other's: loading
    would fail on missing tensors or, worse, restart the moments from zero unnoticed."""
    from .io import optimizer_format

    wanted = optimizer_format(distributed)
    if saved == wanted:
        return None
    if distributed:
        return (f"its optimizer state is in the {saved!r} layout, and --use_distributed_optimizer"
                f" reads only {wanted!r}; resume without --use_distributed_optimizer, or pass "
                f"--no_load_optim to start the optimizer afresh")
    return (f"its optimizer state is in the {saved!r} layout (it was saved with "
            f"--use_distributed_optimizer); resume with --use_distributed_optimizer, or pass "
            f"--no_load_optim to start the optimizer afresh")


def base_model_differences(saved: Optional[str], current: Optional[str],
                           model_flag: Optional[str]) -> List[str]:
    """A LoRA checkpoint holds adapters for the base weights it records (run.json
    base_model): other base weights would silently give another model."""
    if saved is None or current is None or saved == current:
        return []
    where = f" (--model {model_flag})" if model_flag else ""
    return [f"base_model (the frozen base weights): checkpoint {saved}, now {current}{where}"]


def scheduler_differences(saved: Optional[Dict[str, Any]], current: Optional[Dict[str, Any]]
                          ) -> List[str]:
    """The learning-rate / weight-decay schedule, saved against the one the flags give."""
    lines: List[str] = []
    if saved is None or current is None:
        return lines
    for key, flag in SCHEDULER_FIELDS.items():
        old, new = saved.get(key), current.get(key)
        if old is not None and new is not None and old != new:
            lines.append(f"{key} ({flag}): checkpoint {_fmt(old)}, now {_fmt(new)}")
    if saved.get("wd_incr_style", "constant") != "constant" and (
            saved.get("wd_incr_steps") != current.get("wd_incr_steps")):
        lines.append(f"wd_incr_steps (--train_iters): checkpoint {saved.get('wd_incr_steps')}, "
                     f"now {current.get('wd_incr_steps')}")
    return lines


def refusal(folder: str, lines: List[str]) -> str:
    body = "\n".join(f"  {line}" for line in lines)
    return (f"refusing to resume from {folder}: the run would silently change.\n{body}\n"
            f"Restore these flags, or pass --override_resume_check to resume anyway (the new "
            f"values then apply from the next iteration).")
