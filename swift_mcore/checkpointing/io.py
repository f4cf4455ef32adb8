"""Model and optimizer through megatron ``dist_checkpointing`` (torch_dist): sharded
state dicts, so a checkpoint saved at one TP/PP/DP layout loads at another."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..runtime.ddp import unwrap
from .safe_load import (load_failure, read_dcp_metadata, safe_common_strategy,
                        safe_loading)


def model_keys(model: List[torch.nn.Module]) -> List[str]:
    """megatron-LM's names: ``model``, or ``model0``, ``model1``... for virtual pipelines."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def model_sharded_state_dict(model, metadata: Optional[dict] = None) -> Dict[str, Any]:
    """Each chunk's sharded tensors; of a LoRA model only what trains (models/lora.py).
    ``metadata``: megatron's content metadata (``sharded_state_dict``)."""
    from ..models.lora import checkpoint_state

    return {key: checkpoint_state(unwrap(chunk), unwrap(chunk).sharded_state_dict(
                metadata=metadata))
            for key, chunk in zip(model_keys(model), model)}


# megatron's reshardable layout of the distributed optimizer's state: each parameter's
# moments and fp32 copy as whole tensors of the parameter's shape (gathered over the
# data-parallel group at a save, sliced again at a load), so a checkpoint saved at one
# data-parallel size loads at another. Recorded in run.json ("optimizer_format").
DISTRIBUTED_OPTIMIZER_FORMAT = "fully_reshardable"


def optimizer_format(distributed: bool) -> str:
    """How the optimizer's state is laid out in a checkpoint: 'plain' (megatron's FP32 or
    mixed-precision optimizer: moments per parameter, what every checkpoint before
    --use_distributed_optimizer holds) or the distributed optimizer's."""
    return f"distributed/{DISTRIBUTED_OPTIMIZER_FORMAT}" if distributed else "plain"


def optimizer_has_state(optimizer) -> bool:
    """Whether any (chained) optimizer holds per-parameter state, i.e. has stepped."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and len(inner.state) > 0:
            return True
    return False


def sharded_state_dict(model, optimizer, with_optimizer: bool, is_loading: bool,
                       metadata: Optional[dict] = None) -> Dict[str, Any]:
    """``metadata``: megatron's content metadata, which decides some sharded keys (the
    checkpoint's own when loading: ``common.pt``'s ``content_metadata``; None before it was
    saved, megatron's defaults then)."""
    state = model_sharded_state_dict(model, metadata)
    if with_optimizer:
        # MoE with expert parallelism chains a second optimizer for the expert parameters;
        # its tensors keep their parameter names (no 'chained_N.' prefix), so one checkpoint
        # loads at any EP (``conform_optimizer_state``). The distributed optimizer's shards
        # are saved per parameter, whole (DISTRIBUTED_OPTIMIZER_FORMAT).
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading,
            metadata={"chained_optim_avoid_prefix": True,
                      "distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT,
                      **(metadata or {})})
    return state


def conform_optimizer_state(loaded: Dict[str, Any], optimizer) -> Any:
    """The optimizer part of a loaded checkpoint in the structure ``optimizer`` expects.

    megatron's optimizer is one FP32Optimizer, or at EP > 1 a ChainedOptimizer of the dense
    and the expert one (state dict {0: ..., 1: ...}). The per-parameter tensors land where
    this optimizer asked for them, whatever EP saved them; the plain entries (param groups,
    the shared step) come from common.pt in the saved structure. When the two structures
    differ, each part gets this optimizer's own param groups (their settings are the
    checked flags; the scheduler sets the learning rate next) and the saved step; so does
    each of the distributed optimizer's parts (``conform_distributed``)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    saved = [loaded] if "param_state_sharding_type" in loaded else [
        loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    if len(saved) == len(chained) and all(
            isinstance(part, dict) and "param_state_sharding_type" in part for part in saved):
        return loaded  # the distributed optimizer's own structure, its groups in 'optimizer'
    if any(isinstance(part, dict) and "param_state_sharding_type" in part for part in saved):
        return conform_distributed(loaded, saved, chained)

    def saved_groups(part) -> bool:  # common.pt's groups carry their settings, not only ids
        groups = part.get("param_groups") if isinstance(part, dict) else None
        return bool(groups) and all(len(group) > 1 for group in groups)

    saved_parts = [loaded] if saved_groups(loaded) else [
        loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    if len(saved_parts) == len(chained) and all(map(saved_groups, saved_parts)):
        return loaded
    steps = [part["state"].get("common_step") for part in saved_parts
             if isinstance(part.get("state"), dict) and "common_step" in part["state"]]
    parts = []
    for index, sub in enumerate(chained):
        part = {k: v for k, v in (loaded if len(chained) == 1 else loaded[index]).items()
                if not isinstance(k, int)}  # the saved structure's other parts
        state = {k: v for k, v in dict(part.get("state", {})).items() if k != "common_step"}
        if steps:
            state["common_step"] = steps[0]
        part["state"] = state
        part["param_groups"] = sub.state_dict()["param_groups"]
        parts.append(part)
    return parts[0] if len(chained) == 1 else dict(enumerate(parts))


def conform_distributed(loaded: Dict[str, Any], saved: List[Dict[str, Any]],
                        chained: List[Any]) -> Any:
    """``conform_optimizer_state`` for the distributed optimizer saved in another chain
    (another EP): each part gets this optimizer's own param groups and grad scaler with the
    saved step, and the per-parameter tensors it asked for (its 'param_state')."""
    steps = [group["step"] for part in saved
             for group in (part.get("optimizer") or {}).get("param_groups", ())
             if "step" in group]
    parts = []
    for index, sub in enumerate(chained):
        own = sub.state_dict()
        if steps:
            for group in own["optimizer"]["param_groups"]:
                group["step"] = steps[0]
        tensors = loaded if len(chained) == 1 else loaded[index]
        parts.append({**own, "param_state": tensors["param_state"],
                      "param_state_sharding_type": DISTRIBUTED_OPTIMIZER_FORMAT})
    return parts[0] if len(chained) == 1 else dict(enumerate(parts))


def read_common(folder: str) -> Dict[str, Any]:
    """common.pt of a checkpoint, read safely (weights_only: plain types and tensors, and
    the Namespace of Megatron-LM's args: safe_load.common_pt_extra)."""
    try:
        common = safe_common_strategy().load_common(folder)
    except CheckpointError:
        raise  # a refused pickle: safe_load named the file and the type
    except Exception as err:
        raise CheckpointError(f"checkpoint {folder}: common.pt cannot be read safely "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:300]})"
                              ) from None
    if not isinstance(common, dict):
        raise CheckpointError(f"checkpoint {folder}: common.pt holds a "
                              f"{type(common).__name__}, not megatron's dict of entries")
    return common


def save(state: Dict[str, Any], folder: str, fully_parallel: bool = False,
         background: bool = False):
    """Collective: write ``state`` (sharded tensors + plain common data) into ``folder``.
    ``fully_parallel`` (RunConfig.fully_parallel_save): the data-parallel replicas share the
    writes (megatron's FullyParallelSaveStrategyWrapper, Megatron-LM's default) instead of
    data-parallel rank 0 writing every replicated shard. ``background`` (--async_save):
    returns megatron's AsyncRequest instead of writing the shards; the caller schedules it
    (a forked process writes them from a copy-on-write image of this moment's tensors) and
    finalizes it on every rank (checkpointing/manager.py)."""
    from megatron.core import dist_checkpointing

    strategy = None
    if fully_parallel:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"),
            parallel_state.get_data_parallel_group(with_context_parallel=True))
    extra = {"async_sharded_save": True} if background else {}
    with _results_queue(forked=background):
        return dist_checkpointing.save(state, folder, sharded_strategy=strategy, **extra)


@contextlib.contextmanager
def _results_queue(forked: bool):
    """A synchronous save collects its writers' results in this process, so a plain queue
    does; a background save's forked writer hands them over a queue made before the fork.
    megatron's default is a ``multiprocessing.Manager`` queue: a *spawned* server process
    that re-imports ``__main__`` and outlives a killed trainer as an orphan."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = (
        multiprocessing.get_context("fork").Queue if forked else queue.Queue)
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = saved


def tensor_shapes(folder: str) -> Dict[str, Tuple[int, ...]]:
    """Global shape of every tensor stored in a torch_dist checkpoint (from .metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(folder)
    return {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def expected_shapes(state: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Global shape of every sharded tensor the current model (and optimizer) will load."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)
    return out


def shape_mismatches(folder: str, state: Dict[str, Any], limit: int = 8) -> List[str]:
    """What keeps ``state`` from loading out of ``folder``: missing tensors and tensors of
    another global shape, one line each (at most ``limit``, then a count)."""
    saved = tensor_shapes(folder)
    wanted = expected_shapes(state)
    lines = []
    for key, shape in sorted(wanted.items()):
        if key not in saved and key.endswith(EXPERT_BIAS):
            continue  # an older LoRA checkpoint's (without_absent_extra_state, restore_model)
        if key not in saved:
            lines.append(f"{key}: not in the checkpoint (model expects shape {list(shape)})")
        elif saved[key] != shape:
            lines.append(f"{key}: checkpoint shape {list(saved[key])}, model {list(shape)}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def load(state: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """Collective: fill ``state``'s sharded tensors from ``folder``, reading every pickled
    part with safe loading. Any failure (a refused pickle, a damaged file) is a one-line
    CheckpointError naming the file, not torch's multi-rank traceback text."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    backend = _backend(folder)
    if backend != "torch_dist":
        raise CheckpointError(f"checkpoint {folder} uses the '{backend}' format; swift-mcore "
                              f"loads torch_dist checkpoints")
    state = without_absent_extra_state(state, folder)
    merge_swiglu_halves_in_place(state)
    try:
        with safe_loading(), warnings.catch_warnings():
            # torch DCP's deprecation notices about ShardedTensor/load_state_dict, on each load
            warnings.simplefilter("ignore", FutureWarning)
            return dist_checkpointing.load(state, folder,
                                           sharded_strategy=TorchDistLoadShardedStrategy(),
                                           common_strategy=safe_common_strategy())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch DCP's CheckpointException is a BaseException
        cause = load_failure(err)
        if isinstance(cause, CheckpointError):
            raise cause from None
        text = (str(cause).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(f"checkpoint {folder} could not be loaded: "
                              f"{type(cause).__name__}: {text}") from None


# megatron-core 0.16.1's merge of a SwiGLU weight's two halves (transformer/mlp.py 334)
SWIGLU_MERGE = "apply_swiglu_sharded_factory.<locals>.sh_ten_merge_fn"


def merge_swiglu_halves_in_place(state: Dict[str, Any]) -> None:
    """megatron loads a SwiGLU ``linear_fc1`` as two halves, views of the parameter filled
    in place, then concatenates them into a new tensor; every fc1 of the model so existed
    twice until ``restore_model`` copied it over (for a mixture of experts, about half the
    weights again at the peak of a load). Where the loaded halves are exactly the
    parameter's two consecutive halves, the concatenation *is* the parameter: it is handed
    back as it is; any other pieces get megatron's own concatenation."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for value in nested_values(state):
        if (isinstance(value, ShardedTensorFactory) and isinstance(value.data, torch.Tensor)
                and getattr(value.merge_fn, "__qualname__", "") == SWIGLU_MERGE):
            value.merge_fn = functools.partial(_merged, value.data, value.merge_fn)


def _merged(data: torch.Tensor, merge, pieces):
    return data if _tile(data, pieces) else merge(pieces)


def _tile(data: torch.Tensor, pieces) -> bool:
    """Whether ``pieces`` are consecutive contiguous views covering ``data`` row by row, in
    order (so that their concatenation equals ``data`` element for element)."""
    if not data.is_contiguous() or not isinstance(pieces, (list, tuple)) or not pieces:
        return False
    address, rows = data.data_ptr(), 0
    for piece in pieces:
        if not (isinstance(piece, torch.Tensor) and piece.dtype == data.dtype
                and piece.device == data.device and piece.is_contiguous()
                and piece.dim() == data.dim() and piece.shape[1:] == data.shape[1:]
                and piece.data_ptr() == address):
            return False
        address += piece.numel() * piece.element_size()
        rows += piece.shape[0]
    return rows == data.shape[0]


def _backend(folder: str) -> Optional[str]:
    import json

    try:
        with open(os.path.join(folder, "metadata.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(f"checkpoint {folder} has no readable metadata.json (not a "
                              f"megatron dist_checkpointing folder)")
    return config.get("sharded_backend")


EXTRA_STATE = "_extra_state"
EXPERT_BIAS = ".router.expert_bias"  # a MoE router's buffer (aux-loss-free balancing)


def saved_extra_states(folder: str) -> set:
    """The ``_extra_state`` objects a torch_dist checkpoint holds, by megatron key (DCP stores
    each as ``KEY/shard_OFFSETS_SHAPE``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder)
    return {key.split("/shard_")[0] for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, BytesStorageMetadata) and EXTRA_STATE in key}


def without_absent_extra_state(state: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """``state`` less the ``_extra_state`` objects ``folder`` does not hold, so that DCP (which
    refuses a key it cannot find) loads the rest. Transformer Engine's modules carry such an
    entry (FP8 metadata; empty without FP8) that megatron's local modules lack: a checkpoint
    saved on CPU, or with the local spec, has none for TE's norms. Those modules keep their
    fresh state; ``restore_model`` accepts exactly these keys as missing. Likewise a LoRA
    checkpoint's routers' expert bias (models/lora.py), which LoRA checkpoints written before
    they kept it lack: the bias stays the base model's, as it was for them."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    saved = held = None

    def keep(value) -> bool:
        nonlocal saved, held
        if isinstance(value, ShardedTensor) and value.key.endswith(EXPERT_BIAS):
            if held is None:
                held = set(read_dcp_metadata(folder).state_dict_metadata)
            return value.key in held
        if not (isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE)):
            return True
        if saved is None:
            saved = saved_extra_states(folder)
        return value.key in saved

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if keep(v)}
        if isinstance(node, list):
            return [walk(v) for v in node if keep(v)]
        return node

    return walk(state)


def restore_model(model, loaded: Dict[str, Any]) -> None:
    """Load each chunk's weights strictly, except that a module's ``_extra_state`` may be
    missing (Transformer Engine's, absent from megatron's sharded state dict for core
    attention, or from a checkpoint saved without TE), and a LoRA model's frozen base
    weights (its checkpoints hold the adapters only; models/lora.py). Any other missing or
    unexpected key is a CheckpointError naming it."""
    from ..models.lora import frozen_keys

    for key, chunk in zip(model_keys(model), model):
        result = unwrap(chunk).load_state_dict(loaded[key], strict=False)
        frozen = frozen_keys(unwrap(chunk))  # a LoRA checkpoint holds no base weights
        missing = [k for k in result.missing_keys
                   if not k.endswith(EXTRA_STATE) and k not in frozen]
        problems = []
        if missing:
            problems.append(f"missing {_listed(missing)}")
        if result.unexpected_keys:
            problems.append(f"unexpected {_listed(result.unexpected_keys)}")
        if problems:
            raise CheckpointError(f"the checkpoint's {key!r} state does not fit this model: "
                                  + "; ".join(problems))


def _listed(keys: List[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
