"""Flags of `swift-mcore export`: checkpoint <-> Hugging Face folder, and the precision check."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ArgumentError
from .data import trust_remote_code_flag
from .fields import check_flags, flag
from .paths import check_output_dir


@dataclass
class ExportArguments:
    model: Optional[str] = flag(
        None, "What to convert: with --to_hf a swift-mcore checkpoint (an iter_NNNNNNN folder, "
        "the checkpoint folder holding latest_checkpointed_iteration.txt, or a run's "
        "output_dir); with --to_mcore a Hugging Face model folder. Required.")
    output_dir: Optional[str] = flag(
        None, "Where to write: the Hugging Face folder (--to_hf), or the run folder whose "
        "checkpoint/ receives iter_0000000 (--to_mcore). Must not exist or be empty. Required.")
    to_hf: bool = flag(False, "Convert a swift-mcore checkpoint (any TP/PP layout) into a "
                       "Hugging Face folder.")
    to_mcore: bool = flag(False, "Convert a Hugging Face folder into a swift-mcore checkpoint "
                          "(load it with `pt --load DIR --finetune`, or `infer`/`export`).")
    to_peft: bool = flag(
        False, "Write a LoRA checkpoint's adapter as peft saves one (adapter_config.json, "
        "adapter_model.safetensors, Hugging Face module names): "
        "peft.PeftModel.from_pretrained(base model, DIR) loads it (docs/lora.md).")
    merge_lora: bool = flag(
        False, "With --to_hf and a LoRA checkpoint: merge the adapters into the base weights "
        "(W + B·A·alpha/r, as peft's merge_and_unload) and write the merged model.")
    text_only: bool = flag(
        False, "With --to_hf and a checkpoint of the language model of a multimodal folder "
        "(Qwen3.5, Gemma 3 with their vision tower): write the language model alone, without "
        "the tensors it did not train, which an export otherwise copies from that folder "
        "(and refuses to when the folder is gone or they changed since training).")
    test_convert_precision: bool = flag(
        False, "After converting, run the source and the converted model on the same tokens "
        "(float32, eager attention on the Hugging Face side) and print the largest logit "
        "difference.")
    tokenizer: Optional[str] = flag(
        None, "Tokenizer folder or tokenizer.json written with --to_hf; default: the one the "
        "checkpoint was trained with.")
    dtype: Optional[str] = flag(
        None, "Weight dtype of the Hugging Face files; default: the source config.json's, else "
        "the checkpoint's.", choices=("float32", "bfloat16", "float16"))
    max_shard_size: str = flag("5GB", "Largest safetensors file (KB, MB, GB, KiB, MiB, GiB).")
    trust_remote_code: bool = trust_remote_code_flag()

    def validate(self) -> "ExportArguments":
        """Check every flag before any model is built; raises ArgumentError naming it. (What
        --model holds is the command's to check: export.check_source.)"""
        check_flags(self)
        if self.to_hf + self.to_mcore + self.to_peft != 1:
            raise ArgumentError("give exactly one of --to_hf (checkpoint -> Hugging Face), "
                                "--to_mcore (Hugging Face -> checkpoint) and --to_peft (LoRA "
                                "checkpoint -> peft adapter)")
        if self.merge_lora and not self.to_hf:
            raise ArgumentError("--merge_lora writes merged Hugging Face weights: it goes with "
                                "--to_hf")
        if self.text_only and not self.to_hf:
            raise ArgumentError("--text_only chooses what --to_hf writes of a multimodal "
                                "model: it goes with --to_hf")
        if not self.model:
            raise ArgumentError("--model is required: the checkpoint (--to_hf, --to_peft) or "
                                "Hugging Face folder (--to_mcore) to convert")
        if not os.path.exists(os.path.expanduser(self.model)):
            raise ArgumentError(f"--model {self.model}: no such file or folder")
        if not self.output_dir or not str(self.output_dir).strip():
            raise ArgumentError("--output_dir is required: where the converted model goes")
        out = os.path.abspath(os.path.expanduser(self.output_dir))
        check_output_dir(self.output_dir, "--output_dir")
        if os.path.isdir(out) and os.listdir(out):
            raise ArgumentError(f"--output_dir {self.output_dir} already exists and is not "
                                f"empty; choose a new folder (nothing is overwritten)")
        if os.path.abspath(os.path.expanduser(self.model)) == out:
            raise ArgumentError("--output_dir must differ from --model")
        parse_size(self.max_shard_size)
        return self


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30}


def parse_size(text: str, flag: str = "--max_shard_size") -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ArgumentError(f"{flag} {text!r}: give a positive size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])
