"""One whole model (TP=PP=1, one process) from a Hugging Face folder or a swift-mcore
checkpoint, with its tokenizer: what export and infer work on."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from .arguments import RunArguments
from .errors import ArgumentError, CheckpointError
from .run_config import RunConfig, resolve

Log = Callable[[str], None]


@dataclass
class LoadedModel:
    flags: RunArguments    # what the model was resolved from (one process)
    config: RunConfig           # complete: the padded vocabulary is the embedding's rows
    model: torch.nn.Module      # megatron GPTModel, eval mode
    tokenizer: Optional[object]  # None: a weights-only HF folder converted without one
    kind: str                   # "hf" or "checkpoint"
    path: str                   # the HF folder or the checkpoint folder
    hf_folder: Optional[str]    # the HF folder the config/tokenizer came from, if known
    # a LoRA checkpoint's routers' expert bias as its base model holds it, by buffer name
    base_expert_bias: Optional[Dict[str, torch.Tensor]] = None

    @property
    def vocab(self) -> int:
        return self.config.model.vocab_size or self.config.padded_vocab_size


def load_model(path: str, tokenizer: Optional[str] = None, flag: str = "--model",
               log: Log = print, trust_remote_code: bool = False,
               tokenizer_optional: bool = False) -> LoadedModel:
    """Collective over a one-rank process group it creates when none exists. A tokenizer
    folder's own code runs only with ``trust_remote_code`` (the command's flag, never a
    saved run's). With ``tokenizer_optional`` (conversion), an HF folder of weights only
    loads without a tokenizer: its config.json gives the vocabulary."""
    from .models.hf_folder import is_hf_folder

    if is_hf_folder(path):
        return _from_hf(path, tokenizer, log, trust_remote_code, tokenizer_optional)
    return _from_checkpoint(path, tokenizer, flag, log, trust_remote_code, tokenizer_optional)


def _from_hf(path: str, tokenizer_path: Optional[str], log: Log, trust: bool,
             tokenizer_optional: bool = False) -> LoadedModel:
    from .data import build_tokenizer
    from .data.tokenizer import has_tokenizer_files
    from .models.hf_load import load_hf_weights

    from .models import mtp
    from .models.families import for_config
    from .models.text_part import open_folder

    folder = open_folder(path, flag="--model")  # a multimodal folder: its language model
    # Only the model matters; a sequence length its positions allow keeps the checks happy.
    positions = folder.config.get("max_position_embeddings") or 256
    # the folder's multi-token prediction layers, carried to the checkpoint or folder written
    held = mtp.folder_layers(for_config(folder.config, folder.config_path), folder)
    # float32, on a GPU too (--precision auto would be bf16 there): the weights as stored.
    flags = RunArguments.from_flags(model=path, tokenizer=tokenizer_path,
                                         seq_length=min(256, int(positions)), precision="fp32",
                                         trust_remote_code=trust, mtp_num_layers=held or None)
    # config.json's values first: transformers' tokenizer reads config.json too, and would
    # report a bad value as a tokenizer that cannot be loaded
    resolved = resolve(flags, world_size=1, weights_only=True)
    tokenizer = None
    if tokenizer_path or not tokenizer_optional or has_tokenizer_files(path):
        tokenizer = build_tokenizer(flags)
    config = resolved.complete(tokenizer.vocab_size if tokenizer is not None
                               else resolved.model.vocab_size, None)
    model = _build(config)
    load_hf_weights(config, [model], log=log)
    return LoadedModel(flags, config, model.eval(), tokenizer, "hf", os.path.abspath(path),
                       os.path.abspath(path))


def _from_checkpoint(path: str, tokenizer_path: Optional[str], flag: str, log: Log,
                     trust: bool, tokenizer_optional: bool = False) -> LoadedModel:
    from .checkpointing import find_checkpoint, load_weights, read_run_flags, tensor_shapes
    from .data.templates import attach_chat_template
    from .models.hf_folder import is_hf_folder

    folder = find_checkpoint(path, None, flag, log)
    saved = read_run_flags(folder)
    base = read_base_model(folder)
    if base is not None:
        return _from_lora_checkpoint(folder, saved, base, tokenizer_path, log, trust)
    flags = one_process_flags(saved)
    hf_folder = saved.get("model", {}).get("model")
    tokenizer = _checkpoint_tokenizer(flags, saved, tokenizer_path, folder, trust,
                                      tokenizer_optional)
    # A model finetuned with a built-in template is exported with it as its chat template.
    if tokenizer is not None:
        attach_chat_template(tokenizer, saved.get("sft"))
    rows = tensor_shapes(folder).get("embedding.word_embeddings.weight")
    if rows is None:
        raise CheckpointError(f"{folder} holds no embedding.word_embeddings.weight: not a GPT "
                              f"checkpoint of swift-mcore")
    resolved = resolve(flags, world_size=1, weights_only=True)
    config = resolved.complete(tokenizer.vocab_size if tokenizer is not None
                               else resolved.model.vocab_size or rows[0], None,
                               padded_vocab_size=rows[0])
    model = _build(config)
    load_weights(folder, [model])
    log(f"loaded checkpoint {folder}")
    return LoadedModel(flags, config, model.eval(), tokenizer, "checkpoint", folder,
                       hf_folder if hf_folder and is_hf_folder(hf_folder) else None)


def read_base_model(folder: str) -> Optional[str]:
    """The base weights' reference of a LoRA checkpoint (run.json), None for a full one."""
    from .checkpointing import files

    return files.read_json(folder, files.RUN).get("base_model")


def _from_lora_checkpoint(folder: str, saved, base: str, tokenizer_path: Optional[str],
                          log: Log, trust: bool) -> LoadedModel:
    """A LoRA checkpoint holds adapters only: the base is rebuilt as it was trained on (its
    --model folder, or the seeded initialization), checked against the recorded reference,
    then the adapters are applied and loaded (unmerged: ``lora.merge_and_unload`` merges)."""
    from .checkpointing import load_weights
    from .models import lora
    from .models.hf_folder import is_hf_folder
    from .models.hf_load import load_hf_weights

    flags = one_process_flags(saved)
    flags.update(**saved.get("tuner", {}), seed=saved.get("training", {}).get("seed", 42))
    if flags.model.attention_backend in ("auto", "transformer_engine"):
        # the local spec: TE-spec adapters have the same checkpoint keys (models/lora_te.py);
        # sliding windows, Gemma 3's layers and multi-latent attention's head sizes run in
        # its SDPA core attention only
        m = flags.model
        flags.update(attention_backend="sdpa" if m.window_size or m.model_type == "gemma3"
                     or m.multi_latent_attention else "local")
    hf_folder = saved.get("model", {}).get("model")
    if hf_folder:
        if not is_hf_folder(hf_folder):
            raise CheckpointError(f"{folder} holds LoRA adapters for the base model "
                                  f"{hf_folder}{relative_note(hf_folder)}, which is no longer "
                                  f"a Hugging Face folder; the adapters cannot be used "
                                  f"without their base weights")
        flags.update(model=hf_folder)
    adapters = flags.tuner.adapters
    if adapters and not os.path.isdir(os.path.expanduser(adapters)):
        raise CheckpointError(f"{folder} continued the peft adapter {adapters}"
                              f"{relative_note(adapters)} (--adapters), which is no longer a "
                              f"folder; its adapter_config.json gives the LoRA shape")
    tokenizer = _checkpoint_tokenizer(flags, saved, tokenizer_path, folder, trust)
    config = resolve(flags, world_size=1, weights_only=True).complete(tokenizer.vocab_size,
                                                                     None)
    if config.base_model != base:
        raise CheckpointError(f"{folder}: base_model (the frozen base weights) was {base}, "
                              f"now {config.base_model}"
                              + (f" ({hf_folder} changed)" if hf_folder else ""))
    model = _build(config, initialize=not hf_folder)
    if hf_folder:
        load_hf_weights(config, [model], log=log)
    lora.apply(config, [model])
    base_bias = {name: buffer.detach().clone() for name, buffer in model.named_buffers()
                 if name.endswith(".router.expert_bias")}
    load_weights(folder, [model])
    log(f"loaded LoRA checkpoint {folder} (adapters on the base {hf_folder or base})")
    return LoadedModel(flags, config, model.eval(), tokenizer, "checkpoint", folder,
                       hf_folder, base_bias)


def relative_note(path: str) -> str:
    """Where a relative path a checkpoint recorded was meant: checkpoints made before paths
    were recorded absolute hold --model as the user typed it."""
    if os.path.isabs(os.path.expanduser(path)):
        return ""
    return (" (a relative path, recorded by an older swift-mcore: from the working directory "
            "of the run that saved it; run from there)")


def one_process_flags(saved) -> RunArguments:
    """The model a checkpoint was trained with, to rebuild in one process: its model flags
    (``--model`` dropped: they already hold its config, and the folder may be gone), and its
    precision on CUDA (float32 on CPU); everything else at its default."""
    flags = RunArguments()
    known = {name for name in vars(flags.model)}
    model = {k: v for k, v in saved.get("model", {}).items() if k in known and k != "model"}
    flags.update(**model)
    from .runtime import hardware

    training = saved.get("training", {})
    precision = "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "fp32"
    flags.update(precision=precision if hardware.cuda_available() else "fp32")
    return flags


def with_flags(flags: RunArguments, **changes) -> RunArguments:
    """A copy of ``flags`` with ``changes`` applied (the original is left as it is)."""
    return copy.deepcopy(flags).update(**changes)


def _checkpoint_tokenizer(flags, saved, explicit: Optional[str], folder: str, trust: bool,
                          optional: bool = False):
    from .data import build_tokenizer, load_tokenizer
    from .data.tokenizer import has_tokenizer_files

    if explicit:
        return load_tokenizer(explicit, flag="--tokenizer", trust_remote_code=trust)
    source = saved.get("data", {}).get("tokenizer") or saved.get("model", {}).get("model")
    if not source:
        return build_tokenizer(flags)
    if not os.path.exists(source):
        raise ArgumentError(f"checkpoint {folder} was trained with the tokenizer of {source}"
                            f"{relative_note(source)}, which no longer exists; pass "
                            f"--tokenizer PATH")
    if optional and os.path.isdir(source) and not has_tokenizer_files(source):
        return None  # converted from a weights-only folder: converts back without one
    return load_tokenizer(source, flag="--tokenizer", trust_remote_code=trust)


def _build(config: RunConfig, initialize: bool = False):
    """The model with its weights unset (the caller loads every one of them), or, with
    ``initialize``, seeded as training initialised it (a LoRA checkpoint's random base)."""
    from .models.gpt import build_model
    from .runtime import distributed, seed

    distributed.initialize(config)
    seed.set_seed(config.training.seed, config.cuda)
    return build_model(config, initialize=initialize)[0]


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [batch, sequence, padded vocab] of a whole (TP=PP=1) GPTModel."""
    batch, length = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(length, device=device).unsqueeze(0).expand(batch, length)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=None).float()
