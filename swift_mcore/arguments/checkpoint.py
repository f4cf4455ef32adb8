"""Checkpoint saving and resuming flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import POSITIVE, flag


@dataclass
class CheckpointArguments:
    save_steps: Optional[int] = flag(
        None, "Save a checkpoint every this many iterations (and always at the end).")
    no_save: bool = flag(False, "Save no checkpoint at all.")
    save_total_limit: Optional[int] = flag(
        None, "Keep only the newest N complete checkpoints.")
    no_save_optim: bool = flag(False, "Leave the optimizer state out of checkpoints.")
    no_save_rng: bool = flag(False, "Leave the RNG states out of checkpoints.")
    async_save: bool = flag(
        False, "Write checkpoints in the background (megatron's async dist_checkpointing): "
        "training goes on while a forked process writes the shards; the checkpoint is "
        "sealed and tracked at a later iteration, once every rank's write is done "
        "(docs/resume.md).")
    resume: Optional[str] = flag(
        None, "Resume: 'auto' (the flag alone) takes the newest complete checkpoint under "
        "output_dir; or a checkpoint directory.")
    load: Optional[str] = flag(None, "Checkpoint to take weights from with --finetune.")
    finetune: bool = flag(
        False, "With --load: weights only; iteration, counters and optimizer start fresh.")
    no_load_optim: bool = flag(False, "On resume, do not restore the optimizer state.")
    no_load_rng: bool = flag(False, "On resume, do not restore the RNG states.")
    override_resume_check: bool = flag(
        False, "Resume even if batch size, sequence length, data, seed or model shape "
        "changed since the checkpoint.")
    save_safetensors: bool = flag(
        False, "Also write every checkpoint saved as a Hugging Face folder next to it "
        "(config.json, safetensors, tokenizer and chat template): checkpoint/"
        "iter_NNNNNNN-hf, committed as the checkpoint is and rotated with it.")
    metric_for_best: Optional[str] = flag(
        None, "Keep the checkpoint of the best evaluation of this validation metric "
        "(checkpoint/best and best.json; never rotated away): an evaluation that improves "
        "it saves a checkpoint. Needs --eval_steps and validation data.",
        choices=("val_loss", "val_ppl"))
    greater_is_better: Optional[bool] = flag(
        None, "Whether a larger --metric_for_best is better; default: false for val_loss "
        "and val_ppl.")
    early_stopping_patience: Optional[int] = flag(
        None, "Stop (saving first) after this many evaluations in a row without improvement "
        "of --metric_for_best (default val_loss).")
    exit_interval: Optional[int] = flag(
        None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = flag(
        None, "Save and exit once the run has lasted this many minutes.", range=POSITIVE)
