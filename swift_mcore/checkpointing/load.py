"""Loading: which checkpoint a run continues from and whether it may (``plan_load``, before
anything is written), then restoring model, optimizer, scheduler, RNG and the TrainState
(``restore``), logging exactly what was and was not restored; ``load_weights`` for the
model alone (--finetune, export, infer)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..models import carried, finite
from ..runtime import collectives as comm
from . import commit, compat, files, io, locate, megatron_lm, rng
from .state import TrainState
from .folders import checkpoint_root

Log = Callable[[str], None]


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint to resume from records of its run, read on rank 0 by ``plan_load``:
    from swift-mcore's JSON files, or from a Megatron-LM checkpoint's common.pt, in the one
    shape ``restore`` reads."""

    train_state: TrainState            # the counters the run continues from
    id: Optional[str]                  # the manifest's id, the next save's parent (None:
    megatron_lm: bool                  # written by Megatron-LM or ms-swift, no manifest)
    has_optimizer: bool                # optimizer state saved (not --no_save_optim)
    optimizer_stepped: bool            # ... and the optimizer had stepped (Adam has state)
    has_rng: bool                      # RNG states saved (not --no_save_rng)
    scheduler_unit: int                # common.pt's scheduler steps per iteration
    layout: Dict[str, Optional[int]]   # tp_size, pp_size, dp_size of the saving run
    # each saving rank's layout, by rank, for swift-mcore's rng/ files (rng.choose)
    rng_layouts: Dict[int, Dict[str, int]] = dataclasses.field(default_factory=dict)
    # how its optimizer state is laid out (io.optimizer_format); 'plain' before the entry
    optimizer_format: str = "plain"


@dataclass(frozen=True)
class LoadPlan:
    """What ``restore`` will do: resume a run, or take a checkpoint's weights (finetune)."""

    kind: str                          # "resume" | "finetune"
    folder: str
    record: Optional[CheckpointRecord] = None   # resume: what the checkpoint records
    differences: Tuple[str, ...] = ()           # accepted with the override


def plan_load(config, data_fingerprint, log: Log = print) -> Optional[LoadPlan]:
    """Collective; before the data cache, the model or anything else is written. Refuses a
    fresh run over existing checkpoints, locates the checkpoint to resume (or --load), and
    checks that resuming would not silently change the run. None: start from scratch."""
    c = config.checkpoint
    root = checkpoint_root(config)
    if not c.resume and not c.no_save:
        existing = comm.decide(locate.existing_checkpoints, root)
        if existing:
            raise CheckpointError(
                f"{root} already holds checkpoints of another run (newest: {existing[-1]}); "
                f"a fresh run would write over them. Pass --resume to continue that run, or "
                f"choose another --output_dir.")
    if c.finetune:
        folder = find_checkpoint(c.load, None, "--load", log)
        lines = comm.decide(_model_differences, folder, config)
        if lines and not c.override_resume_check:
            raise CheckpointError(
                f"--load {c.load}: the checkpoint's model differs from this one:\n"
                + "\n".join(f"  {line}" for line in lines)
                + "\nMatch the model flags, or pass --override_resume_check if the shapes "
                  "still agree.")
        return LoadPlan("finetune", folder)
    if not c.resume:
        return None
    folder = find_checkpoint(c.resume, root, "--resume", log)
    if folder is None:
        log(f"--resume: no checkpoint under {root}; starting from scratch (iteration 0)")
        return None
    record, differences = comm.decide(_read_record, folder, config, data_fingerprint)
    if differences and not c.override_resume_check:
        raise CheckpointError(compat.refusal(folder, differences))
    if not c.no_load_optim and not record.has_optimizer:
        raise CheckpointError(
            f"checkpoint {folder} has no optimizer state (it was saved with --no_save_optim); "
            f"pass --no_load_optim to resume with a fresh optimizer")
    if not c.no_load_optim and record.has_optimizer and record.optimizer_stepped:
        problem = compat.optimizer_format_problem(
            record.optimizer_format, config.parallel.use_distributed_optimizer)
        if problem:
            raise CheckpointError(f"checkpoint {folder}: {problem}")
    if not c.no_load_rng and not record.has_rng:
        raise CheckpointError(
            f"checkpoint {folder} has no RNG states (it was saved with --no_save_rng); pass "
            f"--no_load_rng to resume with freshly seeded RNGs")
    return LoadPlan("resume", folder, record, tuple(differences))


def find_checkpoint(spec: str, default_root: Optional[str], flag: str,
                    log: Log = print) -> Optional[str]:
    """Collective: the folder ``spec`` names ('auto': the newest under ``default_root``; a
    run's output_dir, a checkpoint root or an iter_ folder), decided on rank 0. Every
    fallback to another checkpoint than the latest-iteration file's is logged as a warning, here."""
    return locate.announce(comm.decide(locate.resolve, spec, default_root, flag), log)


def restore(plan: LoadPlan, config, model, optimizer, scheduler,
            log: Log = print) -> Tuple[TrainState, Optional[str]]:
    """Collective; after model, optimizer and scheduler exist and before the data loaders.
    Returns the TrainState to continue from and the id of the checkpoint it came from."""
    if plan.kind == "finetune":
        load_weights(plan.folder, model)
        optimizer.reload_model_params()  # its main copies take the loaded weights
        log(f"--finetune: model weights from {plan.folder}; optimizer, LR schedule, RNG and "
            f"counters start fresh (iteration 0)")
        return TrainState(), None
    c, folder, record = config.checkpoint, plan.folder, plan.record
    foreign = record.megatron_lm
    common = comm.decide(lambda: {k: v for k, v in io.read_common(folder).items()
                                  if k in ("opt_param_scheduler", "content_metadata")})
    # Megatron-LM's scheduler and swift-mcore's since it writes Megatron-LM's layout count
    # samples; older swift-mcore checkpoints, iterations (scheduler_unit 1).
    saved_scheduler = megatron_lm.scheduler_in_iterations(common.get("opt_param_scheduler"),
                                                         record.scheduler_unit)
    if saved_scheduler is None:
        raise CheckpointError(f"checkpoint {folder} holds no LR scheduler state (a weights-only "
                              f"checkpoint): start from it with --load PATH --finetune")
    differences = list(plan.differences) + compat.scheduler_differences(
        saved_scheduler, scheduler.state_dict())
    if differences and not c.override_resume_check:
        raise CheckpointError(compat.refusal(folder, differences))
    load_optim, load_rng = not c.no_load_optim, not c.no_load_rng

    verify(folder)
    # A checkpoint saved before the first optimizer step holds no optimizer state: the
    # fresh optimizer is then exactly what was saved.
    stepped = load_optim and record.optimizer_stepped
    state_dict = io.sharded_state_dict(model, optimizer, with_optimizer=stepped,
                                       is_loading=True,
                                       metadata=common.get("content_metadata"))
    check_shapes(folder, state_dict)
    loaded = _load(state_dict, folder)
    io.restore_model(model, loaded)
    comm.raise_if_any(finite.model_problem(model, folder))
    restored = ["model"]
    if stepped:
        optimizer.load_state_dict(io.conform_optimizer_state(loaded["optimizer"], optimizer))
    else:
        # bf16/fp16 (and the distributed optimizer's shards) keep fp32 main copies of the
        # weights made when the optimizer was built: without this its first step would
        # write them (the initial weights) back over the checkpoint's (Megatron-LM's
        # load_checkpoint reloads them too)
        optimizer.reload_model_params()
    if load_optim:
        restored.append("optimizer" if stepped else "optimizer (not yet stepped: empty)")
    _restore_scheduler(scheduler, saved_scheduler, c.override_resume_check)
    restored.append(f"LR scheduler (step {scheduler.num_steps}, "
                    f"lr {optimizer.param_groups[0]['lr']:.6g})")
    if c.override_resume_check and load_optim:
        _apply_current_optimizer_settings(config, optimizer)

    rng_restored, rng_note = False, ""
    if load_rng and foreign:
        rng_restored, rng_note = _restore_megatron_lm_rng(folder, record.layout, config.cuda)
        if rng_restored:
            restored.append("RNG")
    elif load_rng:
        rng_restored, rng_note = _restore_rng(folder, record.rng_layouts, config.cuda)
        if rng_restored:
            restored.append("RNG")
    state = dataclasses.replace(record.train_state)  # the trainer's own, to advance

    for line in differences:
        log(f"--override_resume_check: resuming although {line}")
    kind = " (a Megatron-LM checkpoint)" if foreign else ""
    log(f"resumed from {folder}{kind}: iteration {state.iteration}, "
        f"{state.consumed_train_samples} train samples and "
        f"{state.consumed_valid_samples} validation samples consumed; restored "
        f"{', '.join(restored)}")
    if not load_optim:
        log("--no_load_optim: optimizer state NOT restored (Adam moments and step count "
            "start from zero); model weights, LR schedule, RNG and counters were restored")
    if not load_rng:
        log("--no_load_rng: RNG states NOT restored (python, numpy, torch, CUDA and "
            "megatron's tracker keep the fresh --seed state; dropout draws differ from the "
            "uninterrupted run)")
    elif not rng_restored:
        log(f"RNG states NOT restored: {rng_note}")
    elif rng_note:
        log(f"RNG states: {rng_note}")
    if foreign:
        log("NOT checked against the Megatron-LM checkpoint: the training data (it records "
            "no data fingerprint; give the same data, --split and --seed, and --data_order "
            "megatron for Megatron-LM's sample order)")
    _log_layout_change(record.layout, log, optimizer=stepped)
    return state, record.id


def load_weights(folder: str, model) -> None:
    """Collective: the model weights of checkpoint ``folder`` into ``model`` (a list of
    chunks, DDP-wrapped or not): checksums verified, shapes checked, then loaded with
    resharding to this run's layout. Raises CheckpointError naming what does not fit."""
    verify(folder)
    state_dict = io.sharded_state_dict(model, None, with_optimizer=False, is_loading=True)
    check_shapes(folder, state_dict)
    io.restore_model(model, _load(state_dict, folder))
    comm.raise_if_any(finite.model_problem(model, folder))


def read_run_flags(folder: str) -> Dict[str, Dict[str, Any]]:
    """The flags a checkpoint was trained with (args.json), grouped by concern."""
    return files.read_json(folder, files.ARGS)


def _read_record(folder: str, config, data_fingerprint
                 ) -> Tuple[CheckpointRecord, List[str]]:
    """Rank 0: what the checkpoint records, and the resume check's findings."""
    if megatron_lm.is_megatron_lm(folder):
        return _read_megatron_lm_record(folder, config)
    manifest, problem = commit.read_manifest(folder)
    if problem:
        raise CheckpointError(f"checkpoint {folder} cannot be used: {problem}")
    run = files.read_json(folder, files.RUN)
    saved_flags = files.read_json(folder, files.ARGS)
    contents = run.get("contents", {})
    record = CheckpointRecord(
        train_state=files.read_train_state(folder), id=manifest.get("id"), megatron_lm=False,
        has_optimizer=bool(contents.get("optimizer")),
        # checkpoints from before this entry existed were saved after a step
        optimizer_stepped=bool(contents.get("optimizer_stepped", True)),
        has_rng=bool(contents.get("rng")),
        # before scheduler_unit existed, common.pt's scheduler counted iterations
        scheduler_unit=int(run.get("scheduler_unit", 1)),
        layout=dict(run.get("layout", {})),
        rng_layouts={int(r): lay for r, lay in run.get("rng_layouts", {}).items()},
        optimizer_format=str(contents.get("optimizer_format", "plain")))
    differences = compat.resume_differences(
        saved_flags, config.to_dict(), run.get("data_fingerprint"), data_fingerprint)
    if differences and config.data.streaming:  # the stream's files that changed, by name
        from ..data.streaming import changed_files

        differences += changed_files(record.train_state.data_stream, config.dataset_sources)
    differences += compat.base_model_differences(
        run.get("base_model"), config.base_model, config.model.model)
    carried.inherit(run.get("multimodal_source"), config.model.model)
    return record, differences


def _read_megatron_lm_record(folder: str, config) -> Tuple[CheckpointRecord, List[str]]:
    """Rank 0: ``_read_record`` of a Megatron-LM checkpoint, from its common.pt and .metadata."""
    common = megatron_lm.read(folder)
    refusals = megatron_lm.resume_refusals(folder, common)
    if refusals:
        raise CheckpointError(f"checkpoint {folder} (Megatron-LM) cannot be resumed: "
                              f"{'; '.join(refusals)}. Start from its weights with --load "
                              f"PATH --finetune")
    args = common["args"]
    flags = megatron_lm.run_flags(args)
    stepped = any(key.startswith("optimizer.state.") for key in io.tensor_shapes(folder))
    record = CheckpointRecord(
        train_state=TrainState.from_dict(megatron_lm.train_state(common)), id=None,
        megatron_lm=True, has_optimizer=stepped, optimizer_stepped=stepped, has_rng=True,
        scheduler_unit=int(args.global_batch_size),
        layout={"tp_size": getattr(args, "tensor_model_parallel_size", None),
                "pp_size": getattr(args, "pipeline_model_parallel_size", None),
                "dp_size": getattr(args, "data_parallel_size", None)})
    # No data fingerprint to compare (restore logs that the data was not checked).
    return record, compat.resume_differences(flags, config.to_dict(), None, None)


def _saved_flags(folder: str) -> Dict[str, Dict[str, Any]]:
    if megatron_lm.is_megatron_lm(folder):
        return megatron_lm.run_flags(megatron_lm.read(folder)["args"])
    return read_run_flags(folder)


def _model_differences(folder: str, config) -> List[str]:
    run = {} if megatron_lm.is_megatron_lm(folder) else files.read_json(folder, files.RUN)
    saved_base = run.get("base_model")
    carried.inherit(run.get("multimodal_source"), config.model.model)
    if saved_base and not config.base_model:
        raise CheckpointError(
            f"--load {folder} holds LoRA adapters, not a whole model: finetune from it with "
            f"--tuner_type lora (and its --model), or merge it first with `swift-mcore export "
            f"--to_hf --merge_lora`")
    if config.base_model and not saved_base:
        raise CheckpointError(
            f"--load {folder} is a full checkpoint; --tuner_type lora takes its frozen base "
            f"from --model (a Hugging Face folder): convert the checkpoint with `swift-mcore "
            f"export --to_hf` and pass that folder as --model")
    return (compat.model_differences(_saved_flags(folder), config.to_dict())
            + compat.base_model_differences(saved_base, config.base_model, config.model.model))


def verify(folder: str) -> None:
    """Checksums of every file; on a mismatch, name the other complete checkpoints. A
    Megatron-LM checkpoint has none: locate checked that its files hold every chunk."""
    if megatron_lm.is_megatron_lm(folder):
        return
    try:
        commit.verify_checksums(folder)
    except CheckpointError as err:
        others = [p for _, p in commit.complete_checkpoints(os.path.dirname(folder))
                  if p != folder]
        hint = (f" Other complete checkpoints: {', '.join(others[-3:])}; pass --resume PATH "
                f"to continue from one of them." if others else "")
        raise CheckpointError(f"{err}.{hint} Nothing was changed on disk.") from None


def check_shapes(folder: str, state_dict) -> None:
    error = None
    try:
        lines = io.shape_mismatches(folder, state_dict)
        if lines:
            error = (f"checkpoint {folder} does not fit this model (different shape or "
                     f"architecture):\n" + "\n".join(f"  {line}" for line in lines))
    except CheckpointError as err:
        error = str(err)
    comm.raise_if_any(error)


def _load(state_dict, folder):
    error, loaded = None, None
    try:
        loaded = io.load(state_dict, folder)
    except CheckpointError as err:  # unsafe or unreadable: io.load named the file
        error = str(err)
    except Exception as err:  # unreadable, unsafe or not matching: one clear error per rank
        error = f"checkpoint {folder} could not be loaded: {type(err).__name__}: {err}"
    comm.raise_if_any(error)
    return loaded


def _restore_scheduler(scheduler, saved: Dict[str, Any], override: bool) -> None:
    """megatron's scheduler takes the checkpoint's schedule; with the override the current
    flags' schedule applies and only the step count is restored."""
    previous = scheduler.override_opt_param_scheduler
    scheduler.override_opt_param_scheduler = bool(override)
    try:
        scheduler.load_state_dict(dict(saved))
    finally:
        scheduler.override_opt_param_scheduler = previous


def _apply_current_optimizer_settings(config, optimizer) -> None:
    t = config.training
    for group in optimizer.param_groups:
        if "betas" in group:
            group["betas"] = (t.adam_beta1, t.adam_beta2)
        if "eps" in group:
            group["eps"] = t.adam_eps


def _restore_rng(folder: str, layouts: Dict[int, Dict[str, int]], cuda: bool
                 ) -> Tuple[bool, str]:
    """Restore this rank's RNG states. Returns (whether every rank restored one, a note
    from the first rank that has one: how its state was chosen, or why it was not)."""
    source, note = rng.choose(layouts, rng.layout())
    error = None
    if source is not None:
        try:
            rng.apply(rng.load(folder, source), cuda)
        except (OSError, ValueError, KeyError, TypeError) as err:
            error = f"checkpoint {folder}: RNG state of rank {source} is unreadable ({err})"
    comm.raise_if_any(error)
    results = comm.all_gather((source is not None, note))
    notes = [n for _, n in results if n]
    return all(ok for ok, _ in results), (notes[0] if notes else "")


def _restore_megatron_lm_rng(folder: str, layout: Dict[str, Any], cuda: bool
                             ) -> Tuple[bool, str]:
    error, result = None, (False, "")
    try:
        result = megatron_lm.restore_rng(folder, layout, cuda)
    except CheckpointError as err:
        error = str(err)
    comm.raise_if_any(error)
    results = comm.all_gather(result)
    return all(ok for ok, _ in results), results[0][1]


def _log_layout_change(saved: Dict[str, Optional[int]], log, optimizer: bool) -> None:
    now = rng.layout()
    pairs = [("tp_size", "TP"), ("pp_size", "PP"), ("dp_size", "DP")]
    if any(saved.get(k) is not None and saved.get(k) != now[k] for k, _ in pairs):
        before = " x ".join(f"{name} {saved.get(k)}" for k, name in pairs)
        after = " x ".join(f"{name} {now[k]}" for k, name in pairs)
        what = "weights and optimizer state were" if optimizer else "weights were"
        log(f"parallel layout changed since the checkpoint ({before} -> {after}): {what} "
            f"resharded; the data position is global and unchanged")
