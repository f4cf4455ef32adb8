"""`swift-mcore export`: a checkpoint to a Hugging Face folder (--to_hf), a Hugging Face folder
to a checkpoint (--to_mcore), and the logit comparison of both (--test_convert_precision)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

import torch

from .arguments.export import ExportArguments

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
    return ExportArguments(**vars(parser.parse_args(argv))).validate()


def run(args: ExportArguments, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Convert as the flags say; returns what was written (and the logit difference)."""
    if args.to_hf:
        return to_hf(args, log)
    return to_mcore(args, log)


def to_hf(args: ExportArguments, log) -> Dict[str, object]:
    from .models.convert import Layout, canonical
    from .models.hf_save import DTYPES, parse_size, save_hf_folder
    from .models.source import load_model

    loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                        trust_remote_code=args.trust_remote_code)
    layout = Layout.from_model_args(loaded.args.model, loaded.padded_vocab)
    state = {canonical(k): v for k, v in loaded.model.state_dict().items()
             if not k.endswith("_extra_state")}
    dtype = DTYPES[args.dtype] if args.dtype else _source_dtype(loaded)
    result = save_hf_folder(args.output_dir, loaded.args.model, layout, state.__getitem__,
                            loaded.tokenizer, dtype, base_folder=loaded.hf_folder,
                            max_shard_bytes=parse_size(args.max_shard_size))
    log(f"wrote {result['path']}: a {result['family']} model, {result['tensors']} tensors in "
        f"{result['shards']} safetensors file(s), {result['bytes'] / 1e6:.1f} MB "
        f"({str(dtype).replace('torch.', '')})")
    if args.test_convert_precision:
        result["max_logit_difference"] = compare_logits(loaded, result["path"], log)
    return result


def to_mcore(args: ExportArguments, log) -> Dict[str, object]:
    from .checkpointing import TrainState, save_checkpoint
    from .models.source import load_model

    loaded = load_model(args.model, tokenizer=args.tokenizer, log=log,
                        trust_remote_code=args.trust_remote_code)
    run_args = loaded.args
    run_args.logging.output_dir = os.path.abspath(args.output_dir)
    # A weights-only checkpoint: no optimizer state, iteration 0.
    run_args.checkpoint.no_save = False
    run_args.checkpoint.no_save_optim = True
    path = save_checkpoint(run_args, TrainState(), [loaded.model], None, None, None)
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

    from .models.source import forward_logits

    hf_logging.disable_progress_bar()
    # the families swift-mcore converts are transformers' own: no folder code is ever run
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32,
                                              attn_implementation="eager",
                                              trust_remote_code=False).eval()
    generator = torch.Generator().manual_seed(0)
    length = min(PRECISION_LENGTH, loaded.args.model.max_position_embeddings)
    tokens = torch.randint(0, loaded.vocab, (PRECISION_BATCH, length), generator=generator)
    ours = forward_logits(loaded.model.float(), tokens)[..., : loaded.vocab].cpu()
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
    diff = float((ours - theirs).abs().max())
    log(f"test_convert_precision: max |logit difference| {diff:.3g} (mean "
        f"{float((ours - theirs).abs().mean()):.3g}, logits up to "
        f"{float(theirs.abs().max()):.3g}) over {PRECISION_BATCH}x{length} tokens")
    return diff


def _source_dtype(loaded) -> torch.dtype:
    """The source config.json's dtype when the model came from one, else the weights'."""
    import json

    from .models.hf_save import DTYPES

    if loaded.hf_folder:
        with open(os.path.join(loaded.hf_folder, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
        name = config.get("dtype") or config.get("torch_dtype")
        if name in DTYPES:
            return DTYPES[name]
    return next(loaded.model.parameters()).dtype


def main(argv: List[str]) -> int:
    from .cli import run_command

    return run_command("export", argv, parse, run)


# torchrun's variables: a child export must build its own one-rank process group.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                "MASTER_PORT", "NPROC_PER_NODE", "NNODES", "NODE_RANK")


def export_in_subprocess(checkpoint: str, out_dir: str, timeout: Optional[float] = None) -> str:
    """`swift-mcore export --to_hf` in a fresh process (its own one-rank process group, so a
    training run of any layout can call it); returns its last output line."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    cmd = [sys.executable, "-m", "swift_mcore", "export", "--to_hf", "--model", checkpoint,
           "--output_dir", out_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else f"wrote {out_dir}"
