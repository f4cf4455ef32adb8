"""Writes a Hugging Face model folder: config.json, sharded model-0000x-of-0000y.safetensors
with their index, tokenizer files (and generation_config.json when the source had one).

Tensors are converted and written one shard at a time, so the writer holds the megatron
model plus at most one shard. The folder appears complete or not at all (written under a
new temporary folder, then renamed); a write that fails (a full disk) removes that folder
and leaves the output as it was. The output is a new folder or one an export wrote before
(config.json and safetensors), never a link, a file or any other folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import ArgumentError, OutputError
from .convert import Layout

INDEX = "model.safetensors.index.json"
# A vision-language folder's processor files, copied from the folder the model came from.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
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


# tensors transformers keeps in float32 whatever the model's dtype (its
# _keep_in_fp32_modules_strict), as the Hub's DeepSeek-V3 and GLM-4.5 files hold them;
# megatron's router keeps the expert bias in float32 too
FLOAT32_SUFFIXES = (".e_score_correction_bias",)


def _dtype_of(name: str, dtype: torch.dtype, float32: frozenset = frozenset()) -> torch.dtype:
    """``float32``: the tensors the source folder holds in float32 in a folder of a lower
    dtype (the Hub's Qwen3.5 files: each delta net's A_log and norm), written so again."""
    return torch.float32 if name.endswith(FLOAT32_SUFFIXES) or name in float32 else dtype


def save_hf_folder(out_dir: str, model_args, layout: Layout, get: Callable[[str], torch.Tensor],
                   tokenizer: Optional[Any], dtype: torch.dtype, base_folder: Optional[str] = None,
                   max_shard_bytes: int = 5 * 10**9, carry: bool = True) -> Dict[str, Any]:
    """Write the folder. ``get(name)`` returns a full (TP=1) megatron tensor by global name;
    ``base_folder`` is the Hugging Face folder the model came from, whose config keys
    swift-mcore does not model (token ids, ...) and generation_config.json are kept. Without
    ``carry``, the language model of a multimodal ``base_folder`` is written alone (its
    text_config's keys kept, the vision side and its processor files left out)."""
    from . import families
    from ..input_files import load_json
    from .hf_folder import CONFIG, is_hf_folder

    family = families.for_model_args(model_args)
    base = None
    if base_folder and is_hf_folder(base_folder):  # regular files only, bounded JSON
        base = load_json(os.path.join(base_folder, CONFIG))
    generation = os.path.join(base_folder or "", "generation_config.json")
    if base_folder and os.path.lexists(generation):  # before anything is written: a regular
        load_json(generation)                        # file of bounded JSON
    from . import text_part

    if base is not None and not carry and text_part.is_multimodal(base):
        base = text_part.language_config(base)
    processor_files = PROCESSOR_FILES if carry else ()
    for name in processor_files:  # a vision-language model's image processor: likewise
        if base_folder and os.path.lexists(os.path.join(base_folder, name)):
            load_json(os.path.join(base_folder, name))

    float32: frozenset = frozenset()
    if base is not None and dtype != torch.float32:
        from .hf_folder import HFFolder

        float32 = HFFolder(base_folder, flag="the source folder").float32_names()
    part = None
    if base is not None and text_part.is_multimodal(base) and \
            families.for_config(base, os.path.join(base_folder, CONFIG)) is family:
        # the language model of a multimodal folder: the rest is copied from it unchanged
        from .hf_folder import HFFolder

        source = HFFolder(base_folder, flag="the source folder")
        part = (text_part.part_of(source), source)
        config = text_part.multimodal_config(base, family.hf_config(
            model_args, layout.vocab, text_part.language_config(base)))
    else:
        config = family.hf_config(model_args, layout.vocab, base)
    if base is None and tokenizer is not None:
        config.update(eos_token_id=tokenizer.eod, bos_token_id=_bos_id(tokenizer))
    if getattr(model_args, "num_labels", None) and tokenizer is not None:
        from .value_head import pad_id_of

        # transformers reads a score at the last token that is not pad_token_id: the pad
        # token the reward model trained with (models/value_head.py)
        config["pad_token_id"] = pad_id_of(tokenizer)
    config["dtype"] = next(k for k, v in DTYPES.items() if v == dtype)

    out_dir = os.path.abspath(out_dir)
    check_output_folder(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f"{os.path.basename(out_dir)}.tmp-",
                               dir=os.path.dirname(out_dir))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # as os.makedirs would (mkdtemp's is 0o700)
    try:
        result = _write_folder(staging, out_dir, family, config, layout, get, tokenizer,
                               dtype, base_folder, max_shard_bytes, part, processor_files,
                               float32)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if is_full_disk(err):
            raise OutputError(f"writing {out_dir} failed: out of disk space ({_cause(err)}); "
                              f"the partial folder was removed and {out_dir} is as it was. "
                              f"Free some space, then run it again") from None
        raise
    _replace_folder(staging, out_dir)
    return result


def check_output_folder(out_dir: str, flag: str = "--output_dir") -> None:
    """ArgumentError unless ``out_dir`` may be written: missing, an empty folder, or a
    Hugging Face folder (config.json and safetensors) an export wrote before."""
    from .hf_folder import is_hf_folder

    path = os.path.abspath(os.path.expanduser(out_dir))
    if os.path.islink(path):
        raise ArgumentError(f"{flag} {out_dir} is a symbolic link; give the folder itself "
                            f"(an export never writes through a link)")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ArgumentError(f"{flag} {out_dir} is a file; give a folder to write the Hugging "
                            f"Face model into (a new one, or one an export wrote)")
    names = os.listdir(path)
    if names and not (is_hf_folder(path) and any(n.endswith(".safetensors") for n in names)):
        raise ArgumentError(f"{flag} {out_dir} is a folder that holds other files (not a "
                            f"Hugging Face model folder an export wrote): an export replaces "
                            f"only such a folder; choose a new --output_dir")


def is_full_disk(err: BaseException) -> bool:
    """ENOSPC/EDQUOT, also as safetensors' Rust error (which is no OSError)."""
    import errno

    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(err)
    return "No space left on device" in text or "StorageFull" in text or \
        "Disk quota exceeded" in text


def _cause(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return "No space left on device"


def _replace_folder(staging: str, out_dir: str) -> None:
    """``staging`` renamed to ``out_dir``; an older folder there is moved aside first and
    removed after (a reader never sees a half-replaced folder)."""
    old = None
    if os.path.isdir(out_dir) and not os.path.islink(out_dir):
        old = tempfile.mkdtemp(prefix=f"{os.path.basename(out_dir)}.old-",
                               dir=os.path.dirname(out_dir))
        os.replace(out_dir, os.path.join(old, "folder"))
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_folder(staging: str, out_dir: str, family, config, layout: Layout, get, tokenizer,
                  dtype: torch.dtype, base_folder: Optional[str], max_shard_bytes: int,
                  part=None, processor_files=PROCESSOR_FILES,
                  float32: frozenset = frozenset()) -> Dict[str, Any]:
    """Every file of the folder, into ``staging``. ``part``: (TextPart, source HFFolder) of
    a multimodal source, whose tensors the model does not hold are copied as they are;
    ``float32``: the files' names of tensors written in float32 (_dtype_of)."""
    import contextlib

    from safetensors.torch import save_file

    _write_config(staging, config.get("model_type") if part else family.model_types[0],
                  config)
    tensors_of = layout.hf_tensors()
    text_names: Dict[str, str] = {name: name for name, _ in tensors_of}
    if part is not None:
        from .text_part import carried

        text_names = {part[0].file_name(name): name for name, _ in tensors_of}
        tensors_of = [(part[0].file_name(name), shape) for name, shape in tensors_of] + \
            carried(part[1], part[0])
    plan = plan_shards(tensors_of, torch.tensor([], dtype=dtype).element_size(),
                       max_shard_bytes)
    weight_map: Dict[str, str] = {}
    total = 0
    with (part[1].reader() if part else contextlib.nullcontext()) as source:
        for number, names in enumerate(plan, start=1):
            filename = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
            tensors = {name: layout.to_hf(text_names[name], get).detach().to(
                       "cpu", _dtype_of(name, dtype, float32)).contiguous() if name in text_names
                       else source.read(name).contiguous()  # carried: as the source has it
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
    generation = os.path.join(base_folder or "", "generation_config.json")
    if base_folder and os.path.lexists(generation):  # checked regular by save_hf_folder
        shutil.copy2(generation, staging)
    for name in processor_files:  # checked regular by save_hf_folder
        if base_folder and os.path.lexists(os.path.join(base_folder, name)):
            shutil.copy2(os.path.join(base_folder, name), staging)
    return {"path": out_dir, "family": family.name, "shards": len(plan), "bytes": total,
            "tensors": len(weight_map)}


def _write_config(folder: str, model_type: str, config: Dict[str, Any]) -> None:
    """Through transformers' own config class, so the file is what from_pretrained expects."""
    import warnings

    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = AutoConfig.for_model(model_type, **fields)
    hf_config.save_pretrained(folder)


def _bos_id(tokenizer) -> Optional[int]:
    try:
        return tokenizer.hf.bos_token_id
    except Exception:  # a bare tokenizers backend without transformers metadata
        return None
