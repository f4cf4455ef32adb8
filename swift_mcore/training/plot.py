"""The loss plot, ``output_dir/loss.png`` (at the end of a run, and `swift-mcore plot`): train
and validation loss against iterations (tokens on the top axis), the learning rate below,
resumed segments and the best checkpoint marked. Read from metrics.jsonl alone; written
through a new temporary file renamed over the target, which is only ever a new name or a
PNG image written before (runtime/run_files.py)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

SIZE_INCHES = (10.0, 6.0)
DPI = 100  # -> 1000 x 600 pixels
PLOT_FILENAME = "loss.png"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # what every PNG file starts with


@dataclass
class RunRecords:
    """metrics.jsonl as the run's lineage: the records of the iterations the final
    checkpoints descend from (a resumed segment replaces what an interrupted one trained
    after the checkpoint it resumed from), and where each segment started."""

    train: Dict[int, dict] = field(default_factory=dict)
    valid: Dict[int, dict] = field(default_factory=dict)
    resumed_at: List[int] = field(default_factory=list)


def read_records(path: str) -> RunRecords:
    """Raises ValueError naming ``path`` when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except (OSError, UnicodeDecodeError) as err:
        cause = err.strerror if isinstance(err, OSError) and err.strerror else \
            f"not utf-8 text: {err.reason}" if isinstance(err, UnicodeDecodeError) else err
        raise ValueError(f"{path} cannot be read ({cause})") from None
    return parse_records(lines)


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def parse_records(lines) -> RunRecords:
    run = RunRecords()
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(record, dict):
            continue
        split, iteration = record.get("split"), record.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            continue
        if split == "start":
            for table in (run.train, run.valid):
                for later in [it for it in table if it > iteration]:
                    del table[later]
            if iteration > 0:
                run.resumed_at.append(iteration)
        elif split in ("train", "valid"):  # what is drawn: numbers only
            table = run.train if split == "train" else run.valid
            table[iteration] = {k: v for k, v in record.items() if number(v)}
    return run


def write_plot(output_dir: str, path: Optional[str] = None, flag: str = "") -> str:
    """Draw ``output_dir``'s metrics.jsonl into ``path`` (default output_dir/loss.png);
    returns the path. Raises ValueError naming metrics.jsonl when it cannot be read or has
    nothing to draw, OutputError naming ``path`` when that may not be written (a file the
    plot did not write) or the write fails (a full disk; nothing is left half-written)."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, FuncFormatter

    from ..checkpointing import CHECKPOINT_SUBDIR, best
    from ..runtime import run_files

    metrics_path = os.path.join(output_dir, run_files.METRICS)
    if not os.path.exists(metrics_path):
        raise ValueError(f"{metrics_path} does not exist (is {output_dir} a run's output_dir?)")
    run = read_records(metrics_path)
    train_its = sorted(it for it, r in run.train.items() if r.get("loss") is not None)
    if not train_its:
        raise ValueError(f"{metrics_path} has no training loss to plot")
    path = path or os.path.join(output_dir, PLOT_FILENAME)
    run_files.check_replaceable(path, PNG_MAGIC, "a PNG image", flag)

    fig = Figure(figsize=SIZE_INCHES, dpi=DPI)
    loss_ax, lr_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    loss = [run.train[it]["loss"] for it in train_its]
    loss_ax.plot(train_its, loss, color="C0", linewidth=1.4, label="train loss")
    valid_its = sorted(it for it, r in run.valid.items() if r.get("val_loss") is not None)
    if valid_its:
        loss_ax.plot(valid_its, [run.valid[it]["val_loss"] for it in valid_its], "o-",
                     color="C1", markersize=4, linewidth=1.2, label="validation loss")
    record = best.read(os.path.join(output_dir, CHECKPOINT_SUBDIR))
    if record and record.get("iteration") in run.valid and record.get("metric") == "val_loss":
        it = record["iteration"]
        loss_ax.plot([it], [run.valid[it]["val_loss"]], "*", color="C3", markersize=14,
                     label=f"best checkpoint (iteration {it})")
    lr_its = [it for it in sorted(run.train) if run.train[it].get("lr") is not None]
    lr_ax.plot(lr_its, [run.train[it]["lr"] for it in lr_its], color="C2", linewidth=1.2)

    first = min(min(train_its), min(valid_its) if valid_its else train_its[0])
    start = 0 if first <= max(1, train_its[-1] // 20) else first - 1
    last = max(train_its[-1], valid_its[-1] if valid_its else 0)
    for ax in (loss_ax, lr_ax):
        ax.set_xlim(start, last + max(1, last - start) * 0.01)
        ax.grid(True, alpha=0.3)
        for i, it in enumerate(run.resumed_at):
            ax.axvline(it, color="0.45", linestyle=":", linewidth=1.2,
                       label="resumed" if ax is loss_ax and i == 0 else None)
    for it in run.resumed_at:
        loss_ax.annotate(f"resumed at {it}", xy=(it, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, -12), textcoords="offset points", fontsize=8, color="0.35")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="best", fontsize=9)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("iteration")
    lr_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.1e}" if v else "0"))

    # Tokens on the top axis: the input tokens of the lineage's log windows, summed.
    counts = [run.train[it].get("tokens") for it in sorted(run.train)]
    if all(isinstance(c, (int, float)) and c > 0 for c in counts):
        its = np.array([start, *sorted(run.train)], dtype=float)
        tokens = np.concatenate([[0.0], np.cumsum(counts)])
        if start > 0:  # a run resumed from elsewhere: tokens counted from its first record
            tokens[0] = 0.0
        if np.all(np.diff(its) > 0):
            # Continued past the last record at the last window's rate, so that ticks beyond
            # the data land beyond the axis instead of piling up at its end.
            far = (its[-1] - its[0] + 1) * 10
            rate = (tokens[-1] - tokens[-2]) / (its[-1] - its[-2])
            its, tokens = np.append(its, its[-1] + far), np.append(tokens, tokens[-1] + rate * far)
            top = loss_ax.secondary_xaxis(
                "top", functions=(lambda x: np.interp(x, its, tokens),
                                  lambda t: np.interp(t, tokens, its)))
            top.set_xlabel("tokens")
            top.xaxis.set_major_formatter(EngFormatter())

    name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    title = f"{name}: train loss {loss[-1]:.4f} at iteration {train_its[-1]}"
    if valid_its:
        title += f", validation loss {run.valid[valid_its[-1]]['val_loss']:.4f}"
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    return path


def save_png(fig, path: str) -> None:
    """The figure as a new temporary sibling (never a planted file or link), renamed over
    ``path``; a failed write leaves ``path`` as it was and no temporary file."""
    from ..atomic_write import write_atomic
    from ..errors import OutputError

    try:
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=DPI))
    except OSError as err:
        from ..runtime.run_files import write_failure

        raise OutputError(write_failure(path, err, "it was left as it was",
                                        "then run it again")) from None
