"""SftArguments: pt's flag groups plus the finetuning data flags (templates, loss, packing)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..errors import ArgumentError
from .fields import FRACTION, POSITIVE, flag
from .run import RunArguments, check_streaming_flags

TEMPLATES = ("auto", "tokenizer", "chatml", "plain")
# The columns a row can hold after --columns renames it (docs/sft.md, "Data formats").
COLUMN_TARGETS = ("messages", "tools", "query", "response", "system", "history")


@dataclass
class VideoArguments:
    """How a video's frames are sampled and sized (data/video.py): ms-swift's names (its
    FPS, FPS_MIN_FRAMES, ... environment variables) lower-cased, qwen_vl_utils' defaults.
    sft's data flags and infer's flags both hold them."""

    fps: Optional[float] = flag(
        None, "Videos: frames taken per second of video (default 2.0), within "
        "--fps_min_frames and --fps_max_frames.", range=POSITIVE)
    fps_min_frames: Optional[int] = flag(
        None, "Videos: the fewest frames taken of a video (default 4).", range=POSITIVE)
    fps_max_frames: Optional[int] = flag(
        None, "Videos: the most frames taken of a video (default 768).", range=POSITIVE)
    video_min_pixels: Optional[int] = flag(
        None, "Videos: the fewest pixels a frame has (default 128 x f x f, f = patch x merge "
        "size: 28 for Qwen2.5-VL, 32 for Qwen3-VL).",
        range=POSITIVE)
    video_max_pixels: Optional[int] = flag(
        None, "Videos: the most pixels a frame keeps (default 768 x f x f).",
        range=POSITIVE)
    video_total_pixels: Optional[int] = flag(
        None, "Videos: the pixels of all a video's frames together, at most (each frame "
        "gets its share, not below 1.05 x --video_min_pixels; default 128000 x f x f x "
        "0.9).", range=POSITIVE)

    def check_video_flags(self) -> None:
        """ArgumentError for a floor above its ceiling."""
        for low, high in (("fps_min_frames", "fps_max_frames"),
                          ("video_min_pixels", "video_max_pixels")):
            if getattr(self, low) and getattr(self, high) and \
                    getattr(self, low) > getattr(self, high):
                raise ArgumentError(f"--{low} {getattr(self, low)} is above --{high} "
                                    f"{getattr(self, high)}")


@dataclass
class _SftData:
    template: str = flag(
        "auto", "How a conversation becomes tokens: 'tokenizer' (its chat template), 'chatml' "
        "or 'plain' (built in), or 'auto': the tokenizer's template when it has one, else "
        "chatml when <|im_start|> and <|im_end|> are tokens, else plain.", choices=TEMPLATES)
    system: Optional[str] = flag(
        None, "System prompt for conversations that have none.")
    train_separator: bool = flag(
        False, "Also train the text a template puts after an answer's end-of-turn marker (the "
        "newline after ChatML's <|im_end|>). Off by default, as in transformers' assistant "
        "masks: that text is context, the next message's start.")
    ignore_empty_think: bool = flag(
        True, "Leave an answer's empty reasoning block (<think></think>, which Qwen3-style "
        "templates write into answers that have no reasoning) out of the loss, so the model "
        "does not learn to skip thinking; 'false' trains it like the rest of the answer "
        "(docs/sft.md, 'Empty reasoning blocks').")
    loss_on: str = flag(
        "all_turns", "Which assistant turns are trained on; every other token is masked from "
        "the loss.", choices=("all_turns", "last_turn"))
    truncation_strategy: str = flag(
        "drop", "A conversation longer than --seq_length + 1 tokens: dropped, or cut on the "
        "left or on the right (counted in the log).", choices=("drop", "left", "right"))
    packing: bool = flag(
        False, "Pack several conversations into each --seq_length row (attention never "
        "crosses one; position ids restart) instead of padding each micro-batch.")
    columns: Optional[List[str]] = flag(
        None, "Rename columns before reading: 'instruction=query output=response', or a "
        "JSON object. Read columns: " + ", ".join(COLUMN_TARGETS) + ".")
    dataset_num_proc: int = flag(
        1, "Worker processes that tokenize conversations when they are not in the token "
        "cache yet (docs/sft.md, 'Tokenized once'); the tokens are the same for any count.",
        range=POSITIVE)
    cached_dataset: Optional[str] = flag(
        None, "Train on a folder written by `swift-mcore preprocess sft` (the conversations "
        "tokenized; the raw files are not read) instead of --dataset. Give the tokenizer and "
        "the template flags it was prepared with; --seq_length, --truncation_strategy and "
        "--packing may differ (docs/sft.md, 'Prepared offline').")
    max_pixels: Optional[int] = flag(
        None, "Vision-language models: the most pixels an image keeps (larger ones are "
        "scaled down, aspect kept); default: the folder's preprocessor_config.json.",
        range=POSITIVE)
    min_pixels: Optional[int] = flag(
        None, "Vision-language models: the fewest pixels an image has (smaller ones are "
        "scaled up); default: the folder's preprocessor_config.json.", range=POSITIVE)
    val_dataset: Optional[List[str]] = flag(
        None, "Validation conversations (files, folders or globs, as --dataset).")
    split_dataset_ratio: float = flag(
        0.0, "Hold out this fraction of --dataset for validation (a fixed draw from --seed).",
        range=FRACTION)


@dataclass
class SftDataArguments(VideoArguments, _SftData):
    """sft's data flags: the conversations' (first) and the videos' (dataclasses order the
    fields of the last base first)."""


@dataclass
class SftArguments(RunArguments):
    sft: SftDataArguments = field(default_factory=SftDataArguments)

    COMMAND = "sft"
    # Finetuning defaults: a small learning rate, no warmup, one pass over the data.
    DEFAULTS = {"lr": 1e-5, "min_lr": 0.0, "lr_warmup_iters": 0, "num_train_epochs": 1.0,
                "output_dir": "output/swift-mcore-sft"}

    def check_command(self) -> None:
        d, s = self.data, self.sft
        if d.data_path:
            raise ArgumentError("--data_path holds pretraining .bin/.idx files; sft reads "
                                "conversations from --dataset (jsonl, json, parquet, or a "
                                "saved datasets folder)")
        if d.dataset and s.cached_dataset:
            raise ArgumentError("--dataset and --cached_dataset are alternatives: give the "
                                "raw files or the folder `swift-mcore preprocess sft` wrote")
        if not d.dataset and not s.cached_dataset:
            raise ArgumentError("sft needs --dataset: conversation files (jsonl, json, "
                                "parquet) or a saved datasets folder (docs/sft.md); or "
                                "--cached_dataset: a folder from `swift-mcore preprocess sft`")
        if s.cached_dataset and not os.path.isfile(os.path.join(s.cached_dataset,
                                                               "manifest.json")):
            raise ArgumentError(f"--cached_dataset {s.cached_dataset}: not a folder written "
                                f"by `swift-mcore preprocess sft` (it has no manifest.json)")
        column_map(s.columns)
        if d.data_order != "resumable":
            raise ArgumentError("--data_order megatron orders megatron's GPTDataset (pt); sft "
                                "rows keep the resumable order")
        if d.streaming:
            self.check_streaming()
        if s.val_dataset and s.split_dataset_ratio:
            raise ArgumentError("--val_dataset and --split_dataset_ratio are alternatives; "
                                "give one of them")

    def check_streaming(self) -> None:
        s = self.sft
        if s.cached_dataset:
            raise ArgumentError("--streaming reads --dataset's raw files; a --cached_dataset "
                                "folder is memory-mapped already: give one of them")
        check_streaming_flags(self)
        if s.split_dataset_ratio:
            raise ArgumentError("--split_dataset_ratio holds out a share of a dataset read "
                                "whole; with --streaming give --val_dataset")

    def fixed_width_rows(self) -> str:
        """sft pads each micro-batch's rows to a multiple of the TP size, except under
        pipeline parallelism, whose stages exchange rows of --seq_length positions."""
        if self.parallel.pipeline_model_parallel_size > 1:
            return "--seq_length positions (the pipeline stages exchange rows that wide)"
        return ""

    def validation_problem(self):
        """sft validates on --val_dataset or a held-out share of --dataset."""
        if self.sft.val_dataset or self.sft.split_dataset_ratio:
            return None
        return "give --val_dataset or --split_dataset_ratio (a share of --dataset held out)"


def column_map(columns: Optional[List[str]]) -> Dict[str, str]:
    """--columns as {source column: column read}; raises ArgumentError naming the flag."""
    if not columns:
        return {}
    text = " ".join(columns).strip()
    if text.startswith("{"):
        try:
            pairs = json.loads(text)  # text starting with "{" parses to an object or fails
        except (json.JSONDecodeError, RecursionError) as err:
            raise ArgumentError(f"--columns: not a valid JSON object ({err})") from None
    else:
        pairs = {}
        for item in text.split():
            source, sep, target = item.partition("=")
            if not sep or not source or not target:
                raise ArgumentError(f"--columns: '{item}' is not of the form from=to "
                                    f"(e.g. --columns instruction=query output=response)")
            pairs[source] = target
    for source, target in pairs.items():
        if target not in COLUMN_TARGETS:
            raise ArgumentError(f"--columns: '{source}' is mapped to '{target}'; map columns "
                                f"to one of {', '.join(COLUMN_TARGETS)}")
    return {str(k): str(v) for k, v in pairs.items()}


SftArguments.GROUPS = {**RunArguments.GROUPS, "sft": SftDataArguments}
