"""save_checkpoint: every rank writes its shards into a hidden staging folder; the commit
protocol (commit.py) seals, renames and tracks it; the best-checkpoint record (best.py)
follows, rotation runs last."""

from __future__ import annotations

import copy
import os
import time
from typing import Optional, Tuple

from ..runtime import collectives as comm
from ..runtime import run_lock
from . import best, commit, files, io, megatron_lm, rng, space
from .state import TrainState
from .folders import checkpoint_root, iter_dir_name, read_latest, write_latest


@space.guarded  # a failed save: one clear error, its staging folder removed
def save_checkpoint(config, state: TrainState, model, optimizer, scheduler,
                    data_fingerprint, parent_id: Optional[str] = None,
                    background: bool = False) -> Tuple[str, str, Optional[object]]:
    """Collective. Returns (the committed folder ``output_dir/checkpoint/iter_NNNNNNN``, its
    id, None). ``parent_id`` is the id of the checkpoint this training state descends from
    (the one resumed from or saved last), sealed into the manifest (locate.py reads it). An
    error on any rank (a full disk, say) is raised on every rank; the previous checkpoints
    are untouched, the hidden staging folder removed (space.py).

    ``background`` (--async_save): the shards are left to megatron's AsyncRequest, returned
    third; everything else is written now, and the seal, rename and latest-iteration file are the
    request's last finalize step, run once every rank's shards are written (manager.py).
    Until then the folder is a staging folder, which resume never picks.

    Each fact is written once: counters in train_state.json, the flags in args.json, the
    rest of swift-mcore's facts in run.json; common.pt holds Megatron-LM's copies of the
    iteration, scheduler and FLOPs (its loader reads them there; the scheduler is read back
    from there too)."""
    c = config.checkpoint
    root = checkpoint_root(config)
    iteration = state.iteration
    final = os.path.join(root, iter_dir_name(iteration))
    token = comm.broadcast(commit.new_token() if comm.rank() == 0 else None)
    staging = comm.broadcast(commit.staging_dir(root, iteration, token)
                             if comm.rank() == 0 else None)  # named for rank 0's process
    comm.decide(_prepare, root, staging)

    # Model and optimizer: sharded tensors (torch_dist). An optimizer that has not stepped
    # yet has no state to save (Adam creates it lazily).
    with_optimizer = not c.no_save_optim and io.optimizer_has_state(optimizer)
    # No scheduler: a weights-only checkpoint (export --to_mcore), loadable with --finetune.
    state_dict = io.sharded_state_dict(model, optimizer, with_optimizer=with_optimizer,
                                       is_loading=False, metadata=megatron_lm.CONTENT_METADATA)
    state_dict.update(megatron_lm.common_entries(state, scheduler, config))
    space.check_free(root, iteration, state_dict)
    request = io.save(state_dict, staging, fully_parallel=config.fully_parallel_save,
                      background=background)

    layouts = comm.all_gather(rng.layout())
    if not c.no_save_rng:
        comm.raise_if_any(comm.attempt(rng.save, staging, comm.rank(), config.cuda))
    comm.decide(_write_json, staging, config.model.model, {
        files.TRAIN_STATE: state.to_dict(),
        files.ARGS: config.to_dict(),
        files.RUN: {
            "data_fingerprint": data_fingerprint,
            # --tuner_type lora: the checkpoint holds the adapters; these are its base weights
            "base_model": config.base_model,
            "contents": {"model": True, "optimizer": not c.no_save_optim,
                         "optimizer_stepped": with_optimizer, "rng": not c.no_save_rng,
                         "optimizer_format": io.optimizer_format(
                             config.parallel.use_distributed_optimizer),
                         "scheduler": scheduler is not None},
            "layout": {"world_size": comm.world_size(), **{
                k: v for k, v in layouts[0].items() if k.endswith("_size")}},
            "rng_layouts": {str(r): lay for r, lay in enumerate(layouts)},
            # common.pt's scheduler counts samples (Megatron-LM's unit): steps per iteration
            "scheduler_unit": config.training.global_batch_size,
            "versions": files.versions(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    })

    saved_state = copy.deepcopy(state)  # training goes on while a background save runs

    def finish() -> None:
        commit.seal(staging, extra={"id": token, "parent_id": parent_id})
        comm.decide(_publish, staging, final, root, saved_state, c.save_total_limit)

    if request is None:
        finish()
        return final, token, None
    request.add_finalize_fn(finish)
    return final, token, request


def _prepare(root: str, staging: str) -> None:
    os.makedirs(root, exist_ok=True)
    commit.remove_stale(root, locked=run_lock.holds(os.path.dirname(root)))
    os.makedirs(staging)


def _write_json(staging: str, model_folder, contents: dict) -> None:
    from ..models import carried

    # --model a multimodal folder: the tensors its language model does not hold, which an
    # export copies from that folder (export.py checks them against the folder then)
    contents[files.RUN]["multimodal_source"] = carried.record(model_folder)
    for name, data in contents.items():
        files.write_json(staging, name, data)


def _publish(staging: str, final: str, root: str, state: TrainState,
             save_total_limit: Optional[int]) -> None:
    """Rank 0: rename into place, then the latest-iteration file, the best-checkpoint record,
    rotation (never of the latest-iteration file's nor of the best checkpoint)."""
    # A Hugging Face folder of the same iteration belongs to the checkpoint replaced here.
    commit.remove_folder(final + commit.HF_SUFFIX)
    commit.publish(staging, final)
    write_latest(root, state.iteration)
    best.write(root, state)
    if save_total_limit:
        tracked, _ = read_latest(root)
        commit.rotate(root, save_total_limit, protect=tracked, newest=state.iteration,
                      also_protect=(state.best_iteration,))
