"""--report_to, --metric_for_best, --early_stopping_patience: the flag checks, judging the
best evaluation, rotation that keeps the best checkpoint and the Hugging Face folders, and
trackers that fail (tests/test_tracking_run.py runs all of it end to end)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from swift_mcore import RunArguments, SftArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

from run_helpers import ROOT, TINY


def resolved(cls=RunArguments, **flags):
    return resolve(cls.from_flags(**flags), world_size=1)


def test_report_to_takes_any_subset_or_none_and_tensorboard_stays_an_alias():
    assert resolved().logging.report_to == ("tensorboard",)
    assert resolved(report_to="wandb,swanlab tensorboard").logging.report_to == (
        "wandb", "swanlab", "tensorboard")
    assert resolved(report_to=["wandb", "wandb"]).logging.report_to == ("wandb",)
    assert resolved(report_to="none").logging.report_to == ()
    off = resolved(tensorboard=False, report_to="wandb").logging
    assert off.report_to == ("wandb",) and off.tensorboard is False
    assert resolved(tensorboard=False).logging.report_to == ()
    for flags, message in [
        (dict(report_to="mlflow"), "--report_to must be one of none, tensorboard, wandb, "
                                   "swanlab; got 'mlflow'"),
        (dict(report_to="none,wandb"), "--report_to none cannot be combined"),
        (dict(report_to="tensorboard", tensorboard=False), "--tensorboard false contradicts "
                                                           "--report_to tensorboard"),
    ]:
        with pytest.raises(ArgumentError, match=message.replace("(", r"\(")):
            resolved(**flags)


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "swanlab" else real(name, *a))
    with pytest.raises(ArgumentError, match=r"--report_to swanlab: the swanlab package is not "
                                            r"installed; pip install -r requirements/tracke"):
        resolved(report_to="wandb,swanlab")


def test_best_and_early_stopping_flags_need_evaluations_and_validation_data():
    c = resolved(early_stopping_patience=3).checkpoint
    assert (c.metric_for_best, c.greater_is_better) == ("val_loss", None)  # the default
    assert resolved(early_stopping_patience=2, no_save=True).checkpoint.no_save
    for cls, flags, message in [
        (RunArguments, dict(metric_for_best="val_loss", eval_steps=0),
         "--metric_for_best val_loss judges evaluations: set --eval_steps N > 0"),
        (RunArguments, dict(early_stopping_patience=2, eval_steps=0),
         "--early_stopping_patience 2 judges evaluations"),
        (RunArguments, dict(metric_for_best="val_loss", split="100,0,0"),
         "needs validation data: --split 100,0,0 holds out nothing"),
        (RunArguments, dict(metric_for_best="val_loss", no_save=True),
         "keeps the best checkpoint; it cannot be combined with --no_save"),
        (RunArguments, dict(metric_for_best="accuracy"),
         "--metric_for_best must be one of val_loss, val_ppl"),
        (RunArguments, dict(greater_is_better=True), "--greater_is_better needs "
                                                          "--metric_for_best"),
        (RunArguments, dict(early_stopping_patience=0),
         "--early_stopping_patience must be a positive integer"),
        (SftArguments, dict(dataset=["x.jsonl"], metric_for_best="val_loss"),
         "give --val_dataset or --split_dataset_ratio"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            resolved(cls, **flags)


def test_judging_evaluations_and_early_stopping():
    from types import SimpleNamespace

    from swift_mcore.checkpointing.state import TrainState
    from swift_mcore.training import best

    flags = SimpleNamespace(metric_for_best="val_loss", greater_is_better=None,
                            early_stopping_patience=2)
    state = TrainState()
    for iteration, value, improved in [(2, 5.0, True), (4, 4.0, True), (6, 4.5, False),
                                       (8, float("nan"), False)]:
        state.iteration = iteration
        assert best.judge(state, {"val_loss": value}, flags) is improved
    assert (state.best_value, state.best_iteration, state.evals_without_improvement) == (
        4.0, 4, 2)
    assert best.should_stop(state, flags) == ("early stopping: val_loss did not improve in 2 "
                                              "evaluations (best 4 at iteration 4)")
    # Saved and read back (train_state.json), and an older train state without the fields.
    assert TrainState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    old = {k: v for k, v in state.to_dict().items() if not k.startswith(("best", "evals"))}
    assert TrainState.from_dict(old).best_value is None
    # Another metric or order on resume: judged afresh, and the log says so.
    lines = []
    best.adopt(state, SimpleNamespace(metric_for_best="val_ppl", greater_is_better=None),
               lines.append)
    assert (state.best_value, state.evals_without_improvement) == (None, 0)
    assert "start afresh" in lines[0]


def test_rotation_takes_the_hugging_face_folder_along_and_keeps_the_best(tmp_path):
    from swift_mcore.checkpointing import best, commit
    from swift_mcore.checkpointing.state import TrainState

    root = str(tmp_path)
    for it in (2, 4, 6, 8):
        folder = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(folder)
        commit.seal(folder)
        os.makedirs(folder + "-hf")
    state = TrainState(iteration=8, best_metric="val_loss", best_greater_is_better=False,
                       best_value=1.5, best_iteration=4)
    assert best.write(root, state)["hf_folder"] == "iter_0000004-hf"
    removed = commit.rotate(root, keep=1, protect=8, newest=8, also_protect=(4,))
    assert sorted(map(os.path.basename, removed)) == ["iter_0000002", "iter_0000002-hf",
                                                      "iter_0000006", "iter_0000006-hf"]
    assert sorted(os.listdir(root)) == ["best", "best-hf", "best.json", "iter_0000004",
                                        "iter_0000004-hf", "iter_0000008", "iter_0000008-hf"]
    assert os.path.realpath(os.path.join(root, "best")) == os.path.join(root, "iter_0000004")


FLAGS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, micro_batch_size=2, global_batch_size=8, train_iters=3,
             lr_warmup_iters=0, eval_steps=0, log_interval=1, progress_bar=False,
             num_workers=0, no_save=True, plot=False)


def test_a_crashing_tracker_does_not_stop_training(gloo_group, tmp_path, capsys):
    """A tracker that raises mid-run is switched off with one warning; training, the other
    trackers and metrics.jsonl go on to the end."""
    import tracker_files as T
    from swift_mcore.training.trackers import TensorBoardTracker, Tracker
    from swift_mcore.training.trainer import Trainer

    class Crashing(Tracker):
        name = "crashing"
        calls = 0

        def log(self, split, iteration, metrics):
            Crashing.calls += 1
            if iteration == 2:
                raise ConnectionError("the tracker's server went away")

        def close(self, failed=False):
            raise ConnectionError("still away")

    class WithCrashingTracker(Trainer):
        def start_trackers(self, load_plan):
            return [Crashing(), TensorBoardTracker(self.config.logging.output_dir)]

    out = tmp_path / "run"
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        state = WithCrashingTracker(RunArguments.from_flags(
            **FLAGS, output_dir=str(out))).train()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert state.iteration == 3 and Crashing.calls == 2
    printed = capsys.readouterr().out
    warnings = [line for line in printed.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "WARNING: --report_to crashing failed (ConnectionError: the tracker's server went "
        "away); it receives nothing more in this run, training goes on")
    assert "finished at iteration 3" in printed
    expected = T.jsonl_values(out)
    assert {it for key, it in expected if key == "train/loss"} == {1, 2, 3}
    assert set(T.tensorboard_values(out)) == set(expected)


def test_a_tracker_that_cannot_start_stops_the_run_before_training(tmp_path):
    """SwanLab online without credentials: one line naming --report_to swanlab, exit 2, no
    traceback, nothing trained."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()  # gloo_group's port is held in this module
           if not k.startswith(("SWANLAB_", "WANDB_", "MASTER_"))}
    env["HOME"] = str(tmp_path)  # no stored credentials
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "pt", *TINY, "--train_iters", "2", "--no_save",
         "--report_to", "swanlab", "--output_dir", str(out)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "swift-mcore pt: error: --report_to swanlab: swanlab failed to start (RuntimeError: "
        "Failed to initialize SwanLab in online mode"), proc.stderr[-2000:]
    assert "SWANLAB_MODE=offline" in errors[0]
    assert not (out / "metrics.jsonl").exists()
