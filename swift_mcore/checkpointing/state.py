"""TrainState: the run's counters, typed, kept apart from the configuration."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0
    floating_point_operations_so_far: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TrainState":
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"train state is missing {', '.join(sorted(missing))}")
        return cls(**{name: type(getattr(cls(), name))(data[name]) for name in names})
