"""Builds one full model (TP=PP=1, one process) from a Hugging Face folder or a swift-mcore
checkpoint, for export and inference."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from ..errors import ArgumentError
from ..arguments import PretrainArguments
from ..arguments.pretrain import flag_owners, padded_vocab_size
from .hf_folder import is_hf_folder

# Flags of a saved run that would make a one-process rebuild of its model fail or differ.
_SINGLE_PROCESS = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "sequence_parallel": False, "use_distributed_optimizer": False, "overlap_grad_reduce": False,
    "num_buckets": None, "bucket_size": None, "distributed_backend": None, "resume": None,
    "load": None, "finetune": False, "save_safetensors": False, "micro_batch_size": 1,
    "global_batch_size": 1, "tensorboard": False, "progress_bar": False,
    # the model needs no data (and the run's files may be gone)
    "data_path": None, "dataset": None,
    # a resolved run saved both; its train_iters already holds the epochs' length
    "num_train_epochs": None,
    # never inherited from the saved run: the command's own --trust_remote_code decides
    "trust_remote_code": False,
}


@dataclass
class LoadedModel:
    args: PretrainArguments
    model: torch.nn.Module      # megatron GPTModel, eval mode
    tokenizer: object
    padded_vocab: int
    kind: str                   # "hf" or "checkpoint"
    path: str                   # the HF folder or the checkpoint folder
    hf_folder: Optional[str]    # the HF folder the config/tokenizer came from, if known

    @property
    def vocab(self) -> int:
        return self.args.model.vocab_size or self.padded_vocab


def load_model(path: str, tokenizer: Optional[str] = None, flag: str = "--model",
               log: Callable[[str], None] = print,
               trust_remote_code: bool = False) -> LoadedModel:
    """Collective over a one-rank process group it creates when none exists."""
    if is_hf_folder(path):
        return _from_hf(path, tokenizer, log, trust_remote_code)
    return _from_checkpoint(path, tokenizer, flag, log, trust_remote_code)


def checkpoint_folder(path: str, flag: str = "--model",
                      log: Callable[[str], None] = print) -> str:
    """An iter_NNNNNNN folder, a checkpoint root (the tracker decides) or a run's output_dir."""
    from ..checkpointing import locate
    from ..checkpointing.tracker import CHECKPOINT_SUBDIR

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(os.path.join(path, CHECKPOINT_SUBDIR)) and not locate.is_checkpoint_folder(
            path):
        path = os.path.join(path, CHECKPOINT_SUBDIR)
    return locate.announce(locate.resolve(path, None, flag), log)


def _from_hf(path: str, tokenizer_path: Optional[str], log, trust: bool = False
             ) -> LoadedModel:
    from ..data import build_tokenizer
    from .families import apply_hf_config
    from .hf_load import load_hf_weights

    args = PretrainArguments.from_flags(model=path, tokenizer=tokenizer_path,
                                        **{**_SINGLE_PROCESS, "trust_remote_code": trust})
    apply_hf_config(args)
    # Only the model matters here; a sequence length the config allows keeps validate happy.
    args.model.seq_length = min(args.model.seq_length, args.model.max_position_embeddings)
    args.validate(world_size=1)
    tokenizer = build_tokenizer(args)
    padded = padded_vocab_size(args.model.vocab_size, args.model.make_vocab_size_divisible_by, 1)
    model = _build(args, padded)
    load_hf_weights(args, [model], padded, log=log)
    return LoadedModel(args, model.eval(), tokenizer, padded, "hf", os.path.abspath(path),
                       os.path.abspath(path))


def _from_checkpoint(path: str, tokenizer_path: Optional[str], flag: str, log,
                     trust: bool = False) -> LoadedModel:
    from ..errors import CheckpointError
    from ..checkpointing import commit, files, io

    folder = checkpoint_folder(path, flag, log)
    saved = files.read_json(folder, files.ARGS)
    args = saved_run_args(saved)
    hf_folder = saved.get("model", {}).get("model")
    tokenizer = _checkpoint_tokenizer(args, saved, tokenizer_path, folder, trust)
    from ..data.templates import attach_chat_template

    # A model finetuned with a built-in template is exported with it as its chat template.
    attach_chat_template(tokenizer, saved.get("sft"))
    shapes = io.tensor_shapes(folder)
    if "embedding.word_embeddings.weight" not in shapes:
        raise CheckpointError(f"{folder} holds no embedding.word_embeddings.weight: not a GPT "
                              f"checkpoint of swift-mcore")
    padded = shapes["embedding.word_embeddings.weight"][0]
    model = _build(args, padded)
    commit.verify_checksums(folder)
    state = io.sharded_state_dict([model], None, with_optimizer=False, is_loading=True)
    mismatches = io.shape_mismatches(folder, state)
    if mismatches:
        raise CheckpointError(f"checkpoint {folder} does not fit the model its args.json "
                              f"describes:\n" + "\n".join(f"  {m}" for m in mismatches))
    io.restore_model([model], io.load(state, folder))
    log(f"loaded checkpoint {folder}")
    return LoadedModel(args, model.eval(), tokenizer, padded, "checkpoint", folder,
                       hf_folder if hf_folder and is_hf_folder(hf_folder) else None)


def saved_run_args(saved: Dict[str, Dict]) -> PretrainArguments:
    """The run's flags from args.json, adapted to one process. ``--model`` is dropped (the
    saved values already hold its config, and the folder may be gone); the precision is the
    saved one on CUDA and float32 on CPU."""
    known = flag_owners()
    flat = {k: v for group in saved.values() if isinstance(group, dict)
            for k, v in group.items() if k in known}
    flat.update(_SINGLE_PROCESS, model=None, tokenizer=None)
    if not torch.cuda.is_available():
        flat.update(bf16=False, fp16=False)
    args = PretrainArguments.from_flags(**flat)
    args.validate(world_size=1)
    return args


def _checkpoint_tokenizer(args, saved, explicit: Optional[str], folder: str,
                          trust: bool = False):
    from ..data import build_tokenizer, load_tokenizer

    if explicit:
        return load_tokenizer(explicit, flag="--tokenizer", trust_remote_code=trust)
    source = saved.get("data", {}).get("tokenizer") or saved.get("model", {}).get("model")
    if not source:
        return build_tokenizer(args)
    if not os.path.exists(source):
        raise ArgumentError(f"checkpoint {folder} was trained with the tokenizer of {source}, "
                            f"which no longer exists; pass --tokenizer PATH")
    return load_tokenizer(source, flag="--tokenizer", trust_remote_code=trust)


def _build(args, padded_vocab: int):
    """The model with its weights unset: the caller loads every one of them."""
    from ..runtime import distributed, seed
    from .gpt import build_model

    distributed.initialize(args)
    seed.set_seed(args.training.seed)
    return build_model(args, padded_vocab, initialize=False)[0]


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, sequence, padded vocab] of a full (TP=PP=1) GPTModel."""
    batch, length = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(length, device=device).unsqueeze(0).expand(batch, length)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=None).float()
