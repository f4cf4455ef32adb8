"""CheckpointManager: the trainer's one handle on its checkpoints, holding what the saves
of a run share (where they go, which checkpoint the state descends from, what was saved
last), so that no module keeps hidden state between a load and the saves after it."""

from __future__ import annotations

from typing import Callable, Optional

from . import load
from .save import save_checkpoint
from .state import TrainState
from .tracker import checkpoint_root


class CheckpointManager:
    """Made from the run's config and its load plan (``load.plan_load``, taken before
    anything was written); ``restore(...)`` once model, optimizer and scheduler exist, then
    ``save(...)`` whenever the trainer saves. Both are collective."""

    def __init__(self, config, plan: Optional[load.LoadPlan], log: Callable[[str], None] = print):
        self.config = config
        self.root = checkpoint_root(config)
        self.log = log
        self.plan = plan
        # Id of the checkpoint the training state descends from (resumed from, or saved
        # last); sealed into each manifest as its parent (locate.py follows it).
        self.parent_id: Optional[str] = None
        self.last_saved_iteration: Optional[int] = None

    def restore(self, model, optimizer, scheduler) -> TrainState:
        if self.plan is None:
            return TrainState()
        state, self.parent_id = load.restore(self.plan, self.config, model, optimizer,
                                             scheduler, self.log)
        return state

    def saved_at(self, iteration: int) -> bool:
        return self.last_saved_iteration == iteration

    def save(self, state: TrainState, model, optimizer, scheduler, data_fingerprint) -> str:
        path, self.parent_id = save_checkpoint(self.config, state, model, optimizer,
                                               scheduler, data_fingerprint, self.parent_id)
        self.last_saved_iteration = state.iteration
        return path
