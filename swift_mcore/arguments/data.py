"""Data and tokenizer flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .fields import POSITIVE, flag


def text_key_flag():
    """--text_key, as pt (for --dataset) and preprocess (for --input) declare it."""
    return flag("text", "Column (JSON field) holding the text of raw inputs.")


def trust_remote_code_flag():
    """--trust_remote_code, as the commands that read a tokenizer folder declare it."""
    return flag(
        False, "Run the Python code a Hugging Face tokenizer folder ships (auto_map in "
        "tokenizer_config.json or config.json); without it a folder that needs its code is "
        "refused. Read that code first: it runs with your permissions. Model code is never "
        "run (the model is built from config.json).")


def tokenizer_flag(default_source: str = "--model's, else "):
    """--tokenizer, as pt, sft (``default_source``: --model's tokenizer comes first) and
    preprocess (no --model: '') declare it."""
    return flag(None, f"Hugging Face tokenizer or model folder, or a tokenizer.json; default: "
                f"{default_source}the built-in byte-level BPE trained on the embedded corpus.")


@dataclass
class DataArguments:
    data_path: Optional[List[str]] = flag(
        None, "Preprocessed .bin/.idx prefixes, optionally weighted: '0.7 a 0.3 b'.")
    dataset: Optional[List[str]] = flag(
        None, "Raw files, folders or globs (.jsonl .json .parquet .csv .txt) or a folder saved "
        "by datasets' save_to_disk; tokenized once and cached by content (docs/data.md).")
    text_key: str = text_key_flag()
    split: str = flag("949,50,1", "Train,valid,test proportions of the data.")
    data_cache_path: Optional[str] = flag(
        None, "Where megatron's dataset index files go (a folder per data content); default "
        "output_dir/data_cache.")
    tokenizer: Optional[str] = tokenizer_flag()
    data_order: str = flag(
        "resumable", "Sample order (pt): 'resumable', one epoch of megatron's GPTDataset "
        "permuted per (seed, epoch), unchanged by --train_iters; 'megatron', Megatron-LM's "
        "own order (GPTDataset built for train_iters x global_batch_size samples, read in "
        "sequence as its MegatronPretrainingSampler does), which depends on --train_iters, "
        "--eval_steps and --eval_iters (docs/data.md).", choices=("resumable", "megatron"))
    num_workers: int = flag(1, "Data loader worker processes per rank (0: in the main process).")
    streaming: bool = flag(
        False, "Read --dataset lazily while training (.jsonl, .parquet, saved datasets "
        "folders too large to tokenize up front): rows are shuffled through a buffer of "
        "--shuffle_buffer_size and tokenized on the fly (sft: encoded and packed; pt: the "
        "--text_key text cut into --seq_length rows); needs --train_iters. The stream's "
        "position is saved with checkpoints and resumed exactly, also on another number of "
        "ranks (docs/sft.md, 'Streaming'; docs/data.md, 'pt data: cache or stream').")
    shuffle_buffer_size: int = flag(
        1000, "--streaming: rows held in the shuffle buffer (each row trained is drawn from "
        "it with --seed's generator; 1 keeps the files' order).", range=POSITIVE)
    trust_remote_code: bool = trust_remote_code_flag()
