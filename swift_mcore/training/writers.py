"""Where metrics go: the log line, tqdm, tensorboard and metrics.jsonl (last rank only)."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

from tqdm import tqdm


def format_log_line(iteration: int, total: int, metrics: Dict[str, float]) -> str:
    parts = [f"iter {iteration}/{total}"]
    labels = [("loss", "loss {:.4f}"), ("lr", "lr {:.3e}"), ("grad_norm", "grad_norm {:.3f}"),
              ("tokens_per_s", "tokens/s {:.0f}"), ("tflops", "TFLOP/s {:.4f}"),
              ("val_loss", "val_loss {:.4f}"), ("val_ppl", "val_ppl {:.2f}")]
    for key, fmt in labels:
        if key in metrics and metrics[key] is not None:
            parts.append(fmt.format(metrics[key]))
    return " | ".join(parts)


class MetricWriter:
    """Active on the writing rank; on every other rank each method does nothing."""

    def __init__(self, output_dir: str, total_iters: int, start_iter: int, active: bool,
                 tensorboard: bool = True, progress_bar: bool = True):
        self.active = active
        self.total_iters = total_iters
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl")
        self.tensorboard_dir = os.path.join(output_dir, "runs")
        self._tb = None
        self._bar: Optional[tqdm] = None
        self._jsonl = None
        if not active:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir)
        if progress_bar:
            self._bar = tqdm(total=total_iters, initial=start_iter, desc="train",
                             dynamic_ncols=True, leave=True)

    def step(self, iteration: int, loss: Optional[float]) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def record(self, iteration: int, metrics: Dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        clean = {k: v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        self._jsonl.write(json.dumps({"iteration": iteration, "split": prefix, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(f"{prefix}/{key}", value, iteration)

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
