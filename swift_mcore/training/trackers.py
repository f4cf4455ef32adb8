"""Experiment trackers (--report_to): TensorBoard, Weights & Biases and SwanLab through their
own libraries, behind one small interface the MetricWriter fans out to (last rank only).

A tracker that cannot start stops the run before its first iteration with one line naming
--report_to; one that fails later is switched off with a warning and training goes on
(writers.py). W&B and SwanLab keep their run id in ``output_dir/trackers.json``, so a
resumed run continues the same tracked run; a resume that finds that file unreadable stops
with one line naming it (starting new tracked runs silently would split the run's history).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from ..atomic_write import write_atomic
from ..errors import ArgumentError, OutputError
from ..input_files import load_json
from ..runtime import run_files

RUN_IDS = run_files.TRACKER_IDS  # {"wandb": "<run id>", "swanlab": "<run id>"}
DEFAULT_PROJECT = "swift-mcore"


class Tracker:
    """One tracker: ``log`` a record's metrics (a split, an iteration), ``close`` at the
    end (``failed``: the run ended with an error)."""

    name = "tracker"

    def log(self, split: str, iteration: int, metrics: Dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        pass


class TensorBoardTracker(Tracker):
    """torch's SummaryWriter: one scalar per metric, tagged ``split/metric``."""

    name = "tensorboard"

    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = os.path.join(output_dir, "runs")
        self._writer = SummaryWriter(self.logdir)

    def log(self, split, iteration, metrics):
        for key, value in metrics.items():
            self._writer.add_scalar(f"{split}/{key}", value, iteration)

    def close(self, failed=False):
        self._writer.flush()
        self._writer.close()


class WandbTracker(Tracker):
    """A W&B run under ``output_dir/wandb`` (WANDB_MODE: online by default, offline logs
    locally for `wandb sync`). Metrics are logged against ``iteration`` (W&B's own step
    would refuse the iterations a resumed run trains again after a crash)."""

    name = "wandb"

    def __init__(self, output_dir: str, run_id: str, name: str, config: dict,
                 resumed: bool):
        import wandb

        self.run_id = run_id
        self._run = wandb.init(
            dir=output_dir, id=run_id, name=name, config=config, resume="allow",
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            settings=wandb.Settings(console="off", silent=True))
        self._run.define_metric("iteration")
        for split in ("train", "valid"):
            self._run.define_metric(f"{split}/*", step_metric="iteration")

    def log(self, split, iteration, metrics):
        self._run.log({"iteration": iteration,
                       **{f"{split}/{key}": value for key, value in metrics.items()}})

    def close(self, failed=False):
        self._run.finish(exit_code=1 if failed else 0)


class SwanLabTracker(Tracker):
    """A SwanLab run under ``output_dir/swanlog`` (SWANLAB_MODE: online by default; offline
    or local log locally). It never prompts: without credentials online mode fails."""

    name = "swanlab"

    def __init__(self, output_dir: str, run_id: str, name: str, config: dict,
                 resumed: bool):
        import swanlab

        self.run_id = run_id
        settings = swanlab.Settings(interactive=False, terminal={"proxy_type": "none"})
        self._run = swanlab.init(
            log_dir=os.path.join(output_dir, "swanlog"), id=run_id, name=name, config=config,
            resume="allow", project=os.environ.get("SWANLAB_PROJECT") or DEFAULT_PROJECT,
            settings=settings, reinit=True)

    def log(self, split, iteration, metrics):
        self._run.log({f"{split}/{key}": value for key, value in metrics.items()},
                      step=iteration)

    def close(self, failed=False):
        if failed:
            self._run.finish(state="crashed", error="the swift-mcore run stopped with an error")
        else:
            self._run.finish()


# --report_to name -> (class, what its start-up failure usually means)
KINDS = {
    "tensorboard": (TensorBoardTracker, "output_dir/runs must be writable"),
    "wandb": (WandbTracker, "set WANDB_MODE=offline to log locally, or log in (`wandb login` "
                            "or WANDB_API_KEY)"),
    "swanlab": (SwanLabTracker, "set SWANLAB_MODE=offline (or local) to log locally, or log "
                                "in (`swanlab login` or SWANLAB_API_KEY)"),
}


def start(names: Sequence[str], output_dir: str, config: dict, run_name: Optional[str],
          resumed: bool) -> List[Tracker]:
    """Start the trackers --report_to names, in order. ``resumed``: continue the tracked
    runs whose ids ``output_dir/trackers.json`` holds (a fresh run starts new ones).
    Raises ArgumentError naming --report_to and the tracker if one cannot start; those
    already started are closed again."""
    keeps_ids = any(n != "tensorboard" for n in names)
    ids = read_run_ids(output_dir, names) if resumed and keeps_ids else {}
    name = run_name or os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    started: List[Tracker] = []
    for tracker_name in names:
        cls, hint = KINDS[tracker_name]
        try:
            if cls is TensorBoardTracker:
                tracker = cls(output_dir)
            else:
                run_id = ids.get(tracker_name) or new_run_id()
                tracker = cls(output_dir, run_id, name, config, resumed)
                ids[tracker_name] = run_id
        except Exception as err:  # the library's own error, whatever its type
            for other in started:
                close_quietly(other, failed=True)
            message = " ".join(str(err).split()) or type(err).__name__
            raise ArgumentError(f"--report_to {tracker_name}: {tracker_name} failed to start "
                                f"({type(err).__name__}: {message[:300]}); {hint}") from None
        started.append(tracker)
    if keeps_ids:
        try:
            write_run_ids(output_dir, ids)
        except (OSError, OutputError) as err:  # a planted link, a full disk: on every rank
            for tracker in started:
                close_quietly(tracker, failed=True)
            text = str(err) if isinstance(err, OutputError) else run_files.write_failure(
                os.path.join(output_dir, RUN_IDS), err, "it was left as it was",
                "then run it again")
            raise ArgumentError(f"--report_to {','.join(names)}: {text}") from None
    return started


def new_run_id() -> str:
    """16 hex digits from os.urandom (never from the RNGs a checkpoint saves)."""
    import uuid

    return uuid.uuid4().hex[:16]


def close_quietly(tracker: Tracker, failed: bool) -> Optional[str]:
    """Close ``tracker``; the error as text if that failed too (None: it closed)."""
    try:
        tracker.close(failed=failed)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def read_run_ids(output_dir: str, names: Sequence[str] = ()) -> Dict[str, str]:
    """The run ids a resumed run continues ({} where the file does not exist). An
    unreadable file (not a regular file, not JSON, not {"tracker": "id"}) raises
    ArgumentError naming it."""
    path = os.path.join(output_dir, RUN_IDS)
    trackers = ",".join(n for n in names if n != "tensorboard") or "wandb,swanlab"
    if not os.path.lexists(path):
        return {}
    try:  # a FIFO or device would block the resume: load_json opens regular files only
        data = load_json(path)
    except ArgumentError as err:
        data, bad = None, str(err).removeprefix(f"{path}: ")
    except OSError as err:
        data, bad = None, err.strerror or str(err)
    else:
        bad = None if isinstance(data, dict) and all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in data.items()) else \
            'not {"tracker": "run id", ...}'
    if bad:
        raise ArgumentError(
            f"--report_to {trackers}: {path} cannot be read ({bad}); it holds the tracked "
            f"runs this resumed run continues. Restore it, or delete it to start new "
            f"tracked runs")
    return dict(data)


def write_run_ids(output_dir: str, ids: Dict[str, str]) -> None:
    """``output_dir/trackers.json``, replaced atomically (the name, never a file a link
    planted there points to; run_lock refuses such a link before the run starts)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, RUN_IDS)
    run_files.check(path)
    write_atomic(path, json.dumps(dict(sorted(ids.items())), indent=1) + "\n")
