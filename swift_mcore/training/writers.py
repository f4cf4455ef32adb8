"""Where metrics go: the log line, tqdm, metrics.jsonl and the --report_to trackers (last
rank only). metrics.jsonl is the record every tracker and the plot are checked against; it
is appended to as a run file (runtime/run_files.py: never through a planted link, a record
whole or not at all)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from ..runtime import run_files
from .trackers import Tracker, close_quietly


def format_log_line(iteration: int, total: int, metrics: Dict[str, float]) -> str:
    parts = [f"iter {iteration}/{total}"]
    labels = [("loss", "loss {:.4f}"), ("mtp_loss", "mtp_loss {:.4f}"), ("load_balancing_loss", "load_balancing_loss {:.4f}"),
              ("seq_load_balancing_loss", "seq_load_balancing_loss {:.4f}"),
              ("global_load_balancing_loss", "global_load_balancing_loss {:.4f}"),
              ("z_loss", "z_loss {:.4f}"), ("lr", "lr {:.3e}"), ("grad_norm", "grad_norm {:.3f}"),
              ("tokens_per_s", "tokens/s {:.0f}"), ("tflops", "TFLOP/s {:.4f}"),
              ("mfu_percent", "MFU {:.2f}%"), ("peak_memory_gb", "mem {:.2f} GB"),
              ("val_loss", "val_loss {:.4f}"), ("val_ppl", "val_ppl {:.2f}")]
    for key, fmt in labels:
        if key in metrics and metrics[key] is not None:
            parts.append(fmt.format(metrics[key]))
    return " | ".join(parts)


@contextlib.contextmanager
def rng_untouched():
    """The RNG states a checkpoint saves (python, numpy, torch, CUDA) as they were, whatever
    a tracker's library draws: a run with trackers trains exactly as one without."""
    import random

    import numpy as np
    import torch

    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class MetricWriter:
    """Active on the writing rank; on every other rank each method does nothing.

    Each record goes to metrics.jsonl first, then to every tracker. A tracker that raises is
    switched off with one warning; the others, metrics.jsonl and training go on."""

    def __init__(self, output_dir: str, total_iters: int, start_iter: int, active: bool,
                 trackers: Sequence[Tracker] = (), progress_bar: bool = True):
        self.active = active
        self.total_iters = total_iters
        self.jsonl_path = os.path.join(output_dir, run_files.METRICS)
        self.trackers: List[Tracker] = list(trackers) if active else []
        self.failed_trackers: List[str] = []
        self._bar: Optional[tqdm] = None
        self._jsonl = None
        if not active:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._jsonl = run_files.Record(self.jsonl_path)
        if progress_bar:
            self._bar = tqdm(total=total_iters, initial=start_iter, desc="train",
                             dynamic_ncols=True, leave=True)

    def start(self, iteration: int, resumed_from: Optional[str]) -> None:
        """The record that begins a segment of the run (``split`` "start"): where it starts,
        and the checkpoint it resumed from (the plot marks resumed segments by it)."""
        if self.active:
            self._write({"iteration": iteration, "split": "start",
                         "resumed_from": resumed_from, "time": time.time()})

    def step(self, iteration: int, loss: Optional[float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def record(self, iteration: int, metrics: Dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        clean = {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self._write({"iteration": iteration, "split": prefix, **clean})
        for tracker in list(self.trackers):
            try:
                with rng_untouched():
                    tracker.log(prefix, iteration, clean)
            except Exception as err:
                self._switch_off(tracker, f"{type(err).__name__}: {err}")

    def _write(self, record: dict) -> None:
        self._jsonl.append(json.dumps(record) + "\n")

    def _switch_off(self, tracker: Tracker, error: str) -> None:
        self.trackers.remove(tracker)
        self.failed_trackers.append(tracker.name)
        self.print(f"WARNING: --report_to {tracker.name} failed ({' '.join(error.split())[:300]}"
                   f"); it receives nothing more in this run, training goes on "
                   f"({self.jsonl_path} has every value)")
        with rng_untouched():
            close_quietly(tracker, failed=True)

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self, failed: bool = False) -> None:
        """Idempotent. Trackers are finished (``failed``: as a crashed run)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for tracker in list(self.trackers):
            with rng_untouched():
                error = close_quietly(tracker, failed=failed)
            self.trackers.remove(tracker)
            if error:
                self.print(f"WARNING: --report_to {tracker.name}: closing failed ({error})")
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
