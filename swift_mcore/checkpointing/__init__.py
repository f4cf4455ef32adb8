"""Checkpoints: TrainState, save/load with dist_checkpointing, the commit protocol.

- ``CheckpointManager(config)``: the trainer's handle (plan the load, restore, save).
- ``load_weights(folder, model)``, ``find_checkpoint(path, ...)``, ``read_run_flags(folder)``:
  what export and infer need to rebuild a trained model.
- ``save_checkpoint(...)``: one save (a weights-only checkpoint for export --to_mcore).

All loads and saves are collective (call them on every rank). See docs/resume.md for what a
checkpoint holds and what a resume guarantees.
"""

from .io import tensor_shapes
from .load import find_checkpoint, load_weights, read_run_flags
from .manager import CheckpointManager
from .save import save_checkpoint
from .state import TrainState
from .folders import CHECKPOINT_SUBDIR, LATEST_FILENAME, checkpoint_root, iter_dir_name

__all__ = ["CHECKPOINT_SUBDIR", "CheckpointManager", "LATEST_FILENAME", "TrainState",
           "checkpoint_root", "find_checkpoint", "iter_dir_name", "load_weights",
           "read_run_flags", "save_checkpoint", "tensor_shapes"]
