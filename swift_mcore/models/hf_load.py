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
from ..runtime import collectives, cpu
from . import mtp
from .convert import Layout, global_name, layer_offset
from .hf_folder import IGNORABLE_SUFFIXES, HFFolder


def expected_hf_shapes(folder: str) -> Dict[str, Tuple[int, ...]]:
    """Every tensor transformers' model for ``folder``'s config.json has, with its shape
    (built on the meta device: no memory)."""
    import warnings

    from .families import for_config

    raw = HFFolder(folder).config
    family = for_config(raw, os.path.join(folder, "config.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf_config, model = _meta_model(folder, raw, family)
        except Exception as err:  # a config.json value transformers' own model cannot take
            raise ArgumentError(f"--model {folder}: transformers cannot build the model "
                                f"{os.path.join(folder, 'config.json')} describes "
                                f"({type(err).__name__}: {err})") from None
    from .vision import NESTED_NAMES

    nested = raw.get("model_type") in NESTED_NAMES  # the files use the names in memory
    shapes = {(k if nested else _file_name(k)): tuple(v.shape)
              for k, v in model.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def _meta_model(folder: str, raw: dict, family):
    """(transformers' config, its model on the meta device) for ``folder``."""
    from accelerate import init_empty_weights
    from transformers import (AutoConfig, AutoModelForCausalLM,
                              AutoModelForSequenceClassification)

    from .text_part import is_multimodal

    if raw.get("model_type") in family.model_types[1:] and not is_multimodal(raw):
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

            return hf_config, AutoModelForImageTextToText.from_config(hf_config)
        return hf_config, head.from_config(hf_config)


def _is_language(name: str) -> bool:
    """Whether a multimodal model's tensor (named as _file_name does) is its language
    model's."""
    return name == "lm_head.weight" or (name.startswith("model.") and not name.startswith(
        ("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")))


def _file_name(name: str) -> str:
    """A vision-language model's tensor as the Hub's files name it: transformers 5 holds
    the language model under model.language_model and the tower under model.visual."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


STACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def check_shapes(folder: HFFolder, layout: Layout, limit: int = 8) -> None:
    """Raise ArgumentError naming file and key for every tensor that is missing, has a shape
    other than config.json implies, or is not used by the model."""
    from .text_part import TextView

    expected = expected_hf_shapes(folder.path)
    ours = dict(layout.hf_tensors(mtp_layers=False))  # transformers builds no MTP layers
    if isinstance(folder, TextView):  # the language model of a multimodal folder
        expected = {name: shape for name, shape in expected.items()
                    if name in ours or _is_language(name)}
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

        family = for_config(folder.config, folder.config_path)
        held = mtp.folder_layers(family, folder)
        first = layout.num_layers
        found = {name: value for name, value in found.items()
                 if not (held and mtp.prefixed(family.name) and name.startswith("mtp."))
                 and not any(name.startswith(f"model.layers.{i}.")
                             for i in range(first, first + held))}
    problems: List[str] = []
    stacked = layout.experts is not None and layout.experts.names == "stacked"
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"{name}: missing from the weights")
        elif stacked and name.endswith(STACKED_EXPERTS) and len(shape) == 3 \
                and found[name][0] == (shape[0], shape[2], shape[1]):
            continue  # transformers' own layout of the experts (Experts.fused_to_mcore)
        elif found[name][0] != shape:
            problems.append(f"{os.path.basename(found[name][1])}: {name} has shape "
                            f"{list(found[name][0])}, config.json implies {list(shape)}")
    tied_head = "lm_head.weight" if layout.tied else None
    for name in sorted(set(found) - set(expected)):
        if name.endswith(IGNORABLE_SUFFIXES) or name == tied_head:
            continue
        if 0 in found[name][0]:  # no numbers (transformers' n_shared_experts 0 expert)
            continue
        problems.append(f"{os.path.basename(found[name][1])}: {name} is not part of this "
                        f"model (config.json describes no such tensor)")
    if problems:
        shown = problems[:limit] + ([f"... and {len(problems) - limit} more"]
                                    if len(problems) > limit else [])
        raise ArgumentError(f"--model {folder.path}: the weights do not fit "
                            f"{folder.config_path}:\n" + "\n".join(f"  {p}" for p in shown))


# The embedding and the LM head are a model's largest tensors (DeepSeek-V3's: 1.8 GB each in
# bf16); read whole, each would sit in memory once more beside its parameter.
VOCAB_CHUNK_BYTES = 8 * 2**20
# The buffers a tensor is read through are freed, but glibc keeps their pages resident: they
# are handed back (runtime/cpu's after_weights_read) every this many bytes loaded.
RELEASE_BYTES = 64 * 2**20


def copy_vocab_rows(param, source, read) -> None:
    """Fill a vocabulary parameter (this rank's rows of the padded vocabulary) from the HF
    tensor named in ``source`` (name, start, stop: Layout.vocab_source) a few rows at a
    time; the rows past the vocabulary are zero."""
    hf_name, start, stop = source
    rows = param.data
    step = max(1, VOCAB_CHUNK_BYTES // max(1, rows[0].numel() * rows.element_size()))
    for first in range(start, stop, step):
        last = min(first + step, stop)
        piece = read(hf_name, rows=slice(first, last))
        if tuple(piece.shape) != (last - first, rows.shape[1]):
            raise AssertionError(f"{hf_name}: rows {first}:{last} read as {list(piece.shape)}, "
                                 f"model rows of width {rows.shape[1]}")
        rows[first - start:last - start].copy_(piece)
    rows[stop - start:].zero_()


def check_tied_head(layout: Layout, read, folder: HFFolder, rows_per_read: int = 4096) -> None:
    """ArgumentError unless a tied model's folder that holds lm_head.weight holds the
    embedding there (read in row blocks): transformers unties a head that differs."""
    for start in range(0, layout.vocab, rows_per_read):
        rows = slice(start, min(start + rows_per_read, layout.vocab))
        if not torch.equal(read("lm_head.weight", rows=rows),
                           read("model.embed_tokens.weight", rows=rows)):
            raise ArgumentError(
                f"--model {folder.weight_map['lm_head.weight']}: lm_head.weight differs from "
                f"model.embed_tokens.weight, but {folder.config_path} says "
                f"tie_word_embeddings true (transformers then unties them; swift-mcore would "
                f"use the embedding): set tie_word_embeddings false to keep the head")


def load_hf_weights(config, model_chunks, log: Callable[[str], None] = print) -> int:
    """Copy --model's weights into this rank's chunks (DDP-wrapped or not). Every parameter
    must be filled. Returns the number of parameters this rank loaded."""
    from megatron.core import parallel_state

    from ..runtime.ddp import unwrap

    start = time.time()
    from .families import for_config

    from .text_part import open_folder

    folder = open_folder(config.model.model, flag="--model")  # a multimodal one: its text
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
    loaded, problems, unreleased = 0, [], 0
    with folder.reader() as reader, torch.no_grad():
        from . import mxfp4

        quantized = mxfp4.is_mxfp4(folder.config)
        if layout.tied and "lm_head.weight" in folder.weight_map:
            check_tied_head(layout, reader.read, folder)

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
                vocab = layout.vocab_source(name, tp_rank, tp_size)
                if vocab is not None:
                    copy_vocab_rows(param, vocab, read)
                    loaded += param.numel()
                    cpu.after_weights_read(config)
                    continue
                value = layout.to_mcore(name, read, tp_rank, tp_size, ep_rank, ep_size,
                                        expert_tp)
                if tuple(value.shape) != tuple(param.shape):
                    raise AssertionError(f"{name}: converted shape {list(value.shape)}, "
                                         f"model shape {list(param.shape)}")
                param.data.copy_(value)
                loaded += param.numel()
                unreleased += param.numel() * param.element_size()
                if unreleased >= RELEASE_BYTES:
                    cpu.after_weights_read(config)
                    unreleased = 0
        if layout.mtp_layers:  # the folder's MTP copies of the embedding and output layer
            mtp.check_copies(layout, reader.read, f"--model {folder.path}")
    collectives.raise_if_any(problems[0] if problems else None)
    if fresh_mtp:
        log(f"--mtp_num_layers {config.model.mtp_num_layers}: {folder.path} holds no MTP "
            f"layers; they start from their initialization")
    log(f"loaded Hugging Face weights from {folder.path} ({len(folder.files)} file(s), "
        f"{loaded / 1e6:.2f}M parameters on this rank) in {time.time() - start:.1f}s")
    return loaded
