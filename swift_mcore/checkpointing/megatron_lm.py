"""Checkpoints written by Megatron-LM (or ms-swift, which saves through it): recognising one,
checking it is whole, and reading its args, counters and scheduler as swift-mcore's.

Megatron-LM's torch_dist ``save_checkpoint`` writes ``iter_NNNNNNN/`` with megatron's
dist_checkpointing files only (``metadata.json``, ``.metadata``, ``__*_*.distcp``, ``common.pt``)
and the same latest-iteration file as swift-mcore. It has no manifest: such a folder is a foreign
checkpoint, not a half-finished swift-mcore save (a swift-mcore save becomes an ``iter_`` folder
only once its manifest is sealed). Its facts live in ``common.pt``: ``iteration``,
``num_floating_point_operations_so_far``, ``opt_param_scheduler`` (counted in samples) and ``args``,
the run's ``argparse.Namespace`` (the consumed sample counters and every flag), read with
safe_load's common.pt allow-list; its RNG states are the sharded ``rng_state`` object
(``restore_rng``). """

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ..errors import CheckpointError
from ..input_files import first_not_regular

# Only a swift-mcore save writes these into an iter_ folder (ms-swift keeps an args.json of
# its own, so that name alone does not make a folder swift-mcore's).
OWN_FILES = ("manifest.json", "train_state.json")
DCP_FILES = ("metadata.json", ".metadata", "common.pt")
# Scheduler fields that count steps: Megatron-LM steps its scheduler by the global batch
# size (samples), swift-mcore by 1 (iterations).
STEP_FIELDS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def is_megatron_lm(folder: str) -> bool:
    """A dist_checkpointing folder that no swift-mcore save wrote: megatron's files, neither
    swift-mcore's manifest nor its train state."""
    return (os.path.isdir(folder)
            and os.path.lexists(os.path.join(folder, "metadata.json"))
            and os.path.lexists(os.path.join(folder, "common.pt"))
            and not any(os.path.exists(os.path.join(folder, name)) for name in OWN_FILES))


def problem(folder: str) -> Optional[str]:
    """None if the Megatron-LM checkpoint ``folder`` is whole: every chunk torch DCP's
    ``.metadata`` records lies inside its ``.distcp`` file (there is no manifest with
    checksums to verify); else what is wrong, for 'is not a usable checkpoint: ...'."""
    from .safe_load import read_dcp_metadata

    for name in DCP_FILES:
        if not os.path.lexists(os.path.join(folder, name)):
            return f"it is a Megatron-LM checkpoint without {name} (the save did not finish)"
    # stat only: a FIFO or device would block (or never end) whatever opens it next
    not_regular = first_not_regular(folder)
    if not_regular:
        return f"it is a Megatron-LM checkpoint whose {not_regular}"
    try:
        metadata = read_dcp_metadata(folder)  # its data files' names stay inside the folder
    except CheckpointError as err:
        return str(err).replace(f"checkpoint {folder}: ", "")
    ends: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = info.relative_path
        ends[path] = max(ends.get(path, 0), int(info.offset) + int(info.length))
    for path, end in sorted(ends.items()):
        try:
            size = os.path.getsize(os.path.join(folder, path))
        except OSError:
            return f"it is a Megatron-LM checkpoint whose {path} is missing"
        if size < end:
            return (f"it is a Megatron-LM checkpoint whose {path} has {size} bytes, its "
                    f".metadata records data up to byte {end} (truncated?)")
    return None


def read(folder: str) -> Dict[str, Any]:
    """common.pt of a Megatron-LM checkpoint (safely), checked to hold what a resume reads."""
    from . import io

    common = io.read_common(folder)
    args = common.get("args")
    if not hasattr(args, "__dict__") or "num_layers" not in vars(args):
        raise CheckpointError(f"checkpoint {folder}: common.pt holds no Megatron-LM args "
                              f"(neither swift-mcore's files nor Megatron-LM's are there)")
    if not isinstance(common.get("iteration"), int):
        raise CheckpointError(f"checkpoint {folder}: common.pt holds no iteration")
    return common


def _arg(args, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def run_flags(args) -> Dict[str, Dict[str, Any]]:
    """Megatron-LM's args as swift-mcore's flag groups (args.json's shape), for the resume
    and finetune checks. Only flags with the same meaning on both sides; a flag Megatron-LM
    lacks is left out (compat skips it)."""
    heads = _arg(args, "num_attention_heads")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
    model = {
        "num_layers": _arg(args, "num_layers"), "hidden_size": _arg(args, "hidden_size"),
        "ffn_hidden_size": _arg(args, "ffn_hidden_size"), "num_attention_heads": heads,
        "num_query_groups": groups, "kv_channels": _arg(args, "kv_channels"),
        "seq_length": _arg(args, "seq_length"),
        "max_position_embeddings": _arg(args, "max_position_embeddings"),
        "normalization": _arg(args, "normalization"),
        "norm_epsilon": _arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon")),
        "swiglu": _arg(args, "swiglu"),
        "position_embedding_type": _arg(args, "position_embedding_type"),
        "rotary_base": _arg(args, "rotary_base"), "rotary_percent": _arg(args, "rotary_percent"),
        "use_rope_scaling": _arg(args, "use_rope_scaling"),
        "untie_embeddings_and_output_weights": _arg(args, "untie_embeddings_and_output_weights"),
        "add_bias_linear": _arg(args, "add_bias_linear"),
        "add_qkv_bias": _arg(args, "add_qkv_bias"), "qk_layernorm": _arg(args, "qk_layernorm"),
    }
    if heads and model["kv_channels"] == model["hidden_size"] // heads:
        model["kv_channels"] = None  # Megatron-LM fills in the default swift-mcore leaves unset
    if model["use_rope_scaling"]:
        model["rope_scaling_factor"] = _arg(args, "rope_scaling_factor")
    training = {
        "global_batch_size": _arg(args, "global_batch_size"), "seed": _arg(args, "seed"),
        "adam_beta1": _arg(args, "adam_beta1"), "adam_beta2": _arg(args, "adam_beta2"),
        "adam_eps": _arg(args, "adam_eps"), "clip_grad": _arg(args, "clip_grad"),
        "bf16": _arg(args, "bf16"), "fp16": _arg(args, "fp16"),
    }
    drop = lambda group: {k: v for k, v in group.items() if v is not None}  # noqa: E731
    return {"model": drop(model), "training": drop(training)}


def train_state(common: Dict[str, Any]) -> Dict[str, Any]:
    """TrainState data (train_state.json's shape): the iteration and FLOPs are common.pt's
    own keys; the sample counters are the args' (where Megatron-LM's loader reads them)."""
    args = common["args"]
    return {"iteration": int(common["iteration"]),
            "consumed_train_samples": int(_arg(args, "consumed_train_samples", 0) or 0),
            "consumed_valid_samples": int(_arg(args, "consumed_valid_samples", 0) or 0),
            "skipped_train_samples": int(_arg(args, "skipped_train_samples", 0) or 0),
            "floating_point_operations_so_far": float(
                common.get("num_floating_point_operations_so_far") or 0.0)}


def resume_refusals(folder: str, common: Dict[str, Any]) -> List[str]:
    """What keeps a Megatron-LM checkpoint from being resumed by swift-mcore at all."""
    args = common["args"]
    lines = []
    if _arg(args, "rampup_batch_size"):
        lines.append(f"it was trained with --rampup-batch-size {_arg(args, 'rampup_batch_size')}"
                     f" (swift-mcore's iterations all have one global batch size)")
    if _arg(args, "use_distributed_optimizer"):
        lines.append("its optimizer state is in the distributed optimizer's layout, which "
                     "megatron-core reads back only into a distributed optimizer (GPU)")
    return lines


def scheduler_in_iterations(saved: Optional[Dict[str, Any]], global_batch_size: int
                            ) -> Optional[Dict[str, Any]]:
    """Megatron-LM's scheduler state (steps counted in samples) in swift-mcore's units
    (iterations). Every learning rate is unchanged: each depends on a ratio of two step
    counts, both exact multiples of the global batch size."""
    if saved is None:
        return None
    out = dict(saved)
    for name in STEP_FIELDS:
        value = out.get(name)
        if isinstance(value, int) and value % global_batch_size == 0:
            out[name] = value // global_batch_size
        elif isinstance(value, (int, float)):
            out[name] = value / global_batch_size
    return out


def scheduler_in_samples(state: Dict[str, Any], global_batch_size: int) -> Dict[str, Any]:
    """swift-mcore's scheduler state in Megatron-LM's units (what its loader compares)."""
    out = dict(state)
    for name in STEP_FIELDS:
        if isinstance(out.get(name), int):
            out[name] = out[name] * global_batch_size
    return out


# ---- what Megatron-LM's load_checkpoint asks of a swift-mcore checkpoint ------------------
# (its default flags: --ckpt-format torch_dist, RNG and optimizer loaded, no
# --use-checkpoint-args). common.pt: args, checkpoint_version, iteration, optimizer,
# opt_param_scheduler (in samples), num_floating_point_operations_so_far, content_metadata;
# sharded: the model, the optimizer moments, and rng_state.

# The content metadata Megatron-LM writes for a non-distributed optimizer (and reads back to
# rebuild the same sharded keys); swift-mcore saves and loads with it too.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def common_entries(state, scheduler, config) -> Dict[str, Any]:
    """The entries Megatron-LM's loader reads besides the sharded tensors: in common.pt the
    iteration, its ``args`` (checked, and holding the sample counters), the scheduler in its
    units (samples), the FLOPs and the content metadata; and the sharded ``rng_state``.
    swift-mcore reads back only the scheduler and the content metadata of its own
    checkpoints; its counters come from train_state.json, its RNG from rng/."""
    gbs = config.training.global_batch_size
    common = {"iteration": state.iteration, "checkpoint_version": 3.0,
              "args": args_namespace(config, state),
              "opt_param_scheduler": (scheduler_in_samples(scheduler.state_dict(), gbs)
                                      if scheduler is not None else None),
              "num_floating_point_operations_so_far": float(
                  state.floating_point_operations_so_far),
              "content_metadata": dict(CONTENT_METADATA)}
    if not config.checkpoint.no_save_rng:
        common["rng_state"] = sharded_rng_state(config.training.seed, config.cuda)
    return common


def args_namespace(config, state) -> "argparse.Namespace":
    """The ``args`` Megatron-LM's loader reads from common.pt (check_checkpoint_args, the
    sample counters, whether RNG and optimizer were saved) and the run's flags in its
    names. It must be an ``argparse.Namespace`` (the loader reads attributes), so it is
    pickled; every value is a plain int, float, str, bool, None or list of those."""
    import argparse

    from megatron.core import parallel_state as ps

    m, t, lg, c, d = (config.model, config.training, config.logging, config.checkpoint,
                      config.data)
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    values = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=m.kv_channels or m.hidden_size // heads, seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        vocab_size=config.vocab_size, padded_vocab_size=config.padded_vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        tokenizer_type="HuggingFaceTokenizer", vocab_file=None,
        position_embedding_type=m.position_embedding_type,
        # Megatron-LM's flag (True unless --no-position-embedding), whatever the type
        add_position_embedding=m.position_embedding_type != "none",
        rotary_base=m.rotary_base, rotary_percent=m.rotary_percent,
        rotary_interleaved=False, use_rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor, normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon, norm_epsilon=m.norm_epsilon, swiglu=m.swiglu,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,
        qk_layernorm=m.qk_layernorm, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        fp16=bool(t.fp16), bf16=bool(t.bf16),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(), expert_model_parallel_size=1,
        data_parallel_size=ps.get_data_parallel_world_size(),
        world_size=config.world.world_size,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        rampup_batch_size=None, train_iters=t.train_iters, train_samples=None,
        optimizer="adam", use_distributed_optimizer=False, lr=t.lr, min_lr=t.min_lr,
        lr_decay_style=t.lr_decay_style, lr_warmup_iters=t.lr_warmup_iters,
        lr_decay_iters=t.lr_decay_iters or t.train_iters, weight_decay=t.weight_decay,
        start_weight_decay=t.weight_decay, end_weight_decay=t.weight_decay,
        weight_decay_incr_style="constant", adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps, clip_grad=t.clip_grad, seed=t.seed,
        data_parallel_random_init=False, split=d.split,
        eval_interval=lg.eval_steps or None, eval_iters=lg.eval_iters,
        save_interval=c.save_steps,
        consumed_train_samples=int(state.consumed_train_samples),
        skipped_train_samples=int(state.skipped_train_samples),
        consumed_valid_samples=int(state.consumed_valid_samples),
        no_save_optim=bool(c.no_save_optim) or None, no_save_rng=bool(c.no_save_rng) or None,
        ckpt_format="torch_dist", use_dist_ckpt=True,
    )
    return argparse.Namespace(**{k: _plain(k, v) for k, v in values.items()})


def _plain(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(name, v) for v in value]
    raise TypeError(f"Megatron-LM args field {name} would pickle a {type(value).__name__}")


def philox_state(seed: int, offset: int = 0):
    """A CUDA (Philox) generator's state as ``torch.cuda.get_rng_state()`` returns it: the
    seed (uint64) then the offset (int64), little-endian, 16 bytes."""
    import torch

    data = int(seed).to_bytes(8, "little", signed=False) + int(offset).to_bytes(
        8, "little", signed=True)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def rng_state(seed: int, cuda: bool) -> Dict[str, Any]:
    """This rank's RNG states in the dict Megatron-LM's get_rng_state builds. On a GPU the
    CUDA generator's and the tracker's own states; without CUDA none of them exist (no CUDA
    draw ever happened), so they are the states Megatron-LM's seeding gives them:
    seed + 100 x pipeline rank for the generator and 'data-parallel-rng',
    + 2718 + TP rank for 'model-parallel-rng', + 1024 + 100 x EP rank + expert-TP rank for
    'expert-parallel-rng', each at offset 0."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    base = int(seed) + 100 * ps.get_pipeline_model_parallel_rank()
    if cuda and tracker:
        cuda_state = torch.cuda.get_rng_state()
        tracker = {name: state.clone() for name, state in tracker.items()}
    else:
        cuda_state = philox_state(base)
        tracker = {
            "data-parallel-rng": philox_state(base),
            "model-parallel-rng": philox_state(
                base + 2718 + ps.get_tensor_model_parallel_rank()),
            "expert-parallel-rng": philox_state(
                base + 1024 + 100 * ps.get_expert_model_parallel_rank()
                + ps.get_expert_tensor_parallel_rank()),
        }
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda_state,
            "rng_tracker_states": tracker}


def sharded_rng_state(seed: int, cuda: bool):
    """``rng_state`` as Megatron-LM's torch_dist save shards it: one object per (PP, TP)
    position, replicated over the data-parallel ranks (its key in .metadata:
    ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``), holding a one-element list."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", [rng_state(seed, cuda)],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


# ---- Megatron-LM's RNG states into this process -------------------------------------------

def restore_rng(folder: str, layout: Dict[str, Any], cuda: bool) -> tuple:
    """Collective: this rank's states from a Megatron-LM checkpoint's ``rng_state`` (read
    with safe_load's rng_state allow-list). Returns (restored, note). python's, numpy's and
    torch's generators always; the CUDA generator and megatron's tracker only on a GPU (on
    CPU swift-mcore's dropout draws from torch's generator, restored). Not restored when
    the TP/PP sizes differ from the checkpoint's (no saved stream belongs to this rank)."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from . import io

    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    if (layout.get("pp_size"), layout.get("tp_size")) != (pp, tp):
        return False, (f"the tensor/pipeline-parallel sizes changed (checkpoint TP "
                       f"{layout.get('tp_size')} x PP {layout.get('pp_size')}, now TP {tp} x "
                       f"PP {pp}), so no saved stream belongs to this rank")
    request = {"rng_state": ShardedObject(
        "rng_state", None, (pp, tp), (ps.get_pipeline_model_parallel_rank(),
                                      ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))}
    states = io.load(request, folder)["rng_state"]
    # One entry, or one per data-parallel rank with --data-parallel-random-init.
    state = states[ps.get_data_parallel_rank() if len(states) > 1 else 0]
    try:
        random.setstate(tuple(state["random_rng_state"]))
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        restored = ["python", "numpy", "torch"]
        if cuda:
            torch.cuda.set_rng_state(state["cuda_rng_state"])
            tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
            restored += ["CUDA", "megatron tracker"]
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {folder}: rng_state is not Megatron-LM's RNG "
                              f"state ({type(err).__name__}: {err})") from None
    note = (f"{', '.join(restored)} from Megatron-LM's rng_state"
            + ("" if cuda else
               "; its CUDA and tracker streams not (no CUDA: dropout draws from torch's "
               "generator here, restored)"))
    return True, note
