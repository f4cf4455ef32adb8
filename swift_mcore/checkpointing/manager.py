"""CheckpointManager: the trainer's one handle on its checkpoints, holding what the saves
of a run share (where they go, which checkpoint the state descends from, what was saved
last), so that no module keeps hidden state between a load and the saves after it."""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

from ..errors import CheckpointError
from ..runtime import collectives as comm
from . import best, commit, load, space
from .save import save_checkpoint
from .state import TrainState
from .folders import checkpoint_root, iter_dir_name


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
        # --async_save: megatron's queue of background saves, and the one in flight
        # (iteration, folder); at most one at a time.
        self.background = None
        self.pending: Optional[tuple] = None

    def restore(self, model, optimizer, scheduler) -> TrainState:
        if self.plan is None:
            return TrainState()
        state, self.parent_id = load.restore(self.plan, self.config, model, optimizer,
                                             scheduler, self.log)
        return state

    def saved_at(self, iteration: int) -> bool:
        return self.last_saved_iteration == iteration

    def save(self, state: TrainState, model, optimizer, scheduler, data_fingerprint) -> str:
        """The checkpoint of ``state.iteration``; with --async_save its shards are written in
        the background and it is committed by a later ``finish_saves``."""
        background = self.config.checkpoint.async_save
        if background:
            self.finish_saves(blocking=True)  # one background save at a time
        path, self.parent_id, request = save_checkpoint(
            self.config, state, model, optimizer, scheduler, data_fingerprint,
            self.parent_id, background=background)
        if request is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import (
                AsyncCallsQueue,
            )

            if self.background is None:
                self.background = AsyncCallsQueue()
            self.background.schedule_async_request(request)
            self.pending = (state.iteration, path)
        self.last_saved_iteration = state.iteration
        return path

    def finish_saves(self, blocking: bool = False) -> Optional[str]:
        """Collective (every iteration under --async_save): commit the background save once
        every rank has written its shards (``blocking``: wait for that). Returns the folder
        committed now, if any. A failed write is raised on every rank as a CheckpointError,
        its staging folder removed; the previous checkpoints stay."""
        if self.pending is None:
            return None
        iteration, path = self.pending
        try:
            done = self.background.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:
            self.pending = None
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            self.pending = None
            raise space.failed_background_save(self.root, iteration, err) from err
        if not done:
            return None
        self.pending = None
        self.log(f"saved checkpoint {path} (iteration {iteration}, written in the background)")
        return path

    def save_hf_folder(self, state: TrainState, convert: Callable[[str, str], str]) -> str:
        """Collective; after ``save`` of ``state.iteration``: its Hugging Face folder
        ``iter_NNNNNNN-hf``, written by ``convert(checkpoint, folder)`` (on rank 0) into a
        hidden staging folder, fsynced, then renamed into place; the best-checkpoint record
        then names it. Returns ``convert``'s line, naming the final folder. A failure is
        raised on every rank as a CheckpointError; no folder is left half-written."""
        checkpoint = os.path.join(self.root, iter_dir_name(state.iteration))
        final = checkpoint + commit.HF_SUFFIX

        def write() -> str:
            staging = commit.staging_dir(self.root, state.iteration, commit.new_token(),
                                         suffix=commit.HF_SUFFIX)
            try:
                line = convert(checkpoint, staging)
                commit.sync_tree(staging)
                commit.publish(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            best.write(self.root, state)
            return line.replace(staging, final)

        return comm.decide(write)
