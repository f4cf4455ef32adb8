"""Checkpoints: TrainState, save/load with dist_checkpointing, tracker and commit protocol.

- ``save_checkpoint(args, state, model, optimizer, scheduler, data_fingerprint) -> str``
- ``load_checkpoint(args, model, optimizer, scheduler, data_fingerprint, log=print)
  -> TrainState``

Both are collective (call them on every rank). See docs/resume.md for what a checkpoint
holds and what a resume guarantees.
"""

from ..errors import CheckpointError
from .load import load_checkpoint
from .save import save_checkpoint
from .state import TrainState
from .tracker import TRACKER_FILENAME, checkpoint_root, iter_dir_name

__all__ = ["CheckpointError", "TRACKER_FILENAME", "TrainState", "checkpoint_root",
           "iter_dir_name", "load_checkpoint", "save_checkpoint"]
