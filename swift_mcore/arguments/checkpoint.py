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
        False, "After training, also write the final checkpoint as a Hugging Face folder "
        "(config.json, safetensors, tokenizer) next to it: checkpoint/iter_NNNNNNN-hf.")
    exit_interval: Optional[int] = flag(
        None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = flag(
        None, "Save and exit once the run has lasted this many minutes.", range=POSITIVE)
