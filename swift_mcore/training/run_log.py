"""The lines a training run prints: its start, the LoRA tuner, the judgement of each
evaluation against the best, its saves, and the closing block naming where everything is.
Text only: the Trainer decides what happened and prints what these functions return."""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

# Where each --report_to tracker's files are, for the closing lines.
TRACKER_WHERE = {
    "tensorboard": "tensorboard --logdir {out}/runs",
    "wandb": "{out}/wandb (offline runs: wandb sync {out}/wandb/offline-run-*)",
    "swanlab": "{out}/swanlog (offline runs: swanlab sync {out}/swanlog/run-*)",
}


def start_line(config, num_parameters: int, peak, state) -> str:
    """The model, the layout, the batch, the implementation choices, and where it starts."""
    c, w = config, config.world
    ep = f" (EP {w.expert_parallel})" if w.expert_parallel > 1 else ""
    return (
        f"swift-mcore: {num_parameters / 1e6:.2f}M parameters, "
        f"vocab {c.vocab_size} (padded {c.padded_vocab_size}), "
        f"world {w.world_size} = TP {w.tensor_parallel} x PP {w.pipeline_parallel} x "
        f"{f'CP {w.context_parallel} x ' if w.context_parallel > 1 else ''}"
        f"DP {w.data_parallel}{ep}, global batch {c.training.global_batch_size} = micro "
        f"{c.training.micro_batch_size} x {w.num_microbatches} micro-batches x DP "
        f"{w.data_parallel}, seq {c.model.seq_length}; {c.describe()}; MFU against "
        f"{peak.describe() if peak else 'no peak'}; starting at "
        f"iteration {state.iteration} ({state.consumed_train_samples} samples "
        f"consumed)")


def tuner_line(config, trainable: int, total: int) -> str:
    """--tuner_type lora: how many parameters train out of how many, and where."""
    t = config.tuner
    where = t.target_regex and f"--target_regex {t.target_regex}" or ",".join(
        t.target_modules)
    saved = f", modules_to_save {','.join(t.modules_to_save)}" if t.modules_to_save else ""
    return (f"--tuner_type lora: {trainable:,} of {total:,} parameters train "
            f"({100 * trainable / max(total, 1):.2f}%): rank {t.lora_rank}, alpha "
            f"{t.lora_alpha:g}{' (rslora)' if t.use_rslora else ''} on {where}{saved}; base "
            f"frozen ({config.base_model})")


def best_line(checkpoint, state, value: Optional[float], improved: bool,
              previous: tuple) -> Optional[str]:
    """An evaluation judged by --metric_for_best: the new best, or how far from it (None
    before there is a best to compare with). ``previous``: (best value, its iteration)
    before this evaluation."""
    shown = "no value" if value is None else f"{value:.6g}"
    if improved:
        return (f"--metric_for_best: {checkpoint.metric_for_best} {shown} is the best so far "
                f"(iteration {state.iteration})")
    if previous[0] is None:
        return None
    patience = checkpoint.early_stopping_patience
    count = (f"{state.evals_without_improvement} of {patience}" if patience
             else str(state.evals_without_improvement))
    return (f"--metric_for_best: {checkpoint.metric_for_best} {shown}, best "
            f"{previous[0]:.6g} at iteration {previous[1]} ({count} "
            f"evaluations without improvement)")


def saved_line(path: str, state, background: bool) -> str:
    verb = "saving" if background else "saved"
    return (f"{verb} checkpoint {path} (iteration {state.iteration}, "
            f"{state.consumed_train_samples} samples consumed)"
            + (" in the background" if background else ""))


def not_converted_line(path: str) -> str:
    """--save_safetensors at a save made on a stop signal."""
    return (f"--save_safetensors: {path} is not converted (stopping on a signal); convert it "
            f"with `swift-mcore export --to_hf --model {path} --output_dir {path}-hf`")


def conversion_failed_line(iteration: int, error: str) -> str:
    last = error.strip().splitlines()[-1] if error.strip() else "unknown error"
    return (f"WARNING: --save_safetensors: converting iteration {iteration} failed ({last}); "
            f"the checkpoint is saved, training goes on")


def finish_lines(config, state, exit_reason: Optional[str],
                 failed_trackers: Sequence[str]) -> List[str]:
    """The closing block: why it stopped, and where the checkpoints, the best one, the
    metrics, the trackers' files and the sample ids are (the plot's line is added by the
    caller once it is drawn)."""
    lg, c = config.logging, config.checkpoint
    out = os.path.abspath(lg.output_dir)
    lines = [f"finished at iteration {state.iteration}"
             + (f" ({exit_reason})" if exit_reason else "")]
    if not c.no_save:
        lines.append(f"  checkpoints:  {os.path.join(out, 'checkpoint')}")
    if c.metric_for_best and state.best_iteration is not None and not c.no_save:
        lines.append(f"  best:         {os.path.join(out, 'checkpoint', 'best')} "
                     f"(iteration {state.best_iteration}, {c.metric_for_best} "
                     f"{state.best_value:.6g})")
    lines.append(f"  metrics:      {os.path.join(out, 'metrics.jsonl')}")
    for name in lg.report_to:
        lines.append(f"  {name + ':':<13} " + TRACKER_WHERE[name].format(out=out)
                     + (" (switched off after an error)" if name in failed_trackers else ""))
    if lg.log_sample_ids:
        lines.append(f"  sample ids:   {os.path.join(out, 'sample_ids.jsonl')}")
    return lines


def plot_line(path: str) -> str:
    return f"  plot:         {path}"
