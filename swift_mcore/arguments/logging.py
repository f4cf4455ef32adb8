"""Output folder, logging and progress flags."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import flag


@dataclass
class LoggingArguments:
    output_dir: str = flag("output/swift-mcore", "Folder for checkpoints, logs and metrics.")
    log_interval: int = flag(10, "Print a log line every this many iterations.")
    eval_steps: int = flag(100, "Validate every this many iterations; 0 disables.")
    eval_iters: int = flag(4, "Validation batches per validation.")
    tensorboard: bool = flag(True, "Write tensorboard events to output_dir/runs.")
    progress_bar: bool = flag(True, "Show a tqdm progress bar on the last rank.")
    log_sample_ids: bool = flag(
        False, "Write the global sample indices of every iteration to sample_ids.jsonl.")
