"""The plain JSON files of a checkpoint folder, next to megatron's dist_checkpointing files."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from ..errors import ArgumentError, CheckpointError
from ..input_files import load_json
from .state import TrainState

TRAIN_STATE = "train_state.json"   # TrainState: iteration and sample counters
ARGS = "args.json"                 # every flag of the run, grouped by concern
RUN = "run.json"                   # data fingerprint, contents, layout, versions
# (the scheduler state is in common.pt, where Megatron-LM keeps it, in its units: samples;
# megatron_lm.common_entries)


def write_json(folder: str, name: str, data: Any) -> None:
    with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)


def read_json(folder: str, name: str) -> Dict[str, Any]:
    """A JSON object file of the checkpoint, read as input_files reads untrusted JSON (a
    regular file only, bounded in size and nesting); anything else (a FIFO, garbage, binary,
    another JSON value) is a one-line CheckpointError naming the file."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint {folder} has no {name}")
    try:
        data = load_json(path, name)
    except ArgumentError as err:  # "NAME: why"
        raise CheckpointError(f"checkpoint {folder}: {name} is unreadable "
                              f"({str(err)[len(name) + 2:]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {folder}: {name} is unreadable (it holds a JSON "
                              f"{type(data).__name__}, not an object)")
    return data


def read_train_state(folder: str) -> TrainState:
    """train_state.json as a TrainState; counters of the wrong type or missing are a one-line
    CheckpointError naming the file."""
    try:
        return TrainState.from_dict(read_json(folder, TRAIN_STATE))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {folder}: {TRAIN_STATE} is invalid ({err})"
                              ) from None


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__}
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except Exception:
        pass
    try:
        from importlib.metadata import version

        out["swift_mcore"] = version("swift-mcore")
    except Exception:
        pass
    return out
