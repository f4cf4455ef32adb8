"""The best evaluation and early stopping (--metric_for_best, --greater_is_better,
--early_stopping_patience): judged on the TrainState, so a resume continues both exactly."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

from ..checkpointing.state import TrainState


def greater_is_better(checkpoint_flags) -> bool:
    """--greater_is_better, else what the metric's name says: losses and perplexities are
    better lower."""
    if checkpoint_flags.greater_is_better is not None:
        return bool(checkpoint_flags.greater_is_better)
    name = checkpoint_flags.metric_for_best or ""
    return not (name.endswith("loss") or name.endswith("ppl"))


def adopt(state: TrainState, checkpoint_flags, log: Callable[[str], None]) -> None:
    """After a restore: keep the best so far if it is of the same metric and order; else
    (the flags changed, or an older checkpoint) start judging afresh, saying so."""
    metric = checkpoint_flags.metric_for_best
    if metric is None:
        return
    greater = greater_is_better(checkpoint_flags)
    if state.best_metric == metric and state.best_greater_is_better == greater:
        return
    if state.best_metric is not None:
        log(f"--metric_for_best {metric} ({_order(greater)}): the checkpoint judged "
            f"{state.best_metric} ({_order(state.best_greater_is_better)}); the best "
            f"checkpoint and the early-stopping count start afresh")
    state.best_metric, state.best_greater_is_better = metric, greater
    state.best_value = state.best_iteration = None
    state.evals_without_improvement = 0


def _order(greater: Optional[bool]) -> str:
    return "higher is better" if greater else "lower is better"


def judge(state: TrainState, metrics: Optional[Dict[str, float]], checkpoint_flags) -> bool:
    """One evaluation's ``metrics`` against the best so far: updates ``state`` and returns
    whether this evaluation is the new best. A missing or non-finite value never is."""
    metric = checkpoint_flags.metric_for_best
    if metric is None or metrics is None:
        return False
    greater = greater_is_better(checkpoint_flags)
    state.best_metric, state.best_greater_is_better = metric, greater
    value = metrics.get(metric)
    improved = value is not None and math.isfinite(value) and (
        state.best_value is None
        or (value > state.best_value if greater else value < state.best_value))
    if improved:
        state.best_value, state.best_iteration = float(value), state.iteration
        state.evals_without_improvement = 0
    else:
        state.evals_without_improvement += 1
    return improved


def should_stop(state: TrainState, checkpoint_flags) -> Optional[str]:
    """Why early stopping ends the run now (None: it does not)."""
    patience = checkpoint_flags.early_stopping_patience
    if not patience or state.evals_without_improvement < patience:
        return None
    best = ("no finite value yet" if state.best_value is None else
            f"best {state.best_value:.6g} at iteration {state.best_iteration}")
    return (f"early stopping: {state.best_metric} did not improve in "
            f"{state.evals_without_improvement} evaluations ({best})")
