"""TrainState: the run's counters, typed, kept apart from the configuration."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    # --metric_for_best / --early_stopping_patience (training/best.py): the best evaluation
    # so far, and how many evaluations since did not improve on it.
    best_metric: Optional[str] = None        # the metric the best value is of
    best_greater_is_better: Optional[bool] = None
    best_value: Optional[float] = None
    best_iteration: Optional[int] = None
    evals_without_improvement: int = 0
    # --streaming (data/streaming.py): the stream's position after consumed_train_samples
    # (reader offsets, shuffle generator, the locators of the rows held); None otherwise.
    data_stream: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        values = asdict(self)
        if values["data_stream"] is None:  # train_state.json of other runs stays as it was
            del values["data_stream"]
        return values

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainState":
        """The counters of train_state.json. A checkpoint written before the best-metric
        fields existed has none of them: they take their defaults (no best yet)."""
        names = {f.name for f in fields(cls)}
        missing = set(REQUIRED) - set(data)
        if missing:
            raise ValueError(f"train state is missing {', '.join(sorted(missing))}")
        values = {}
        for name in names & set(data):
            value = data[name]
            values[name] = None if value is None and name not in REQUIRED else \
                _TYPES[name](value)
        return cls(**values)


def _mapping(value) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"data_stream is a {type(value).__name__}, not an object")
    return value


REQUIRED = ("iteration", "consumed_train_samples", "consumed_valid_samples",
            "skipped_train_samples", "floating_point_operations_so_far")
_TYPES = {"iteration": int, "consumed_train_samples": int, "consumed_valid_samples": int,
          "skipped_train_samples": int, "floating_point_operations_so_far": float,
          "best_metric": str, "best_greater_is_better": bool, "best_value": float,
          "best_iteration": int, "evals_without_improvement": int, "data_stream": _mapping}
