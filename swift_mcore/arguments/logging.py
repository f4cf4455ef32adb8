"""Output folder, logging, experiment tracking and progress flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .fields import POSITIVE, flag

# --report_to: where metrics go besides metrics.jsonl (training/trackers.py), and the Python
# module each one needs.
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}


@dataclass
class LoggingArguments:
    output_dir: str = flag("output/swift-mcore", "Folder for checkpoints, logs and metrics.")
    log_interval: int = flag(10, "Print a log line every this many iterations.")
    eval_steps: int = flag(100, "Validate every this many iterations; 0 disables.")
    eval_iters: int = flag(4, "Validation batches per validation.")
    report_to: List[str] = flag(
        ["tensorboard"], "Experiment trackers that receive every metric of metrics.jsonl, "
        "grouped train/ and valid/, with the run's flags as config: any of tensorboard "
        "(output_dir/runs), wandb (output_dir/wandb; WANDB_MODE=offline logs locally), "
        "swanlab (output_dir/swanlog; SWANLAB_MODE=offline or local), comma- or "
        "space-separated; 'none' for none (docs/tracking.md).",
        choices=("none", *TRACKERS), comma_separated=True)
    run_name: Optional[str] = flag(
        None, "The run's name in W&B and SwanLab; default: output_dir's folder name. The "
        "project is WANDB_PROJECT / SWANLAB_PROJECT, else swift-mcore.")
    tensorboard: bool = flag(
        True, "Alias kept for older commands: --tensorboard false drops tensorboard from "
        "--report_to, --tensorboard true adds it.")
    plot: bool = flag(True, "At the end of the run write output_dir/loss.png (train and "
                      "validation loss, learning rate; `swift-mcore plot`).")
    progress_bar: bool = flag(True, "Show a tqdm progress bar on the last rank.")
    log_sample_ids: bool = flag(
        False, "Write the global sample indices of every iteration to sample_ids.jsonl.")
    profile: bool = flag(
        False, "Record torch's profiler over iterations --profile_step_start to "
        "--profile_step_end on the ranks --profile_ranks: output_dir/profile/"
        "rank_N.pt.trace.json, for TensorBoard's profiler plugin, Perfetto "
        "(ui.perfetto.dev) or chrome://tracing (docs/launch.md).")
    profile_step_start: int = flag(10, "With --profile: the first iteration recorded.")
    profile_step_end: int = flag(12, "With --profile: the last iteration recorded.")
    profile_ranks: List[int] = flag(
        [0], "With --profile: the global ranks that record (comma- or space-separated).",
        comma_separated=True)
    record_memory_history: bool = flag(
        False, "With --profile on CUDA: also record every CUDA allocation over the profiled "
        "iterations, written as output_dir/profile/rank_N_memory.pickle "
        "(pytorch.org/memory_viz). GPU only.")
    peak_tflops: Optional[float] = flag(
        None, "The peak TFLOP/s of one rank's device that MFU is reported against; default: "
        "the data sheet's dense bf16 peak of a known GPU, or on CPU float32 matmuls measured "
        "once at start-up (training/peak.py). The start-up line names the peak used.",
        range=POSITIVE)
