"""Flags of `swift-mcore infer`: which model, which prompt, how to sample."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ArgumentError
from .data import trust_remote_code_flag
from .fields import NON_NEGATIVE, NONZERO_FRACTION, check_flags, flag
from .sft import TEMPLATES, VideoArguments


@dataclass
class _Infer:
    model: Optional[str] = flag(
        None, "A Hugging Face model folder, or a swift-mcore checkpoint (an iter_NNNNNNN "
        "folder, the checkpoint folder holding latest_checkpointed_iteration.txt, or a run's "
        "output_dir). Required.")
    prompt: Optional[str] = flag(
        None, "Text to continue; with --template, the user's message to answer. Required.")
    template: Optional[str] = flag(
        None, "Treat --prompt as a user message in this chat template (as `swift-mcore sft "
        "--template`) and print the assistant's answer; default: continue the raw text.",
        choices=TEMPLATES)
    system: Optional[str] = flag(None, "System prompt, with --template.")
    image: Optional[str] = flag(
        None, "An image file the user's message shows (before --prompt, or where --prompt "
        "writes <image>), for a "
        "vision-language model (Qwen2.5-VL); needs --template (docs/multimodal.md).")
    video: Optional[str] = flag(
        None, "A video file the user's message shows (before --prompt, or where --prompt writes "
        "<video>), for a Qwen2.5-VL or "
        "Qwen3-VL model: frames sampled and sized as sft samples them (--fps, --video_max_pixels, "
        "...; docs/multimodal.md); needs --template.")
    max_new_tokens: int = flag(64, "Tokens to generate at most (generation also stops at the "
                               "end-of-document token).")
    temperature: float = flag(0.0, "Sampling temperature; 0 picks the most likely token "
                              "(greedy).", range=NON_NEGATIVE)
    top_p: float = flag(1.0, "Sample from the smallest set of tokens whose probability "
                        "reaches this (nucleus sampling; needs --temperature > 0).",
                        range=NONZERO_FRACTION)
    seed: int = flag(42, "Seed of the sampling.")
    tokenizer: Optional[str] = flag(
        None, "Tokenizer folder or tokenizer.json; default: the model's.")
    trust_remote_code: bool = trust_remote_code_flag()


@dataclass
class InferArguments(VideoArguments, _Infer):
    """infer's flags: the model's and the sampling's (first), then the videos' (dataclasses
    order the fields of the last base first)."""

    def validate(self) -> "InferArguments":
        """Check every flag before any model is built; raises ArgumentError naming it."""
        check_flags(self)
        if not self.model:
            raise ArgumentError("--model is required: a Hugging Face folder or a swift-mcore "
                                "checkpoint")
        if not os.path.exists(os.path.expanduser(self.model)):
            raise ArgumentError(f"--model {self.model}: no such file or folder")
        if self.prompt is None or self.prompt == "":
            raise ArgumentError("--prompt is required: the text to continue")
        if self.system is not None and self.template is None:
            raise ArgumentError("--system needs --template (a raw prompt has no roles)")
        if self.image is not None and self.video is not None:
            raise ArgumentError("--image and --video: give one (the user's message shows "
                                "one image or one video)")
        self.check_video_flags()
        for name in ("image", "video"):
            if getattr(self, name) is not None and self.template is None:
                raise ArgumentError(f"--{name} needs --template (the {name} goes in the "
                                    f"user's message)")
        if self.max_new_tokens <= 0:
            raise ArgumentError(f"--max_new_tokens must be a positive integer, got "
                                f"{self.max_new_tokens}")
        return self
