"""Loads a Hugging Face folder's safetensors weights into this rank's megatron model chunks.

Each rank reads only the slices of its own tensor-parallel shard and pipeline stage
(safetensors memory-maps the files), so a node never holds more than one full copy of the
model: the ranks' shards together. Before any tensor is read, the files' shapes are checked
against transformers' own model for the config, built on the meta device (no memory).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Dict, List, Tuple

import torch

from .finite import nonfinite
from .value_head import is_score_config
from ..errors import ArgumentError
from ..runtime import collectives
from . import mtp
from .convert import Layout, global_name, layer_offset
from .hf_folder import IGNORABLE_SUFFIXES, HFFolder


def expected_hf_shapes(folder: str) -> Dict[str, Tuple[int, ...]]:
    """Every tensor transformers' model for ``folder``'s config.json has, with its shape
    (built on the meta device: no memory)."""
    import warnings

    from accelerate import init_empty_weights
    from transformers import (AutoConfig, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    from .families import for_config

    raw = HFFolder(folder).config
    family = for_config(raw, os.path.join(folder, "config.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if raw.get("model_type") in family.model_types[1:]:
            # another name for the family's architecture (kimi_k2: DeepSeek-V3), which
            # transformers knows only by the first
            hf_config = AutoConfig.for_model(family.model_types[0], **{
                k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
        else:
            hf_config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                                   trust_remote_code=False)
        head = AutoModelForSequenceClassification if is_score_config(raw) \
            else AutoModelForCausalLM
        with init_empty_weights():
            if getattr(hf_config, "vision_config", None) is not None:
                from transformers import AutoModelForImageTextToText

                model = AutoModelForImageTextToText.from_config(hf_config)
            else:
                model = head.from_config(hf_config)
    shapes = {_file_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _file_name(name: str) -> str:
    """A vision-language model's tensor as the Hub's files name it: transformers 5 holds
    the language model under model.language_model and the tower under model.visual."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def check_shapes(folder: HFFolder, layout: Layout, limit: int = 8) -> None:
    """Raise ArgumentError naming file and key for every tensor that is missing, has a shape
    other than config.json implies, or is not used by the model."""
    expected = expected_hf_shapes(folder.path)
    ours = dict(layout.hf_tensors(mtp_layers=False))  # transformers builds no MTP layers
    if layout.experts is not None:
        # transformers 5 holds each layer's experts fused in memory (experts.gate_up_proj)
        # and reads and writes them per expert on disk, as the Hub's files are: the files
        # are checked against our per-expert layout, which must hold as many numbers.
        count = sum(math.prod(shape) for shape in expected.values())
        if count != sum(math.prod(shape) for shape in ours.values()):
            raise AssertionError(f"swift-mcore's layout of {folder.config_path} holds "
                                 f"{sum(math.prod(s) for s in ours.values())} numbers, "
                                 f"transformers' model {count}")
        expected = ours
    if set(ours) != set(expected):  # a family/mapping bug, not bad input
        raise AssertionError(f"swift-mcore's layout and transformers disagree on the tensors "
                             f"of {folder.config_path}: only ours "
                             f"{sorted(set(ours) - set(expected))[:4]}, only transformers' "
                             f"{sorted(set(expected) - set(ours))[:4]}")
    from . import mxfp4

    expected.update(layout.mtp_hf_tensors())
    found = folder.shapes()
    if mxfp4.is_mxfp4(folder.config):  # the experts' blocks and scales, as read dequantized
        found = mxfp4.quantized_shapes(found)
    if not layout.mtp_layers:  # --mtp_num_layers 0: the folder's MTP layers left out
        from .families import for_config

        held = mtp.folder_layers(for_config(folder.config, folder.config_path), folder)
        first = layout.num_layers
        found = {name: value for name, value in found.items()
                 if not any(name.startswith(f"model.layers.{i}.")
                            for i in range(first, first + held))}
    problems: List[str] = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{name}: missing from the weights")
        elif found[name][0] != shape:
            problems.append(f"{os.path.basename(found[name][1])}: {name} has shape "
                            f"{list(found[name][0])}, config.json implies {list(shape)}")
    tied_head = "lm_head.weight" if layout.tied else None
    for name in sorted(set(found) - set(expected)):
        if name.endswith(IGNORABLE_SUFFIXES) or name == tied_head:
            continue
        problems.append(f"{os.path.basename(found[name][1])}: {name} is not part of this "
                        f"model (config.json describes no such tensor)")
    if problems:
        shown = problems[:limit] + ([f"... and {len(problems) - limit} more"]
                                    if len(problems) > limit else [])
        raise ArgumentError(f"--model {folder.path}: the weights do not fit "
                            f"{folder.config_path}:\n" + "\n".join(f"  {p}" for p in shown))


def load_hf_weights(config, model_chunks, log: Callable[[str], None] = print) -> int:
    """Copy --model's weights into this rank's chunks (DDP-wrapped or not). Every parameter
    must be filled. Returns the number of parameters this rank loaded."""
    from megatron.core import parallel_state

    from ..runtime.ddp import unwrap

    start = time.time()
    from .families import for_config

    folder = HFFolder(config.model.model, flag="--model")
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    fresh_head = bool(layout.score) and not is_score_config(folder.config)
    if fresh_head:  # a reward model from a causal LM: its body; the new head stays as drawn
        layout = dataclasses.replace(layout, score=0)
    # MTP layers the folder does not hold (a family without, or a folder without them)
    # start from their initialization; a folder's own are loaded (mtp.check_flag)
    fresh_mtp = layout.mtp_layers and not mtp.folder_layers(
        for_config(folder.config, folder.config_path), folder)
    if fresh_mtp:
        layout = dataclasses.replace(layout, mtp_layers=0)
    check_shapes(folder, layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    expert_tp = (parallel_state.get_expert_tensor_parallel_rank(),
                 parallel_state.get_expert_tensor_parallel_world_size())
    loaded, problems = 0, []
    with folder.reader() as reader, torch.no_grad():
        from . import mxfp4

        quantized = mxfp4.is_mxfp4(folder.config)

        def read(name, rows=None, cols=None):
            if quantized and name not in folder.weight_map and cols is None \
                    and name + mxfp4.BLOCKS in folder.weight_map:
                try:
                    value = mxfp4.read_dequantized(reader.read, name, rows)
                except ValueError as err:  # blocks or scales of another dtype
                    raise ArgumentError(f"--model {folder.weight_map[name + mxfp4.BLOCKS]}: "
                                        f"{name}: {err}") from None
            else:
                value = reader.read(name, rows, cols)
            bad = not problems and nonfinite(value)
            if bad:  # this rank's slice: the ranks agree below
                problems.append(f"--model {folder.weight_map[name]}: the weights are not "
                                f"finite ({name} holds {bad}); nothing was trained or written")
            return value

        for chunk in model_chunks:
            module = unwrap(chunk)
            offset = layer_offset(module)
            # the router's expert bias is a buffer (moved by the balancing, not by gradients)
            bias = [(n, b) for n, b in module.named_buffers() if n.endswith(".expert_bias")]
            for local, param in [*module.named_parameters(), *bias]:
                if fresh_mtp and local.startswith("mtp."):
                    continue
                name = global_name(local, offset)
                if fresh_head and name == "output_layer.weight":
                    continue
                value = layout.to_mcore(name, read, tp_rank, tp_size, ep_rank, ep_size,
                                        expert_tp)
                if tuple(value.shape) != tuple(param.shape):
                    raise AssertionError(f"{name}: converted shape {list(value.shape)}, "
                                         f"model shape {list(param.shape)}")
                param.data.copy_(value)
                loaded += param.numel()
        if layout.mtp_layers:  # the folder's MTP copies of the embedding and output layer
            mtp.check_copies(layout, reader.read, f"--model {folder.path}")
    collectives.raise_if_any(problems[0] if problems else None)
    if fresh_mtp:
        log(f"--mtp_num_layers {config.model.mtp_num_layers}: {folder.path} holds no MTP "
            f"layers; they start from their initialization")
    log(f"loaded Hugging Face weights from {folder.path} ({len(folder.files)} file(s), "
        f"{loaded / 1e6:.2f}M parameters on this rank) in {time.time() - start:.1f}s")
    return loaded
