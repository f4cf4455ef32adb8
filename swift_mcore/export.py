"""`swift-mcore export`: a checkpoint to a Hugging Face folder (--to_hf), a Hugging Face folder
to a checkpoint (--to_mcore), and the logit comparison of both (--test_convert_precision)."""

from __future__ import annotations

import argparse
import os
from typing import Callable, Dict, List

import torch

from .arguments.export import ExportArguments
from .errors import ArgumentError

DESCRIPTION = """Convert between swift-mcore checkpoints and Hugging Face folders, in one process.
A checkpoint saved at any tensor/pipeline-parallel layout is read whole (dist_checkpointing
reshards it); the Hugging Face folder loads with AutoModelForCausalLM.from_pretrained."""

# Tokens the precision check runs: enough to cover RoPE well past the first positions.
PRECISION_BATCH, PRECISION_LENGTH = 2, 64


def parse(argv: List[str]) -> ExportArguments:
    from .arguments.parser import add_flags

    parser = argparse.ArgumentParser(prog="swift-mcore export", description=DESCRIPTION,
                                     argument_default=argparse.SUPPRESS)
    add_flags(parser, ExportArguments)
    return check_source(ExportArguments(**vars(parser.parse_args(argv))).validate())


def check_source(args: ExportArguments) -> ExportArguments:
    """--model holds what the direction converts: a checkpoint for --to_hf, a Hugging Face
    folder (config.json and safetensors) for --to_mcore."""
    from .models.hf_folder import HFFolder, is_hf_folder

    for flag, given in (("--to_hf", args.to_hf), ("--to_peft", args.to_peft)):
        if given and is_hf_folder(os.path.expanduser(args.model)):
            raise ArgumentError(f"{flag} converts a swift-mcore checkpoint, but --model "
                                f"{args.model} is a Hugging Face folder (use --to_mcore)")
    if args.to_mcore:
        HFFolder(args.model, flag="--model")
    if args.to_hf or args.to_peft:  # written into, never through a link (models/hf_save.py)
        from .models.hf_save import check_output_folder

        check_output_folder(args.output_dir)
    return args


PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")


def run(args: ExportArguments, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Convert as the flags say; returns what was written (and the logit difference)."""
    if args.to_hf:
        return to_hf(args, log)
    if args.to_peft:
        return to_peft(args, log)
    return to_mcore(args, log)


def to_hf(args: ExportArguments, log) -> Dict[str, object]:
    from .models.convert import Layout, canonical
    from .arguments.export import parse_size
    from .models.hf_save import DTYPES, save_hf_folder
    from .loaded_model import load_model

    check_carried(args.model, args.text_only)
    loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                        trust_remote_code=args.trust_remote_code, tokenizer_optional=True)
    merged = merge_lora(loaded, args, log)
    layout = Layout.from_model_args(loaded.config.model, loaded.config.padded_vocab_size)
    state = {canonical(k): v for k, v in loaded.model.state_dict().items()
             if not k.endswith("_extra_state")}
    dtype = DTYPES[args.dtype] if args.dtype else _source_dtype(loaded)
    result = save_hf_folder(args.output_dir, loaded.config.model, layout, state.__getitem__,
                            loaded.tokenizer, dtype, base_folder=loaded.hf_folder,
                            max_shard_bytes=parse_size(args.max_shard_size),
                            carry=not args.text_only)
    log(f"wrote {result['path']}: a {result['family']} model, {result['tensors']} tensors in "
        f"{result['shards']} safetensors file(s), {result['bytes'] / 1e6:.1f} MB "
        f"({str(dtype).replace('torch.', '')})" + (", LoRA adapters merged" if merged else ""))
    if args.test_convert_precision:
        result["max_logit_difference"] = compare_logits(loaded, result["path"], log)
    return result


def check_carried(model: str, text_only: bool) -> None:
    """A checkpoint of the language model of a multimodal folder: that folder still holds
    the tensors the model did not train (the vision tower), as they were at training, for
    the export to copy; else a CheckpointError before anything is read or written.
    ``text_only`` (--text_only) skips the check, and is refused for any other checkpoint."""
    from .checkpointing import files, find_checkpoint, read_run_flags
    from .errors import CheckpointError
    from .models.carried import differences, malformed

    folder = find_checkpoint(model, None, "--model", log=lambda line: None)
    saved = files.read_json(folder, files.RUN).get("multimodal_source") if folder else None
    if text_only:
        flags = read_run_flags(folder).get("model") if folder else None
        source = flags.get("model") if isinstance(flags, dict) else None
        if not isinstance(saved, dict) and not _is_multimodal_folder(source):
            raise ArgumentError(f"--text_only: --model {model} is not the language model of "
                                f"a multimodal folder (it exports as a text model anyway); "
                                f"drop --text_only")
        return
    if saved is None:
        return
    if malformed(saved):
        raise CheckpointError(f"checkpoint {folder}: run.json's multimodal_source is not "
                              f"what swift-mcore writes (the source folder, its model_type "
                              f"and its tensors' fingerprints); add --text_only to write the "
                              f"language model alone")
    problem = differences(saved)
    if problem:
        raise CheckpointError(
            f"--model {folder} is the language model of the multimodal folder "
            f"{saved.get('folder')}, whose tensors it did not train (the vision tower) an "
            f"export copies from there, but {problem}; restore that folder as it was at "
            f"training, or add --text_only to write the language model alone")


def _language_model_of_multimodal(model: str, source) -> bool:
    """Whether checkpoint ``model`` is the language model of a multimodal folder (as its
    run.json records, or as its source folder ``source`` is now)."""
    from .checkpointing import files, find_checkpoint

    folder = find_checkpoint(model, None, "--model", log=lambda line: None)
    if folder and isinstance(files.read_json(folder, files.RUN).get("multimodal_source"), dict):
        return True
    return _is_multimodal_folder(source)


def _is_multimodal_folder(path) -> bool:
    """Whether ``path`` is a multimodal folder now (a checkpoint saved before checkpoints
    recorded it)."""
    from .input_files import load_json
    from .models.hf_folder import CONFIG, is_hf_folder
    from .models.text_part import is_multimodal

    if not isinstance(path, str) or not is_hf_folder(path):
        return False
    config = load_json(os.path.join(path, CONFIG))
    return isinstance(config, dict) and is_multimodal(config)


def merge_lora(loaded, args: ExportArguments, log) -> bool:
    """--merge_lora: a LoRA checkpoint's adapters merged into its base weights, in place.
    A LoRA checkpoint without the flag, or the flag without one, is an ArgumentError."""
    from .models import lora

    if lora.is_lora(loaded.model):
        if not args.merge_lora:
            # a reward model's score head trained whole: --to_peft refuses it
            peft = ("" if loaded.config.model.num_labels else
                    ", or use --to_peft to write the adapter")
            raise ArgumentError(f"--model {args.model} is a LoRA checkpoint (adapters only): "
                                f"add --merge_lora to write the merged model{peft}")
        lora.merge_and_unload(loaded.model)
        return True
    if args.merge_lora:
        raise ArgumentError(f"--merge_lora: --model {args.model} is not a LoRA checkpoint "
                            f"(trained with --tuner_type full); drop --merge_lora")
    return False


def to_peft(args: ExportArguments, log) -> Dict[str, object]:
    """A LoRA checkpoint's adapter in peft's format, with Hugging Face module names."""
    import json

    from safetensors.torch import save_file

    from .atomic_write import temp_name, write_atomic
    from .errors import OutputError
    from .models import lora
    from .models.hf_save import is_full_disk
    from .models.convert import Layout
    from .loaded_model import load_model

    loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                        trust_remote_code=args.trust_remote_code)
    if not lora.is_lora(loaded.model):
        raise ArgumentError(f"--to_peft: --model {args.model} is not a LoRA checkpoint "
                            f"(trained with --tuner_type full); use --to_hf")
    if loaded.config.model.num_labels:
        raise ArgumentError(f"--to_peft: --model {args.model} is a reward model, whose score "
                            f"head trained whole beside the adapters; write it with --to_hf "
                            f"--merge_lora")
    m = loaded.config.model
    if m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate:
        raise ArgumentError(f"--to_peft: --model {args.model} moved its routers' expert bias "
                            f"in training (--moe_router_bias_update_rate "
                            f"{m.moe_router_bias_update_rate:g}), which a peft adapter cannot "
                            f"hold; write the model with --to_hf --merge_lora, or train with "
                            f"--moe_router_bias_update_rate 0")
    moved = moved_expert_bias(loaded)
    if moved:
        # the saved flags say the last run's rate: an earlier run (resumed at rate 0) may
        # have moved it
        raise ArgumentError(f"--to_peft: --model {args.model} holds routers' expert bias "
                            f"moved from the base model's ({moved[0]}"
                            f"{f' and {len(moved) - 1} more' if len(moved) > 1 else ''}; "
                            f"trained at a --moe_router_bias_update_rate above 0 before a "
                            f"resume), which a peft adapter cannot hold; write the model with "
                            f"--to_hf --merge_lora")
    layout = Layout.from_model_args(loaded.config.model, loaded.config.padded_vocab_size)
    multimodal = bool(layout.vision) or layout.nested or _language_model_of_multimodal(
        args.model, loaded.hf_folder)
    config, tensors = lora.peft_adapter(loaded.model, loaded.config.tuner, layout,
                                        loaded.hf_folder, multimodal=multimodal)
    if args.dtype:
        from .models.hf_save import DTYPES

        tensors = {k: v.to(DTYPES[args.dtype]) for k, v in tensors.items()}
    out = os.path.abspath(os.path.expanduser(args.output_dir))
    os.makedirs(out, exist_ok=True)
    # New temporary names renamed over the files: a link planted there is replaced, never
    # written through.
    weights = os.path.join(out, PEFT_FILES[0])
    tmp = temp_name(weights)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, weights)
        # last: a folder with it holds the whole adapter
        write_atomic(os.path.join(out, PEFT_FILES[1]), json.dumps(config, indent=2))
    except BaseException as err:
        for name in (tmp, weights):  # a half-written adapter is removed again
            if os.path.lexists(name):
                os.remove(name)
        if is_full_disk(err):
            raise OutputError(f"writing {out} failed: out of disk space; the partial adapter "
                              f"was removed. Free some space, then run it again") from None
        raise
    log(f"wrote {out}: a peft LoRA adapter (r {config['r']}, alpha {config['lora_alpha']:g}, "
        f"{len(tensors)} tensors on {', '.join(config['target_modules'])}) for the base "
        f"{loaded.hf_folder or 'model (randomly initialised: no folder to name)'}")
    return {"path": out, "tensors": len(tensors)}


def moved_expert_bias(loaded) -> list:
    """The routers' expert-bias buffers of a LoRA checkpoint that differ from its base's."""
    import torch

    base = loaded.base_expert_bias or {}
    return [name for name, buffer in loaded.model.named_buffers()
            if name in base and not torch.equal(buffer, base[name])]


def to_mcore(args: ExportArguments, log) -> Dict[str, object]:
    from .checkpointing import TrainState, save_checkpoint
    from .loaded_model import load_model, with_flags
    from .run_config import resolve
    from .runtime import run_lock

    # It writes a checkpoint into --output_dir: never while a run works in that folder.
    run_lock.acquire(args.output_dir, "swift-mcore export --to_mcore")
    try:
        loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                            trust_remote_code=args.trust_remote_code, tokenizer_optional=True)
        # A weights-only checkpoint: no optimizer state, iteration 0.
        flags = with_flags(loaded.flags, output_dir=os.path.abspath(args.output_dir),
                           no_save_optim=True)
        # It trains nothing: only the weights must fit (the folder was read already).
        config = resolve(flags, world_size=1, weights_only=True).complete(
            loaded.config.vocab_size, None,
            padded_vocab_size=loaded.config.padded_vocab_size)
        path, _, _ = save_checkpoint(config, TrainState(), [loaded.model], None, None, None)
    finally:
        run_lock.release(args.output_dir)
    log(f"wrote {path}: a swift-mcore checkpoint (weights only, iteration 0); train from it "
        f"with `swift-mcore pt --model {loaded.path} --load {path} --finetune`")
    result: Dict[str, object] = {"path": path}
    if args.test_convert_precision:
        result["max_logit_difference"] = compare_logits(loaded, loaded.path, log)
    return result


def compare_logits(loaded, hf_path: str, log) -> float:
    """Largest |logit difference| between the megatron model and transformers' model of
    ``hf_path`` on the same random tokens (float32, eager attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from .loaded_model import forward_logits

    if loaded.config.model.num_labels:
        return compare_scores(loaded, hf_path, log)
    hf_logging.disable_progress_bar()
    mtp_layers = loaded.config.model.mtp_num_layers or 0
    verbosity = hf_logging.get_verbosity()
    if mtp_layers:  # transformers' load report would list every MTP tensor as unexpected
        hf_logging.set_verbosity_error()
    try:
        # the families swift-mcore converts are transformers' own: no folder code is run
        hf = None if loaded.config.model.vision_config else \
            AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32,
                                                 attn_implementation="eager",
                                                 trust_remote_code=False).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    if mtp_layers:
        log(f"test_convert_precision: transformers builds no multi-token prediction layers; "
            f"the {mtp_layers} of {hf_path} are left out of the comparison")
    generator = torch.Generator().manual_seed(0)
    length = min(PRECISION_LENGTH, loaded.config.model.max_position_embeddings)
    tokens = torch.randint(0, loaded.vocab, (PRECISION_BATCH, length), generator=generator)
    if loaded.config.model.vision_config:  # a vision-language model: an image in each row
        from .models.vision import VisionLanguage, compare_logits as image_logits

        ours, theirs = image_logits(loaded.model, hf_path, VisionLanguage.from_model_args(
            loaded.config.model), tokens, loaded.vocab, generator)
    else:
        ours = forward_logits(loaded.model.float(), tokens)[..., : loaded.vocab].cpu()
        with torch.no_grad():
            theirs = hf(tokens).logits.float()
    diff = float((ours - theirs).abs().max())
    log(f"test_convert_precision: max |logit difference| {diff:.3g} (mean "
        f"{float((ours - theirs).abs().mean()):.3g}, logits up to "
        f"{float(theirs.abs().max()):.3g}) over {PRECISION_BATCH}x{length} tokens")
    return diff


def compare_scores(loaded, hf_path: str, log) -> float:
    """A reward model's --test_convert_precision: largest |score difference| between ours
    and transformers' *ForSequenceClassification of ``hf_path`` on the same random tokens
    (each read at its last non-pad token, both sides)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from .models.value_head import score_sequences

    hf_logging.disable_progress_bar()
    hf = AutoModelForSequenceClassification.from_pretrained(
        hf_path, dtype=torch.float32, attn_implementation="eager",
        trust_remote_code=False).eval()
    generator = torch.Generator().manual_seed(0)
    length = min(PRECISION_LENGTH, loaded.config.model.max_position_embeddings)
    tokens = torch.randint(0, loaded.vocab, (PRECISION_BATCH, length), generator=generator)
    ours = score_sequences(loaded.model.float(), tokens.tolist(),
                           hf.config.pad_token_id).cpu()
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    diff = float((ours - theirs).abs().max())
    log(f"test_convert_precision: max |score difference| {diff:.3g} (scores up to "
        f"{float(theirs.abs().max()):.3g}) over {PRECISION_BATCH} sequences of {length} "
        f"tokens")
    return diff


def _source_dtype(loaded) -> torch.dtype:
    """The source config.json's dtype when the model came from one, else the weights'."""
    from .input_files import load_json
    from .models.hf_save import DTYPES

    if loaded.hf_folder:  # a regular file only, bounded JSON (input_files)
        config = load_json(os.path.join(loaded.hf_folder, "config.json"))
        name = config.get("dtype") or config.get("torch_dtype") if isinstance(
            config, dict) else None
        if name in DTYPES:
            return DTYPES[name]
    return next(loaded.model.parameters()).dtype


def main(argv: List[str]) -> int:
    from .launch import run_command

    return run_command("export", argv, parse, run)
