"""Writes a Hugging Face model folder: config.json, sharded model-0000x-of-0000y.safetensors
with their index, tokenizer files (and generation_config.json when the source had one).

Tensors are converted and written one shard at a time, so the writer holds the megatron
model plus at most one shard. The folder appears complete or not at all (written under a
temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import ArgumentError
from .convert import Layout

INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_shards(tensors: List[Tuple[str, Tuple[int, ...]]], itemsize: int, max_bytes: int
                ) -> List[List[str]]:
    """Consecutive groups of tensors of at most ``max_bytes`` (a larger tensor alone)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf_folder(out_dir: str, model_args, layout: Layout, get: Callable[[str], torch.Tensor],
                   tokenizer: Optional[Any], dtype: torch.dtype, base_folder: Optional[str] = None,
                   max_shard_bytes: int = 5 * 10**9) -> Dict[str, Any]:
    """Write the folder. ``get(name)`` returns a full (TP=1) megatron tensor by global name;
    ``base_folder`` is the Hugging Face folder the model came from, whose config keys
    swift-mcore does not model (token ids, ...) and generation_config.json are kept."""
    from safetensors.torch import save_file

    from . import families
    from ..input_files import load_json
    from .hf_folder import CONFIG, is_hf_folder

    family = families.for_model_args(model_args)
    base = None
    if base_folder and is_hf_folder(base_folder):  # regular files only, bounded JSON
        base = load_json(os.path.join(base_folder, CONFIG))
    generation = os.path.join(base_folder or "", "generation_config.json")
    keep_generation = bool(base_folder) and os.path.lexists(generation)
    if keep_generation:  # before anything is written: a regular file of bounded JSON
        load_json(generation)
    config = family.hf_config(model_args, layout.vocab, base)
    if base is None and tokenizer is not None:
        config.update(eos_token_id=tokenizer.eod, bos_token_id=_bos_id(tokenizer))
    config["dtype"] = next(k for k, v in DTYPES.items() if v == dtype)

    out_dir = os.path.abspath(out_dir)
    staging = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    _write_config(staging, family, config)

    plan = plan_shards(layout.hf_tensors(), torch.tensor([], dtype=dtype).element_size(),
                       max_shard_bytes)
    weight_map: Dict[str, str] = {}
    total = 0
    for number, names in enumerate(plan, start=1):
        filename = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        tensors = {name: layout.to_hf(name, get).detach().to("cpu", dtype).contiguous()
                   for name in names}
        save_file(tensors, os.path.join(staging, filename), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = filename
            total += tensor.numel() * tensor.element_size()
        del tensors
    with open(os.path.join(staging, INDEX), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2,
                  sort_keys=True)
    if tokenizer is not None:  # a weights-only source folder converts to a weights-only one
        tokenizer.save_pretrained(staging)
    if keep_generation:
        shutil.copy2(generation, staging)

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)
    return {"path": out_dir, "family": family.name, "shards": len(plan), "bytes": total,
            "tensors": len(weight_map)}


def _write_config(folder: str, family, config: Dict[str, Any]) -> None:
    """Through transformers' own config class, so the file is what from_pretrained expects."""
    import warnings

    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = AutoConfig.for_model(family.model_types[0], **fields)
    hf_config.save_pretrained(folder)


def _bos_id(tokenizer) -> Optional[int]:
    try:
        return tokenizer.hf.bos_token_id
    except Exception:  # a bare tokenizers backend without transformers metadata
        return None
